"""Expert parallelism (`vllm/distributed/ep.py`): both dispatch paths against one rank's experts.

One process: the fixed-capacity path's pack / unpack / combine, the capacity rule, and the whole
path simulated over several ranks (the collectives done by hand). Several processes (gloo): `ep_moe`
on DP2 (EP2), TP2 (EP over the TP group) and DP2×TP2 (EP4), both paths, a rank with no tokens, every pair
routed to one rank's experts (the capacity worst case), the bound agreed by `max_tokens_across_ep`.
Through the engine: greedy tokens and logprobs of EP layouts whose steps take both paths (prefill
chunks over the capacity, decode under it; an idle DP replica's dummy steps) against one rank.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import traceback

import pytest
import torch

from vllm.config import ParallelConfig
from vllm.config.arch import ModelArch
from vllm.distributed import ep as ep_mod
from vllm.distributed.ep import (
    combine_partials,
    fixed_capacity,
    pack_tokens,
    unpack_tokens,
)
from vllm.distributed.parallel_state import GroupCoordinator, ParallelContext, single_rank_group
from vllm.kernels.moe import experts_ref
from vllm.model_executor.models.glm_moe_dsa import Experts
from vllm.model_executor.tiny import TINY_CONFIG

ARCH = ModelArch.from_dict(TINY_CONFIG)  # 8 experts, top-2, hidden 64, expert width 32
E, K, H, INTER = ARCH.n_routed_experts, ARCH.num_experts_per_tok, ARCH.hidden_size, 32


def _weights(dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, INTER, generator=g) / INTER**0.5
    return w13.to(dtype), w2.to(dtype)


def _tokens(n: int, seed: int, dtype=torch.float32, only: tuple[int, int] | None = None):
    """x [n, H], weights [n, K] fp32, ids [n, K] distinct per row; ``only``: ids in that range."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = only or (0, E)
    ids = torch.rand(n, hi - lo, generator=g).argsort(dim=1)[:, :K] + lo  # [n, K]
    w = torch.rand(n, K, generator=g) + 0.1
    return torch.randn(n, H, generator=g).to(dtype), w, ids


def _experts(pc: ParallelContext, dtype=torch.float32) -> Experts:
    ex = Experts(ARCH, pc, dtype)
    w13, w2 = _weights(dtype)
    s, n = ex.expert_start, ex.num_local
    ex.w13_weight.data.copy_(w13[s : s + n])
    ex.w2_weight.data.copy_(w2[s : s + n])
    return ex


def _ref(x, w, ids):
    w13, w2 = _weights(x.dtype)
    return experts_ref(x, w13, w2, ids, w)


# ---- one process ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,cap", [(5, 8), (0, 3), (4, 4)])
def test_pack_unpack_round_trip(dtype, n, cap):
    x, w, ids = _tokens(n, 1, dtype)
    rows = pack_tokens(x, w, ids, cap)
    assert rows.dtype == torch.uint8 and rows.shape == (cap, H * dtype.itemsize + 8 * K)
    rx, rw, rids = unpack_tokens(rows, H, dtype, K)
    assert rx.dtype == dtype and rw.dtype == torch.float32 and rids.dtype == torch.int64
    assert torch.equal(rx[:n], x) and torch.equal(rw[:n], w) and torch.equal(rids[:n], ids)
    # padding rows: zero activations, expert −1 (nobody's), weight 0
    assert rx[n:].eq(0).all() and rids[n:].eq(-1).all() and rw[n:].eq(0).all()
    # rows of several ranks, concatenated as the all-gather does, unpack the same way
    both = unpack_tokens(torch.cat([rows, rows]), H, dtype, K)
    assert torch.equal(both[0][cap : cap + n], x) and torch.equal(both[2][cap:], rids)


def test_combine_partials_sums_ranks_in_fp32():
    back = torch.randn(3 * 4, H).to(torch.bfloat16)  # 3 ranks, capacity 4
    got = combine_partials(back, 3)
    assert got.dtype == torch.float32 and got.shape == (4, H)
    assert torch.equal(got, back.float().view(3, 4, H).sum(0))


