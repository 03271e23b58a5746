"""Model Runner V2.

What belongs here: what every model step needs — applying the scheduler's changes to the
persistent request state, building the step's inputs and attention metadata, running the model,
sampling, and handing back sampled tokens with exactly one device→host sync. What does not: model
math (model files), where tokens and KV live across ranks (the token planner,
`distributed/pcp_manager.py`, and the layers' KV access, chosen once at start-up), features with
state beside the model (their `StepHooks`, e.g. HiSparse), moving KV to or from other engines (the
KV connector, a no-op unless configured).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.attention.kv_access import KVAccess, LocalKVAccess
from vllm.attention.metadata import MLAMetadata, decode_token_rows
from vllm.config import VllmConfig
from vllm.core.messages import (
    CachedRequestData,
    KVCachePlan,
    KVPageUpdate,
    ModelRunnerOutput,
    NewRequestData,
    SamplingOptions,
    SchedulerOutput,
    TokenLogprobs,
)
from vllm.distributed.ep import ep_forward, fixed_capacity, max_tokens_across_ep
from vllm.distributed.kv_transfer import KVConnectorBase, NoOpConnector, step_output
from vllm.distributed.parallel_state import ParallelContext
from vllm.distributed.pcp_manager import RankStep, make_cp_planner
from vllm.kv_cache_interface import KVCacheLayout, cdiv, kv_bytes_per_token
from vllm.utils import logger
from vllm.worker.gpu.cudagraph import DecodeGraphs
from vllm.worker.gpu.input_batch import StepInputs, build_step_inputs
from vllm.worker.gpu.kv_cache import WorkerKVCache
from vllm.worker.gpu.piecewise import MTPStack, PiecewiseGraphs, TargetStack, static_bytes
from vllm.worker.gpu.sampler import SamplingBatch, prompt_logprobs, sample
from vllm.worker.gpu.spec_decode import DraftBatch, make_drafter
from vllm.worker.gpu.staging import HostStaging
from vllm.worker.gpu.states import RequestStates
from vllm.worker.gpu.step_hooks import StepHooks

_NO_ROWS = np.zeros(0, dtype=np.int64)


def _inference(fn):
    """``fn`` under torch.inference_mode(), entered only when it is not on already: the
    worker's loop runs in it, and entering it costs ~20 µs of host time a step on a GPU host."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run