def test_fixed_capacity_rule():
    cap = ep_mod.EP_FIXED_MAX_TOKENS
    assert fixed_capacity(0, 1) == 1  # empty steps still exchange one (padding) row
    assert fixed_capacity(cap, 1) == cap and fixed_capacity(cap + 1, 1) is None
    assert fixed_capacity(2 * cap, 2) == cap and fixed_capacity(2 * cap + 1, 2) is None
    assert fixed_capacity(5, 2) == 3  # the TP slice, rounded up


def _ep_pc(ep_size: int, rank: int) -> ParallelContext:
    g = single_rank_group
    ep = GroupCoordinator("ep", list(range(ep_size)), rank)  # no process group: never called
    return ParallelContext(tp=g("tp"), pcp=g("pcp"), dcp=g("dcp"), ep=ep)


def _simulate_fixed(per_rank, ep_size: int, cap: int, dtype) -> list[torch.Tensor]:
    """The fixed-capacity path on ``ep_size`` ranks in one process: the all-gather is a concat,
    the all-to-all a transpose of blocks."""
    experts = [_experts(_ep_pc(ep_size, r), dtype) for r in range(ep_size)]
    gathered = torch.cat([pack_tokens(x, w, ids, cap) for x, w, ids in per_rank])
    ys = [ex.run_local(*unpack_tokens(gathered, H, dtype, K)) for ex in experts]  # [EP·C, H]
    outs = []
    for s, (x, _, _) in enumerate(per_rank):
        back = torch.cat([y[s * cap : (s + 1) * cap] for y in ys])  # block r from rank r
        outs.append(combine_partials(back, ep_size)[: x.shape[0]].to(dtype))
    return outs


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("route", ["random", "one_rank"])
def test_fixed_path_simulated_matches_one_rank(dtype, tol, route):
    """fp32: the single rank's sum in another order. bf16: each rank's partial sum is rounded to
    bf16 before the fp32 combine (the single rank rounds once): a few bf16 ulps."""
    ep_size, counts = 4, [5, 0, 7, 1]  # rank 1 has no tokens
    only = (6, 8) if route == "one_rank" else None  # rank 3's experts: its capacity worst case
    per_rank = [_tokens(n, 10 + r, dtype, only) for r, n in enumerate(counts)]
    outs = _simulate_fixed(per_rank, ep_size, max(counts), dtype)
    for (x, w, ids), out in zip(per_rank, outs, strict=True):
        ref = _ref(x, w, ids)
        assert out.shape == ref.shape
        assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol)


# ---- several processes (gloo) ---------------------------------------------------------------------
_TIMEOUT = datetime.timedelta(seconds=120)  # a rank stuck in a collective fails the test
# name: (ParallelConfig kwargs, tokens per DP replica)
LAYOUTS = {
    "dp2-ep2": (dict(data_parallel_size=2), [6, 0]),  # replica 1 has no tokens
    "tp2-ep": (dict(tensor_parallel_size=2), [1]),  # TP rank 1's slice is empty
    "dp2-tp2-ep4": (dict(data_parallel_size=2, tensor_parallel_size=2), [9, 3]),  # C 5: 3 + 0
}


def _worker(rank, world, init, layout, queue):
    try:
        torch.set_num_threads(1)
        torch.distributed.init_process_group(
            "gloo", init_method=init, world_size=world, rank=rank, timeout=_TIMEOUT
        )
        from vllm.distributed.groups import build_groups

        kw, counts = LAYOUTS[layout]
        par = ParallelConfig(enable_expert_parallel=True, **kw)
        pc = build_groups(par, rank, torch.device("cpu"))
        queue.put((rank, _worker_checks(pc, counts)))
    except Exception:
        queue.put((rank, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _worker_checks(pc: ParallelContext, counts: list[int]) -> str | None:
    """Run every case on this rank; None if all match the one-rank reference, else what failed."""
    taken: list[str] = []
    fixed, counted = ep_mod.ep_moe_fixed, ep_mod.ep_moe_counts
    ep_mod.ep_moe_fixed = lambda *a: taken.append("fixed") or fixed(*a)
    ep_mod.ep_moe_counts = lambda *a: taken.append("counts") or counted(*a)
    ex = _experts(pc)
    hints: list[bool] = []  # run_local's all_local: the counts path's rows are all this rank's
    run = ex.run_local
    ex.run_local = lambda *a, all_local=False: (
        hints.append(all_local) or run(*a, all_local=all_local)
    )
    dp = pc.dp.rank_in_group
    n = counts[dp]
    errors = []
    last = (ex.num_local * (pc.ep.world_size - 1), E)  # the last EP rank's experts
    for route, only in (("random", None), ("one_rank", last)):
        x, w, ids = _tokens(n, 100 + dp, only=only)  # a replica's TP ranks hold the same tokens
        ref = _ref(x, w, ids)
        bound = ep_mod.max_tokens_across_ep(pc, n)
        ep_mod.EP_FIXED_MAX_TOKENS = 256
        cap = fixed_capacity(bound, pc.tp.world_size)
        for path, limit, bound_ in (
            ("fixed", cap, bound),
            ("counts", cap, None),  # no bound (a model run outside the runner)
            ("counts", cap - 1, bound),  # a bound over the fixed path's limit
        ):
            ep_mod.EP_FIXED_MAX_TOKENS = limit
            taken.clear()
            hints.clear()
            with ep_mod.ep_forward(bound_):
                out = ep_mod.ep_moe(pc, x, w, ids, ex)
            if taken != [path]:
                errors.append(f"{route}: took {taken}, expected {path} (bound {bound_})")
            if hints != [path == "counts"]:
                errors.append(f"{route}/{path}: run_local's all_local {hints}")
            if out.shape != ref.shape or not torch.allclose(out, ref, atol=1e-5, rtol=1e-5):
                err = (out - ref).abs().max().item() if out.shape == ref.shape else out.shape
                errors.append(f"{route}/{path} (limit {limit}): off by {err}")
    if bound != max(counts):
        errors.append(f"agreed bound {bound}, expected {max(counts)}")
    return "; ".join(errors) or None


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ep_moe_matches_one_rank(layout, tmp_path):
    kw, _ = LAYOUTS[layout]
    world = ParallelConfig(enable_expert_parallel=True, **kw).world_size_across_dp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        ctx.Process(target=_worker, args=(r, world, init, layout, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=240) for _ in range(world))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert results == dict.fromkeys(range(world)), results


# ---- through the engine -------------------------------------------------------------------------
PROMPTS = [list(range(10, 610)), list(range(20, 57)), [5, 6, 7]]
ENGINE = dict(max_num_batched_tokens=1024, max_num_seqs=8)
ENGINE_TOKENS = 12


def _generate(ckpt, prompts, **kw):
    from vllm import LLM, SamplingParams

    llm = LLM(ckpt, **ENGINE, **kw)
    try:
        sp = SamplingParams(
            temperature=0, max_tokens=ENGINE_TOKENS, ignore_eos=True, logprobs=0, prompt_logprobs=0
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    finally:
        llm.shutdown()
    return (
        [o.outputs[0].token_ids for o in outs],
        [
            [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]
            + [
                d[t].logprob
                for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True)
            ]
            for o in outs
        ],
    )


# name: (engine kwargs, prompts). The 600-token prefill step is over the capacity (counts path,
# also at TP 2: 300 tokens per rank); decode steps are under it (fixed path).
EP_DP2 = dict(data_parallel_size=2, enable_expert_parallel=True)
ENGINE_CONFIGS = {
    # one request: the other replica runs dummy steps (one padding token) beside it
    "dp2-ep-one-request": (EP_DP2, PROMPTS[:1]),
    "dp2-ep": (EP_DP2, PROMPTS),
    # one-token decode steps leave TP rank 1's slice empty
    "tp2-ep-one-request": (dict(tensor_parallel_size=2, enable_expert_parallel=True), PROMPTS[:1]),
}


@pytest.fixture(scope="module")
def one_rank_runs(tiny_ckpt):
    """The single-rank run of each prompt set, computed once."""
    runs: dict[int, tuple] = {}

    def get(n_prompts: int):
        if n_prompts not in runs:
            runs[n_prompts] = _generate(tiny_ckpt, PROMPTS[:n_prompts])
        return runs[n_prompts]

    return get


@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(ENGINE_CONFIGS))
def test_engine_matches_one_rank(tiny_ckpt, one_rank_runs, name):
    kw, prompts = ENGINE_CONFIGS[name]
    ref_tokens, ref_lp = one_rank_runs(len(prompts))
    tokens, lp = _generate(tiny_ckpt, prompts, **kw)
    assert tokens == ref_tokens
    for a, b in zip(lp, ref_lp, strict=True):  # fp32 rounding: expert sums in another order
        assert max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0) < 1e-4