class ModelRunner:
    def __init__(
        self,
        config: VllmConfig,
        model,
        pc: ParallelContext,
        device: torch.device,
        connector: KVConnectorBase | None = None,
    ):
        self.config, self.model, self.pc, self.device = config, model, pc, device
        mc = config.model_config
        self.arch = mc.arch
        self.layout = KVCacheLayout.from_arch(self.arch, config.cache_config.cache_dtype, mc.dtype)
        self.scheduler_block_size = config.scheduler_block_size
        self.max_blocks_per_req = cdiv(mc.max_model_len, self.scheduler_block_size)
        self.states = RequestStates(
            config.scheduler_config.max_num_seqs,
            self.max_blocks_per_req,
            device,
            mc.vocab_size,
            config.num_spec_tokens,
        )
        self.eos_ids = list(self.arch.eos_token_id)
        self._grammar: tuple[list[str], bytes] = ([], b"")  # this step's structured-output rows
        self._plan_cache: tuple | None = None  # (req_ids, states.version, SamplingPlan)
        self.connector = connector or NoOpConnector()
        self.force_mqa = config.attention_config.sparse_mla_force_mqa
        self.num_blocks = 0
        self.planner = make_cp_planner(config.parallel_config, pc)
        self.staging = HostStaging(device)
        self.kv_cache, self.hooks, self.kv_access = self._kv_features()
        # the per-request update hook is skipped when the feature keeps the no-op default
        self._hooks_update = type(self.hooks).update_request is not StepHooks.update_request
        self.drafter = make_drafter(self)
        self.graphs: DecodeGraphs | None = None  # built once the KV cache exists
        self.piecewise: PiecewiseGraphs | None = None  # likewise
        self.mtp_piecewise: list[PiecewiseGraphs] = []  # one per MTP layer, with the above
        self._piecewise_used = False  # this step ran a forward through them

    def _kv_features(self) -> tuple[WorkerKVCache, StepHooks, KVAccess]:
        """Where this rank's KV lives, chosen once: the device cache (rows reached locally, or
        across the DCP group), or HiSparse's device + host pools (also the step's hooks)."""
        cfg = self.config
        layers = self.model.attention_layers()
        override = cfg.cache_config.num_gpu_blocks_override
        hs_cfg = cfg.attention_config.hisparse
        if hs_cfg is not None:
            from vllm.hisparse.worker import HiSparseWorker

            hs = HiSparseWorker(
                layers,
                self.layout,
                self.states.block_table,
                self.max_blocks_per_req,
                cfg.hot_buffer_rows,
                cfg.hisparse_host_pool_gib,
                self.device,
                override,
            )
            hs.h2d = self.staging.to_device
            if cfg.offload_config.enabled:
                logger.info(
                    "HiSparse host pool %.2f GiB per rank: hisparse_config.host_pool_gib %.2f + "
                    "--kv-offloading-size's share %.2f, one pinned pool for running requests' "
                    "pages and the prefix cache (the offload tier); its indexer keys stay on "
                    "the GPU (%.1f %% of the pool's size, from the KV budget)",
                    cfg.hisparse_host_pool_gib,
                    hs_cfg.host_pool_gib,
                    cfg.hisparse_host_pool_gib - hs_cfg.host_pool_gib,
                    100
                    * hs.idx_bytes_per_block()
                    / (hs.mla_bytes_per_block() + hs.idx_bytes_per_block()),
                )
            return hs, hs, hs.kv_access
        par = cfg.parallel_config
        if par.decode_context_parallel_size > 1:
            from vllm.distributed.cp_attention import DCPKVAccess

            access = DCPKVAccess(self.pc, par.dcp_comm_backend, par.cp_kv_cache_interleave_size)
        else:
            access = LocalKVAccess(self.pc.pcp)
        kv = WorkerKVCache(layers, self.layout, self.kv_bytes_per_block(), self.device, override)
        return kv, StepHooks(), access

    # ---- KV cache ------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """Bytes one 64-token block takes on this rank across every attention layer."""
        per_token = kv_bytes_per_token(
            self.arch,
            self.layout.cache_dtype,
            self.config.model_config.dtype,
            num_mtp_layers=self.model.num_mtp,
        )
        return per_token * self.layout.block_size

    def activation_bytes(self) -> int:
        """Estimated peak activation bytes of one step on this rank (:func:`activation_bytes`)."""
        return activation_bytes(
            self.arch,
            self.config.model_config.dtype,
            self.config.scheduler_config.max_num_batched_tokens,
            tp_size=self.pc.tp.world_size,
            pcp_size=self.pc.pcp.world_size,
        )

    def plan_kv(self, budget_bytes: int) -> KVCachePlan:
        """Blocks per pool for a KV budget (bytes of device memory on this rank)."""
        return self.kv_cache.plan(budget_bytes)

    def initialize_kv_cache(self, plan: KVCachePlan) -> None:
        self.num_blocks = plan.num_blocks
        self.kv_plan = plan
        self.kv_cache.allocate(plan, self.kv_access)
        cc = self.config.compilation_config
        if cc.use_cudagraph:
            self._capture_decode_graphs(plan)
        if cc.use_piecewise:
            if self.pc.ep is not None and self.pc.ep.world_size > 1:
                # every EP rank would have to replay the same size each step (MoE dispatch)
                logger.info("piecewise CUDA graphs off under expert parallelism")
            else:
                self._capture_piecewise(cc.piecewise_capture_sizes)

    def _capture_piecewise(self, sizes: tuple[int, ...]) -> None:
        """The target's piecewise graphs, then (with MTP) the drafter's, in the same pool. A
        capture that fails (an operation a graph cannot hold) turns them off with the error in
        the log: those forwards then run eagerly, as without the graphs (the eager and the
        piecewise forward issue the same collectives, so ranks may differ in this)."""
        try:
            self.piecewise = PiecewiseGraphs(self, sizes, TargetStack(self.model))
            self.piecewise.capture_all()
            if self.config.num_spec_tokens:
                pool = self.piecewise.pool
                self.mtp_piecewise = [
                    PiecewiseGraphs(self, sizes, MTPStack(self.model, j), f"MTP layer {j}", pool)
                    for j in range(self.model.num_mtp)
                ]
                for g in self.mtp_piecewise:
                    g.capture_all()
        except RuntimeError as e:
            if self.device.type != "cuda":
                raise
            logger.error("piecewise CUDA graphs off: their capture failed (%s)", e)
            self.piecewise, self.mtp_piecewise = None, []
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def _capture_decode_graphs(self, plan: KVCachePlan) -> None:
        cc = self.config.compilation_config
        # the longest context a request can have here: the device pool, or HiSparse's host
        # pool, which holds every page; under DCP each rank holds one token in N of it
        held = max(plan.num_blocks, plan.num_host_blocks) * self.layout.block_size
        held *= self.config.parallel_config.decode_context_parallel_size
        max_ctx = min(self.config.model_config.max_model_len, held)
        sizes = self._capture_sizes(cc.cudagraph_capture_sizes)
        if not sizes:
            logger.info(
                "CUDA graphs off: no capture size fits EP's fixed capacity at %d tokens a row",
                1 + self.config.num_spec_tokens,
            )
            return
        self.graphs = DecodeGraphs(self, sizes, max_ctx, self.config.num_spec_tokens)
        self.graphs.capture_all()

    def warm_up(self) -> list[int]:
        """Run the eager path once at start-up for each kind of step a server will see, so that
        its Triton kernels compile here and not inside a request (a first-use compile is a
        TTFT of seconds): prefills of every power of two up to the step budget and one token
        short of each (Triton specialises integer arguments on divisibility by 16, so both
        kinds of token count compile), then a mixed step (a decode row beside a prefill chunk),
        then one prompt in chunks (:meth:`_warm_up_chunks`: chunks with context).
        The requests are the runner's own, on the first KV blocks, and are finished before it
        returns: at start-up no block holds anything. Under HiSparse each page also gets the
        host and indexer pages of the same number, all of it resident (what a short request
        has; the miss path's kernels compile with the decode graphs' capture). Every rank runs
        the same steps (they are collective where steps are). Returns the prompt lengths run."""
        hs = self.config.attention_config.hisparse is not None
        sbs = self.scheduler_block_size
        pages = self.num_blocks
        if hs:
            plan = self.kv_plan
            pages = min(pages, plan.num_host_blocks, plan.num_idx_blocks)
        cap = min(
            self.config.scheduler_config.max_num_batched_tokens,
            self.config.model_config.max_model_len - 1,
            pages * sbs - 1,
        )
        lengths = warm_up_lengths(cap)
        if not lengths:
            return []
        greedy = SamplingOptions(temperature=0.0, max_tokens=2)
        vocab = self.config.model_config.vocab_size

        sampled = SamplingOptions(temperature=1.0, max_tokens=2, seed=0)

        def request(rid: str, n: int, first_block: int, sp=greedy) -> NewRequestData:
            tokens = [(7919 * i + n) % vocab for i in range(n)]
            blocks = list(range(first_block, first_block + cdiv(n + 1, sbs)))
            upd = KVPageUpdate(host=blocks, idx=list(blocks)) if hs else None
            return NewRequestData(rid, tokens, n, blocks, 0, sp, upd)

        prev: list[str] = []
        for i, n in enumerate(lengths):
            r = request(f"__warmup{i}", n, 0)
            self.execute(
                SchedulerOutput(
                    new_reqs=[r],
                    num_scheduled_tokens={r.req_id: n},
                    total_num_scheduled_tokens=n,
                    finished_req_ids=prev,
                )
            )
            prev = [r.req_id]
        # a mixed step: the last request decodes its next token beside a new prompt chunk, on
        # the blocks after its own (when the cache holds both, and the engine runs two requests
        # at once: with max_num_seqs 1 no step ever mixes)
        n_last = lengths[-1]
        start = cdiv(n_last + 1, sbs)
        n = min(cap - 1, pages * sbs - start * sbs - 1)
        if n > 0 and self.config.scheduler_config.max_num_seqs >= 2:
            # sampled, not greedy: the Gumbel-max kernel compiles here, not in the first
            # request with a temperature
            r = request("__warmup_mixed", n, start, sampled)
            upd = KVPageUpdate(host=[], idx=[]) if hs else None
            self.execute(
                SchedulerOutput(
                    new_reqs=[r],
                    cached_reqs=[CachedRequestData(prev[0], [], n_last, upd)],
                    num_scheduled_tokens={prev[0]: 1, r.req_id: n},
                    total_num_scheduled_tokens=n + 1,
                )
            )
            prev.append(r.req_id)
        self.execute(SchedulerOutput(finished_req_ids=prev))
        self._warm_up_chunks(cap, pages * sbs - 1, request, hs)
        return lengths

    def _warm_up_chunks(self, cap: int, room: int, request, hs: bool) -> None:
        """One prompt in chunks (:func:`warm_up_chunks`): each chunk after the first reads its
        context from the cache and attends to it causally from the right (the dense path's
        lower-right mask, a kernel and an import of its own), and, where the model's length
        allows, a chunk past ``index_topk`` takes the indexer-scored sparse prefill."""
        limit = min(self.config.model_config.max_model_len - 1, room)
        chunks = warm_up_chunks(cap, self.arch.index_topk, limit)
        if len(chunks) < 2:
            return
        total = sum(n for _, n in chunks)
        r = request("__warmup_chunked", total, 0)
        for i, (start, n) in enumerate(chunks):
            upd = KVPageUpdate(host=[], idx=[]) if hs else None
            self.execute(
                SchedulerOutput(
                    new_reqs=[r] if i == 0 else [],
                    cached_reqs=[] if i == 0 else [CachedRequestData(r.req_id, [], start, upd)],
                    num_scheduled_tokens={r.req_id: n},
                    total_num_scheduled_tokens=n,
                )
            )
        self.execute(SchedulerOutput(finished_req_ids=[r.req_id]))

    def precompile(self) -> tuple[int, float]:
        """Compile, without running them, the kernel variants that follow a request's context
        rather than the step's size: the indexer's top-k, whose constexprs change at every power
        of two of the context (:func:`vllm.kernels.triton.topk.topk_compile_plan`), for every
        context up to ``max_model_len`` and every row count up to the step budget. The prefill
        warm-up covers step sizes, not contexts; a compile inside a request stalls its step by
        0.2-1 s. No memory and no state is touched, so HiSparse runs it too. Returns (variants,
        seconds); CUDA only."""
        layers = self.model.attention_layers()
        if self.device.type != "cuda" or not any(a.has_indexer for a in layers):
            return 0, 0.0
        from vllm.kernels.triton.precompile import precompile
        from vllm.kernels.triton.topk import topk_compile_plan

        sc = self.config.scheduler_config
        rows = max(sc.max_num_batched_tokens, sc.max_num_seqs * (1 + self.config.num_spec_tokens))
        # DCP's decode top-k runs over the group's gathered queries
        rows *= self.config.parallel_config.decode_context_parallel_size
        max_len = self.config.model_config.max_model_len
        return precompile(topk_compile_plan(rows, max_len, self.arch.index_topk))

    def _capture_sizes(self, sizes: tuple[int, ...]) -> tuple[int, ...]:
        """The batch sizes to capture (empty: none fits). A row holds q = 1 + k tokens, and B·q
        stays within the largest configured size. Under EP every MoE pass of a graph — the
        verify forward and the first drafting pass over B·q tokens, the chained drafting passes
        over B — must take EP's fixed-capacity dispatch, which reads nothing on the host."""
        q = 1 + self.config.num_spec_tokens
        ep, tp = self.pc.ep, self.pc.tp.world_size

        def fits(num_tokens: int) -> bool:
            return ep is None or ep.world_size == 1 or fixed_capacity(num_tokens, tp) is not None

        sizes = tuple(s for s in sizes if fits(s))
        if not sizes:
            return ()
        sizes = tuple(x for x in sizes if x * q <= max(sizes)) or sizes[:1]
        return tuple(s for s in sizes if fits(s * q))

    def _graph_size(self, num_reqs: int | None) -> int | None:
        """The captured size this step replays, agreed by every EP rank (one host all-reduce,
        as the eager path's): a rank whose step cannot replay (``num_reqs`` None) sends every
        rank eager; otherwise all replay the size of the largest batch (0: an idle replica)."""
        ep = self.pc.ep
        if ep is None or ep.world_size == 1:
            return self.graphs.size_for(num_reqs) if num_reqs else None
        t = torch.tensor([int(num_reqs is None), num_reqs or 0], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=ep.cpu_group)
        eager, most = t.tolist()
        return None if eager or most == 0 else self.graphs.size_for(most)

    def graph_pool_bytes(self) -> int:
        """Estimated device memory of the CUDA graphs (kept out of the KV budget). Decode graphs'
        pool: a step's activations at the largest captured batch, its logits, and the indexer's
        [batch, context] scores at the longest context; under DCP also the group's gathered
        rows: queries, partial outputs and LSEs of every head (fp32), and the indexer's top-k
        candidates (score and position). Piecewise graphs: their pool (one step's activations at
        their largest token count) and each stack's static buffers (the target's, the MTP
        layers')."""
        cc = self.config.compilation_config
        dtype, tp = self.config.model_config.dtype, self.pc.tp.world_size
        out = 0
        if cc.use_piecewise:
            n = cc.piecewise_capture_sizes[-1]
            stacks = 1 + (self.model.num_mtp if self.config.num_spec_tokens else 0)
            out += activation_bytes(self.arch, dtype, n, tp_size=tp)
            out += stacks * static_bytes(self.arch, dtype, n, tp)
        if not cc.use_cudagraph:
            return out
        n = cc.max_capture_size
        acts = activation_bytes(self.arch, dtype, n, tp_size=tp)
        out += acts + n * self.arch.vocab_size * 8 + n * self.config.model_config.max_model_len * 8
        dcp = self.config.parallel_config.decode_context_parallel_size
        if dcp > 1:
            a = self.arch
            heads = a.num_attention_heads // self.pc.tp.world_size
            row = heads * (2 * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank + 1) * 4
            out += dcp * n * (1 + self.config.num_spec_tokens) * (row + 2 * a.index_topk * 8)
        return out

    # ---- one step ------------------------------------------------------------------------------
    def update_states(self, so: SchedulerOutput) -> dict[str, int]:
        for rid in so.finished_req_ids:
            self.states.remove(rid)
        start_of: dict[str, int] = {}
        for r in so.new_reqs:
            slot = self.states.add(r, self.eos_ids, self.staging.to_device)
            start_of[r.req_id] = r.num_computed_tokens
            self.hooks.add_request(slot, r)
        cached = so.cached_reqs
        self.states.append_blocks(
            [(c.req_id, c.new_block_ids) for c in cached if c.new_block_ids],
            self.staging.to_device,
        )
        start_of.update([(c.req_id, c.num_computed_tokens) for c in cached])
        if self._hooks_update:
            slot_of = self.states.slot_of
            for c in cached:
                self.hooks.update_request(slot_of[c.req_id], c)
        return start_of

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and read its results (:meth:`launch` then :meth:`finish`)."""
        return self.finish(self.launch(so))

    @_inference
    def launch(self, so: SchedulerOutput) -> PendingStep:
        """Queue the step's device work (inputs, forward, sampling, drafting, the copies of its
        results to the host) without waiting for it. :meth:`finish` reads the results; until
        then the host may build and launch the next step (see :meth:`can_pipeline`)."""
        start_of = self.update_states(so)
        self._piecewise_used = False
        self.connector.bind_connector_metadata(so.kv_connector_metadata)
        self.connector.start_load_kv(so)  # loads progress in steps that compute nothing too
        if so.total_num_scheduled_tokens == 0:
            if so.dummy:
                self._dummy_step()
            out = ModelRunnerOutput(step=so.step)
            out.kv_connector_output = step_output(self.connector, so.finished_req_ids)
            return PendingStep(step=so.step, done=out)
        n_dec = self._decode_rows_first(so, start_of)
        inp = build_step_inputs(so, self.states, self.device, start_of, self.staging)
        self.hooks.before_forward(inp)
        self._grammar = (so.grammar_req_ids, so.grammar_bitmask)
        # built while the device runs the forward (nothing here reads the logits)
        plan = self._sampling_plan(inp)
        size = self._graph_size(self.graphs.decode_batch(inp)) if self.graphs else None
        hidden = logits = target = argmax = None
        split = None
        if size is not None:  # a decode-only step: replay its CUDA graph, logits included
            logits = self.graphs.run(inp, size)
            argmax = self.graphs.argmax
        elif n_dec and (size := self._split_size(inp, plan, n_dec)) is not None:
            logits, target, hidden = self._run_split(inp, plan, n_dec, size)
            split = (n_dec, size, target, hidden)
            hidden = target = None
        else:
            target = self.prepare(inp)
            hidden = self.forward(*target)
        self.hooks.after_forward(inp)
        self.connector.wait_for_save()
        pending = self._sample(inp, plan, hidden, so.step, logits, target, size, split, argmax)
        pending.finished_req_ids = so.finished_req_ids
        pending.num_tokens = so.total_num_scheduled_tokens
        if split:
            pending.stats["cudagraph_split_steps"] = 1
        if self._piecewise_used:
            pending.stats["piecewise_steps"] = 1
            self._piecewise_used = False
        return pending

    def can_pipeline(self, pending: PendingStep) -> bool:
        """Whether the next step may be launched before ``pending``'s results are read: the next
        step's inputs must not need them on the host. Not with drafts to verify (the accepted
        counts), bad words (their prefix match reads the sampled tokens), step hooks that do not
        pipeline (``StepHooks.pipelines``) or a KV connector (it keeps host state per step)."""
        return (
            pending.done is None
            and "accepted" not in pending.host
            and not len(pending.bad_words)
            and self.hooks.pipelines
            and isinstance(self.connector, NoOpConnector)
        )

    def finish(self, pending: PendingStep) -> ModelRunnerOutput:
        """Wait for a launched step and build its output (the step's one device→host sync)."""
        if pending.done is not None:
            return pending.done
        if pending.event is not None:
            pending.event.synchronize()
            self.staging.synced(pending.arena)
        # else: no results to wait for (CPU, or a step that samples nothing); its arena stays
        # busy until the event its launch recorded is done (HostStaging.to_device waits on it)
        out = self._build_output(pending)
        out.stats.update(pending.stats)
        out.kv_connector_output = step_output(self.connector, pending.finished_req_ids)
        return out

    # ---- mixed steps: the decode rows replay their graph, the prompt chunks run eagerly ------
    def _decode_rows_first(self, so: SchedulerOutput, start_of: dict[str, int]) -> int:
        """A step with both decode rows (the last sampled token, and with MTP up to k drafts to
        verify) and prompt chunks, where the decode rows may replay a graph by themselves:
        reorders ``so``'s rows decode rows first and returns how many (0: the step runs as one).
        With MTP the decode rows' drafting replays the drafting graph and the chunks' drafting
        runs eagerly. Not under EP (every EP rank would have to split alike), HiSparse and KV
        connectors (their step hooks see the step as one batch); the scheduler reads outputs by
        request id."""
        g, cfg = self.graphs, self.config
        if g is None or (self.pc.ep is not None and self.pc.ep.world_size > 1):
            return 0
        if not so.new_reqs and so.total_num_scheduled_tokens == len(so.num_scheduled_tokens):
            return 0  # one token per row: decode only (a rare one-token prompt chunk: eager)
        if cfg.attention_config.hisparse is not None or cfg.uses_kv_connector:
            return 0
        st, sched = self.states, so.num_scheduled_tokens
        dec = [
            r for r, n in sched.items() if n <= g.q and start_of[r] >= st.num_known[st.slot_of[r]]
        ]
        if not dec or len(dec) == len(sched) or len(dec) > g.sizes[-1]:
            return 0
        if (st.prompt_logprobs[[st.slot_of[r] for r in sched]] >= 0).any():
            return 0  # prompt logprobs read the whole step's hidden states
        first = set(dec)
        so.num_scheduled_tokens = {r: sched[r] for r in dec} | {
            r: n for r, n in sched.items() if r not in first
        }
        return len(dec)

    def _split_size(self, inp: StepInputs, plan, n_dec: int) -> int | None:
        """The graph size of the first n_dec rows, if they are decode rows that each sample."""
        if plan is None or inp.is_prefill[:n_dec].any() or len(plan.rows) < n_dec:
            return None
        if not (plan.rows[:n_dec] == np.arange(n_dec)).all():
            return None
        return self.graphs.size_for(n_dec)

    def _run_split(self, inp: StepInputs, plan, n_dec: int, size: int):
        """Logits of the step's sampled positions, rows in order: the decode rows' graph replay
        (host-light), then the prompt chunks' eager forward, queued behind it on the device.
        Returns them with the chunks' (RankStep, metadata) and hidden states (their drafting)."""
        logits_d = self.graphs.run(inp.rows(0, n_dec), size)
        rest = inp.rows(n_dec, len(inp.req_ids))
        target = self.prepare(rest)
        hidden = self.forward(*target)
        tok = plan.sampled_tok[_decode_samples(plan, n_dec) :] - int(inp.query_start_loc[n_dec])
        if not len(tok):
            return logits_d, target, hidden
        logits_p = self.model.compute_logits(hidden[self.staging.to_device(tok)])
        return torch.cat([logits_d, logits_p]), target, hidden

    def _draft_split(self, inp: StepInputs, plan, split, sampled, accepted) -> None:
        """The drafting of a split step: the decode rows' drafting graph, then the chunks'
        eager drafting pass (the MTP layer over every chunk token: its KV, and the drafts of
        the rows that finish their prompt)."""
        n_dec, size, target, hidden = split
        nsd = _decode_samples(plan, n_dec)
        acc = (None, None) if accepted is None else (accepted[:n_dec], accepted[n_dec:])
        self.graphs.draft(inp.rows(0, n_dec), size, sampled[:nsd], acc[0])
        rows = plan.rows[n_dec:] - n_dec
        rest = inp.rows(n_dec, len(inp.req_ids))
        t0 = int(inp.query_start_loc[n_dec])
        self.drafter.propose(
            DraftBatch(
                rest,
                rows,
                *target,
                hidden,
                sampled[nsd:] if len(rows) else None,
                plan.sampled_tok[nsd:] - t0,
                plan.first[n_dec:] - nsd,
                acc[1],
            )
        )

    def prepare(self, inp: StepInputs) -> tuple[RankStep, MLAMetadata]:
        """This rank's share of the step and its attention metadata."""
        step = self.planner.shard(inp)
        meta = self.metadata(inp, step)
        self.hooks.build_metadata(inp, meta)
        return step, meta

    def forward(self, step: RankStep, meta: MLAMetadata) -> torch.Tensor:
        """The model over this rank's tokens -> [T, hidden] for every token, in batch order."""
        hidden = self._run_model(step, meta)
        return self.planner.gather_hidden(hidden, step)

    def _run_model(self, step: RankStep, meta: MLAMetadata) -> torch.Tensor:
        """self.model over this rank's tokens, its MoE layers' EP dispatch shapes agreed with
        every EP rank first (`distributed/ep.py`: one host all-reduce; nothing without EP)."""
        t = step.input_ids.shape[0]
        pw = self.piecewise
        if pw is not None and t and pw.covers(t):
            self._piecewise_used = True
            return pw.run({"ids": step.input_ids}, step.positions, meta)
        with ep_forward(max_tokens_across_ep(self.pc, t)):
            return self.model(step.input_ids, step.positions, meta)

    def metadata(self, inp: StepInputs, step: RankStep) -> MLAMetadata:
        """Attention metadata for this rank's share of the step."""
        topk = self.arch.index_topk
        seq_lens = inp.seq_lens.tolist()
        is_prefill = inp.is_prefill.tolist()
        dense = [
            p and s <= topk and not self.force_mqa
            for p, s in zip(is_prefill, seq_lens, strict=True)
        ]
        meta = MLAMetadata(
            layout=self.layout,
            index_topk=topk,
            positions=step.positions,
            token_req=step.token_req,
            query_start_loc_cpu=step.query_start_loc_cpu,
            seq_lens=self.staging.to_device(inp.seq_lens),
            seq_lens_cpu=seq_lens,
            block_table=self.states.block_table[inp.idx_mapping],
            is_prefill_cpu=is_prefill,
            use_dense_cpu=dense,
            slot_mapping=torch.empty(0, dtype=torch.long, device=self.device),
            positions_cpu=step.positions_cpu,
            decode_tokens=decode_token_rows(
                step.query_start_loc_cpu, is_prefill, self.device, self.staging.to_device
            ),
            cp=step.cp,
        )
        meta.slot_mapping = meta.slots_for(step.kv_token_req, step.kv_positions)
        return meta

    def _dummy_step(self) -> None:
        """DP replicas sharing EP: a step with no requests whose collectives match the others'
        — replaying the graphs they replay (the verify graph, then the drafting graph), all rows
        padding, when they replay; else the target forward and the drafter's passes on one
        padding token, as an eager step's."""
        if self.graphs is not None:
            size = self._graph_size(0)
            if size is not None:
                self.graphs.run(None, size)
                self.graphs.draft(None, size, None, None)
                return
        step = self.planner.dummy_step(self.device)
        if step is None:
            return
        meta = self.dummy_metadata(step)
        self.planner.gather_hidden(self._run_model(step, meta), step)
        self.drafter.dummy(step, meta)

    def dummy_metadata(self, step: RankStep) -> MLAMetadata:
        """Metadata of a dummy step (no requests, padding tokens only)."""
        z = torch.zeros(0, dtype=torch.int64, device=self.device)
        return MLAMetadata(
            layout=self.layout,
            index_topk=self.arch.index_topk,
            positions=step.positions,
            token_req=step.token_req,
            query_start_loc_cpu=step.query_start_loc_cpu,
            seq_lens=z,
            seq_lens_cpu=[],
            block_table=self.states.block_table[:0],
            is_prefill_cpu=[],
            use_dense_cpu=[],
            slot_mapping=torch.full_like(step.kv_positions, -1),
            cp=step.cp,
        )

    # ---- sampling --------------------------------------------------------------------------------
    def _sampling_batch(
        self, inp: StepInputs, rows: np.ndarray, positions: np.ndarray
    ) -> SamplingBatch:
        """Parameters of the sampled positions: batch row ``rows[i]`` samples the token at
        ``positions[i]`` (a row verifying drafts samples several)."""
        st, slots, h2d = self.states, inp.idx_np[rows], self.staging.to_device
        lb = st.logit_bias
        banned_r, banned_t = lb.bad_word_bans(slots) if lb.num_on else ([], [])
        # min_tokens: the stop tokens are banned until enough outputs exist (rows found by an
        # array compare: a Python loop over every row cost ~0.1 ms a step at B = 256)
        for i in np.nonzero(st.num_generated[slots] < st.min_tokens[slots])[0].tolist():
            stop = st.stop_ids[slots[i]]
            banned_r += [i] * len(stop)
            banned_t += stop
        banned = None
        if banned_r:
            banned = (h2d(np.array(banned_r, dtype=np.int64)), h2d(np.array(banned_t, np.int64)))
        # a greedy batch takes the argmax: no per-row parameters to gather on the device
        greedy = bool(st.greedy[slots].all())
        penalised = bool(st.penalties.on[slots].any())
        dslots = h2d(slots) if penalised or not greedy else None
        return SamplingBatch(
            temperature=None if greedy else st.temperature[dslots],
            top_k=None if greedy else st.top_k[dslots],
            top_p=None if greedy else st.top_p[dslots],
            min_p=None if greedy else st.min_p[dslots],
            seeds=None if greedy else st.seeds[dslots],
            positions=None if greedy else h2d(positions),
            all_greedy=greedy,
            any_top_k=not greedy and bool(st.top_k_on[slots].any()),
            any_top_p=not greedy and bool(st.top_p_on[slots].any()),
            any_min_p=not greedy and bool(st.min_p_on[slots].any()),
            max_logprobs=int(st.logprobs[slots].max(initial=-1)),
            banned=banned,
            allowed=lb.gather_allowed(slots, h2d) if lb.num_on else None,
            bias=lb.gather_bias(slots, h2d) if lb.num_on else None,
            penalties=st.penalties.gather(slots, dslots) if penalised else None,
            grammar=self._grammar_rows(inp, rows),
        )

    def _grammar_rows(self, inp: StepInputs, rows: np.ndarray) -> torch.Tensor | None:
        """The scheduler's bitmask rows placed at the batch's sampling rows (-1: unconstrained)."""
        ids, raw = self._grammar
        if not ids:
            return None
        words = (self.arch.vocab_size + 31) // 32
        sent = np.frombuffer(raw, dtype=np.int32).reshape(len(ids), words)
        where = {rid: i for i, rid in enumerate(ids)}
        out = np.full((len(rows), words), -1, dtype=np.int32)
        for i, b in enumerate(rows.tolist()):
            j = where.get(inp.req_ids[b])
            if j is not None:
                out[i] = sent[j]
        return self.staging.to_device(out)

    def _sampling_plan(self, inp: StepInputs) -> SamplingPlan | None:
        """Which positions the step samples, and their parameters (None: no row samples). A
        row verifying d drafts samples its last 1 + d positions."""
        rows = inp.sample_rows
        if not len(rows):
            return None
        nd = inp.num_drafts[rows]
        b = len(inp.req_ids)
        decode = len(rows) == b == len(inp.positions_np) and not nd.any()  # one token a row
        if decode and (cached := self._plan_cache) is not None:
            ids, version, plan = cached
            if version == self.states.version and ids == inp.req_ids and not self._grammar[0]:
                if not plan.batch.all_greedy:  # seeded noise follows the positions
                    plan.batch.positions = self.staging.to_device(inp.positions_np + 1)
                return plan
        if not nd.any():  # one sample a row (no drafts to verify): its last token
            first, lrows = np.arange(len(rows), dtype=np.int64), rows
            sampled_tok = inp.query_start_loc[rows + 1] - 1
        else:
            per = 1 + nd
            first = np.zeros(len(rows), dtype=np.int64)  # each row's first sampled position
            np.cumsum(per[:-1], out=first[1:])
            # the step token whose logits each sampled position takes: a row's last 1 + d
            sampled_tok = np.repeat(inp.query_start_loc[rows + 1] - per - first, per)
            sampled_tok += np.arange(int(per.sum()))
            lrows = np.repeat(rows, per)
        sb = self._sampling_batch(inp, lrows, inp.positions_np[sampled_tok] + 1)
        plan = SamplingPlan(rows, nd, first, sampled_tok, lrows, sb)
        # the next decode step of the same requests in the same slots reuses it, when its rows
        # need nothing that changes from step to step (bans, penalties' counts, a grammar)
        steady = (
            sb.banned is None
            and sb.penalties is None
            and sb.grammar is None
            and not self.states.logit_bias.num_on
        )
        self._plan_cache = (inp.req_ids, self.states.version, plan) if decode and steady else None
        return plan

    def _sample(
        self,
        inp: StepInputs,
        plan: SamplingPlan | None,
        hidden: torch.Tensor | None,
        step: int,
        logits=None,
        target=None,
        replayed: int | None = None,
        split=None,
        argmax: torch.Tensor | None = None,
    ) -> PendingStep:
        """Sample the rows that produce tokens, from ``hidden`` (every token's final hidden
        state) or, after a graph replay, from ``logits`` (one row per request). A row verifying
        d drafts samples its 1 + d positions and emits the accepted drafts and one more token;
        then the drafter proposes the next step's drafts (``target``: the step's (RankStep,
        metadata) of an eager step; ``replayed``: the size of a replayed graph, ``argmax``: its
        logits' argmax)."""
        st, h2d = self.states, self.staging.to_device
        rows = inp.sample_rows
        host: dict[str, torch.Tensor] = {}
        first, sampled_tok = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        sampled = accepted = None
        if plan is not None:
            nd, first, sampled_tok, lrows, sb = (
                plan.num_drafts,
                plan.first,
                plan.sampled_tok,
                plan.lrows,
                plan.batch,
            )
            if logits is None:
                logits = self.model.compute_logits(hidden[h2d(sampled_tok)])
            sampled, lp = sample(logits, sb, argmax)
            sampled = self.planner.broadcast_sampled(sampled)
            dslots = (
                inp.idx_mapping if len(rows) == len(inp.req_ids) else inp.idx_mapping[h2d(rows)]
            )
            accepted, last = None, sampled
            if nd.max() > 0:
                tokens, accepted = self.drafter.verify(
                    sampled, h2d(first), h2d(nd), st.draft_tokens[dslots], int(nd.max())
                )
                last = tokens.gather(1, accepted.unsqueeze(1)).squeeze(1)
                host["accepted"] = accepted
            if not (last is argmax and self.graphs.q == 1):  # else the graph wrote them
                st.last_sampled[dslots] = last
            if sb.penalties is not None:  # rows with penalties verify no drafts
                st.penalties.count_sampled(inp.idx_mapping[h2d(lrows)], sampled)
            host["sampled"] = sampled
            if lp is not None:
                host.update(lp_chosen=lp[0], lp_rank=lp[1], lp_ids=lp[2], lp_vals=lp[3])
        # queued before the sync: the device drafts while we wait
        if split is not None:
            self._draft_split(inp, plan, split, sampled, accepted)
        elif replayed is not None:
            self.graphs.draft(inp, replayed, sampled, accepted)
        elif target is not None:
            self.drafter.propose(
                DraftBatch(inp, rows, *target, hidden, sampled, sampled_tok, first, accepted)
            )
        self.hooks.after_step(inp, accepted)
        host.update(self.hooks.device_stats())
        plp_plan = self._prompt_logprob_plan(inp)
        if plp_plan:
            tok_rows = np.concatenate([r for _, r, _, _ in plp_plan])
            next_ids = np.concatenate([nx for _, _, nx, _ in plp_plan])
            n = max(k for _, _, _, k in plp_plan)
            logits = self.model.compute_logits(hidden[torch.from_numpy(tok_rows).to(self.device)])
            res = prompt_logprobs(logits, torch.from_numpy(next_ids).to(self.device), n)
            host.update(plp_chosen=res[0], plp_rank=res[1], plp_ids=res[2], plp_vals=res[3])
        stream = self.staging.stream()
        # the step's one device -> host copy, into its staging arena (read by finish())
        h, event = to_host_async(host, stream, self.staging.host_empty)
        arena = self.staging.step_done(stream, event)
        # per-slot bookkeeping now, while the slots are this step's: the next step's update may
        # free a slot and give it to a new request before this step's results are read
        slots = inp.idx_np[rows]
        if "accepted" not in host and len(rows):  # one token per sampling row
            st.num_generated[slots] += 1
            st.num_sampled[slots] += 1
        pending = PendingStep(
            step=step,
            # every row samples in a decode step: its request list as it is
            req_ids=inp.req_ids
            if len(rows) == len(inp.req_ids)
            else [inp.req_ids[b] for b in rows.tolist()],
            req_ids_all=inp.req_ids,
            slots=slots,
            first=first,
            host=h,
            event=event,
            arena=arena,
            plp_plan=plp_plan,
            bad_words=np.nonzero(st.logit_bias.bad_words_on[slots])[0]
            if st.logit_bias.num_on
            else _NO_ROWS,
            logprobs=st.logprobs[slots].copy(),
        )
        if hidden is None:
            pending.stats["cudagraph_steps"] = 1
        return pending

    def _prompt_logprob_plan(self, inp: StepInputs):
        """(batch row, hidden rows, next prompt ids, n) for requests wanting prompt logprobs."""
        st, plan = self.states, []
        if st.prompt_logprobs.max() < 0:  # no request wants them (the usual step)
            return plan
        for b in np.nonzero(st.prompt_logprobs[inp.idx_np] >= 0)[0]:
            s = inp.idx_np[b]
            lo, hi = int(inp.start[b]), min(int(inp.seq_lens[b]), int(st.num_prompt[s]) - 1)
            if hi <= lo:
                continue
            rows = inp.query_start_loc[b] + np.arange(hi - lo)
            plan.append((b, rows, st.token_ids[s][lo + 1 : hi + 1], int(st.prompt_logprobs[s])))
        return plan

    def _build_output(self, p: PendingStep) -> ModelRunnerOutput:
        st, h = self.states, p.host
        out = ModelRunnerOutput(step=p.step, stats=self.hooks.host_stats(h))
        if len(p.slots):
            # array ops over the rows; Python loops only over the rows that need one (B = 256
            # decode rows cost ~0.1 ms here instead of ~0.5 ms row by row)
            sampled = h["sampled"].tolist()
            out.req_ids = p.req_ids
            if "accepted" in h:  # never pipelined (can_pipeline): the slots are still this step's
                acc = h["accepted"].numpy().astype(np.int64)
                lo_hi = list(zip(p.first.tolist(), (p.first + acc + 1).tolist(), strict=True))
                out.sampled_token_ids = [sampled[lo:hi] for lo, hi in lo_hi]
                st.num_generated[p.slots] += acc + 1
                st.num_sampled[p.slots] += acc + 1
            else:  # one sample per row, rows in order (counted at launch)
                out.sampled_token_ids = [[t] for t in sampled]
                lo_hi = None
            for i in p.bad_words.tolist():  # never pipelined either
                for t in out.sampled_token_ids[i]:
                    st.logit_bias.record(int(p.slots[i]), t)
            for i in np.nonzero(p.logprobs >= 0)[0].tolist():
                k, (lo, hi) = int(p.logprobs[i]), lo_hi[i] if lo_hi else (i, i + 1)
                out.logprobs[out.req_ids[i]] = [
                    TokenLogprobs(
                        sampled[j],
                        float(h["lp_chosen"][j]),
                        int(h["lp_rank"][j]),
                        h["lp_ids"][j, :k].tolist(),
                        h["lp_vals"][j, :k].tolist(),
                    )
                    for j in range(lo, hi)
                ]
        off = 0
        for b, r, nx, k in p.plp_plan:
            m = len(r)
            out.prompt_logprobs[p.req_ids_all[b]] = [
                TokenLogprobs(
                    int(nx[j]),
                    float(h["plp_chosen"][off + j]),
                    int(h["plp_rank"][off + j]),
                    h["plp_ids"][off + j, :k].tolist(),
                    h["plp_vals"][off + j, :k].tolist(),
                )
                for j in range(m)
            ]
            off += m
        return out


@dataclass
class PendingStep:
    """A launched step: its device work queued, its results not yet read (``finish``). What the
    output needs from the step's slots is copied here at launch (the slots may be reused)."""

    step: int
    done: ModelRunnerOutput | None = None  # nothing to read (a step without tokens)
    req_ids: list[str] = field(default_factory=list)  # the sampling rows' requests
    req_ids_all: list[str] = field(default_factory=list)  # every batch row's request
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    first: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    host: dict[str, torch.Tensor] = field(default_factory=dict)  # valid once `event` is done
    event: torch.cuda.Event | None = None
    arena: int = 0  # the staging arena its inputs went through
    plp_plan: list = field(default_factory=list)
    bad_words: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    finished_req_ids: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    num_tokens: int = 0  # the step's scheduled tokens
    compiles: int = 0  # Triton compiles while the step was launched (stalls; set by the worker)


@dataclass
class SamplingPlan:
    """The step's sampled positions (rows verifying d drafts sample 1 + d each)."""

    rows: np.ndarray  # batch rows that sample
    num_drafts: np.ndarray  # [len(rows)]
    first: np.ndarray  # [len(rows)] each row's first sampled position
    sampled_tok: np.ndarray  # [N] step token of each sampled position
    lrows: np.ndarray  # [N] batch row of each sampled position
    batch: SamplingBatch


def _decode_samples(plan, n_dec: int) -> int:
    """Sampled positions of the first n_dec rows (decode rows, which all sample: 1 + d each)."""
    return int(plan.first[n_dec]) if len(plan.rows) > n_dec else len(plan.sampled_tok)


def warm_up_lengths(cap: int) -> list[int]:
    """Prompt lengths of the start-up warm-up (:meth:`ModelRunner.warm_up`): 2^k and 2^k − 1 for
    every 2^k <= cap, and cap and cap − 1 themselves; with a one-token prompt (Triton turns an
    integer argument equal to 1 into a constant: a variant of its own, which a one-token chunk
    after a prefix-cache hit or an eager single-request decode step would compile)."""
    out: set[int] = set()
    p = 2
    while p <= cap:
        out.update((p, p - 1))
        p *= 2
    if cap >= 1:
        out.update((cap, cap - 1))
    return sorted(n for n in out if n >= 1)


def warm_up_chunks(cap: int, topk: int, limit: int) -> list[tuple[int, int]]:
    """(start, tokens) of the warm-up's chunked prompt: half of ``index_topk``, then up to it
    (a chunk with context on the dense path), then one past it (the sparse path), each at most
    ``cap`` tokens and ending by ``limit``; then, past ``index_topk``, a one-token chunk (its
    attention splits the top-k and merges the partials, a kernel of its own)."""
    out, pos = [], 0
    for target in (max(1, topk // 2), topk, topk + cap):
        end = min(target, limit, pos + cap)
        if end > pos:
            out.append((pos, end - pos))
            pos = end
    if pos > topk and pos < limit:  # one token past it (a prefix hit's last token): split-K merges
        out.append((pos, 1))
    return out


def to_host_async(
    tensors: dict[str, torch.Tensor], stream: torch.cuda.Stream | None = None, empty=None
) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
    """Queue copies of every tensor into pinned host memory (``empty(shape, dtype)``, by default
    newly allocated) on ``stream`` (the current one by default); the returned event completes
    when they have landed (None: CPU tensors, copied now)."""
    if not tensors:
        return {}, None
    first = next(iter(tensors.values()))
    if not first.is_cuda:
        return {k: v.cpu() for k, v in tensors.items()}, None
    out = {}
    for k, v in tensors.items():
        out[k] = (
            empty(v.shape, v.dtype)
            if empty is not None
            else torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
        )
        out[k].copy_(v, non_blocking=True)
    event = torch.cuda.Event()
    event.record(stream)
    return out, event


def activation_bytes(
    arch, dtype: torch.dtype, max_tokens: int, tp_size: int = 1, pcp_size: int = 1
) -> int:
    """Estimated peak bytes of one step's activations on a rank, for a chunk of ``max_tokens``:
    the per-token tensors live at once inside a layer (hidden states and fp32 accumulators,
    MLP/expert intermediates with every token on one expert, queries, attention output, top-k,
    indexer queries) times the tokens this rank computes, plus the pieces bounded independently
    of the chunk (sparse attention in PREFILL_ATTN_MAX_TOKENS pieces, indexer logits under
    PREFILL_LOGITS_MAX_BYTES). An estimate, not a profile: the worker keeps a fixed reserve on top
    of it (tests/worker/test_activation_estimate.py checks it against a measured peak on CUDA)."""
    from vllm.attention.layer import PREFILL_ATTN_MAX_TOKENS, PREFILL_LOGITS_MAX_BYTES

    a = arch
    el = dtype.itemsize
    tp = max(1, tp_size)
    heads = max(1, a.num_attention_heads // tp)
    inter = max(a.intermediate_size, a.moe_intermediate_size * max(1, a.n_shared_experts))
    per_tok = (
        a.hidden_size * (4 * el + 2 * 4 + el)  # residual/x/normed/out; fp32 expert sum and y
        + 4 * max(inter // tp, a.moe_intermediate_size) * el  # gate+up (one GEMM), act, product
        + heads * (2 * a.qk_head_dim + a.v_head_dim) * el  # q, its split, attention output
        + 3 * a.index_topk * 4  # top-k and its selection temporaries
        + a.index_n_heads * a.index_head_dim * (el + 1 + 4)  # indexer q, FP8 q, fp32 copy
    )
    local = -(-max_tokens // max(1, pcp_size))
    piece = (
        min(local, PREFILL_ATTN_MAX_TOKENS)
        * heads
        * (a.kv_lora_rank + a.qk_rope_head_dim + a.kv_lora_rank + a.v_head_dim)
        * 4
    )
    return local * per_tok + piece + 2 * PREFILL_LOGITS_MAX_BYTES
