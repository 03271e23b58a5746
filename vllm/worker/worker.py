"""A worker process: one rank. Loads its shard of the model, sizes and allocates its KV cache,
then runs whatever scheduler output the engine core sends, until told to stop. A heartbeat
thread stamps the `HeartbeatBoard` for the front end's watchdog, apart from the step."""

from __future__ import annotations

import os
import signal
import time
import traceback

import msgspec
import torch
import zmq

from vllm.config import VllmConfig
from vllm.core.messages import (
    KVCachePlan,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerMessage,
    decoder,
    encoder,
)
from vllm.kernels.triton.precompile import CompileWatch
from vllm.utils import HeartbeatBoard, die_with_parent, freeze_gc_heap, init_logging, logger

ACTIVATION_RESERVE_GIB = float(os.environ.get("VLLM_CUDA_ACTIVATION_RESERVE_GIB", "4"))


def _device(config: VllmConfig, local_rank: int) -> torch.device:
    if config.device_config.device == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def kv_budget_bytes(total: int, free: int, own: int, utilization: float, reserve: int) -> int:
    """KV cache bytes for one engine process on a GPU: its share (total ·
    --gpu-memory-utilization, as upstream) less what it already holds (``own``) and the
    ``reserve`` for activations and graphs, and never more than is free. Other processes on the
    GPU (a second engine sharing it, at its own fraction) only limit it through ``free``."""
    return int(min(total * utilization - own, free) - reserve)


def _kv_plan(config: VllmConfig, runner, device: torch.device) -> KVCachePlan:
    cc = config.cache_config
    if cc.kv_cache_memory_bytes is not None:
        budget = cc.kv_cache_memory_bytes
    else:
        free, total = torch.cuda.mem_get_info(device)
        # the activations of a max_num_batched_tokens chunk, estimated from the model's shapes,
        # plus a fixed reserve (CUDA context, allocator slack, sampler, collectives' buffers)
        reserve = (
            runner.activation_bytes() + runner.graph_pool_bytes() + ACTIVATION_RESERVE_GIB * 2**30
        )
        own = torch.cuda.memory_reserved(device)  # this process: weights, loading's leftovers
        budget = kv_budget_bytes(total, free, own, cc.gpu_memory_utilization, reserve)
    plan = runner.plan_kv(budget)
    if plan.num_blocks < 1:
        raise RuntimeError(
            f"no room for the KV cache: {budget} bytes available, one block needs {runner.kv_bytes_per_block()} "
            "(raise --gpu-memory-utilization or --kv-cache-memory-bytes, or lower "
            "--max-num-batched-tokens, which sets the activation memory kept aside)"
        )
    return plan


def _weights(config: VllmConfig, pc, device: torch.device):
    """This rank's weights by kind, from the shapes alone; on CUDA, checked against the GPU before
    anything is allocated (a ValueError naming the shortfall in GiB)."""
    from vllm.config.quantization import resolve_quantization
    from vllm.model_executor.weight_bytes import check_weights_fit, weight_bytes_per_rank

    mc = config.model_config
    weights = weight_bytes_per_rank(
        resolve_quantization(mc.arch, mc.quantization),
        mc.dtype,
        tp_size=pc.tp.world_size,
        tp_rank=pc.tp.rank_in_group,
        ep_size=pc.ep.world_size if pc.ep is not None else None,
        num_mtp=mc.arch.num_nextn_predict_layers if config.speculative_config is not None else 0,
    )
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        util = config.cache_config.gpu_memory_utilization
        check_weights_fit(weights, free, total, util, f"GPU {device.index} ({mc.model})")
    return weights


def worker_main(
    config: VllmConfig,
    global_rank: int,
    dp_rank: int,
    dist_init: str,
    in_addr: str,
    out_addr: str,
    heartbeats: HeartbeatBoard | None = None,
) -> None:
    die_with_parent()
    if heartbeats is not None:
        heartbeats.start(heartbeats.worker_slot(global_rank))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end coordinates shutdown
    init_logging()
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.connect(out_addr)
    enc = encoder()
    try:
        _run(config, global_rank, dp_rank, dist_init, in_addr, ctx, out, enc)
    except Exception as e:  # report, then die: the engine core fails every request with this
        logger.error("worker %d failed: %s", global_rank, traceback.format_exc())
        out.send(
            enc.encode(
                WorkerMessage(rank=global_rank, kind="error", error=f"{type(e).__name__}: {e}")
            )
        )
        out.close(linger=2000)
        os._exit(1)


def _run(config, global_rank, dp_rank, dist_init, in_addr, ctx, out, enc):
    from vllm.distributed.groups import init_distributed
    from vllm.distributed.kv_transfer import KVConnectorContext, KVConnectorRole
    from vllm.distributed.kv_transfer.factory import create_connector
    from vllm.model_executor.model_loader import build_model
    from vllm.worker.gpu.model_runner import ModelRunner

    pc_cfg = config.parallel_config
    world = pc_cfg.world_size_across_dp
    device = _device(config, global_rank)
    if config.device_config.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    pc = init_distributed(config, global_rank, dist_init, device)
    rank_in_replica = global_rank - dp_rank * pc_cfg.world_size
    mc = config.model_config
    weights = _weights(config, pc, device)
    model = build_model(
        mc.model,
        dtype=mc.dtype,
        device=device,
        pc=pc,
        force_mqa=config.attention_config.sparse_mla_force_mqa,
        load_mtp=config.speculative_config is not None,
        progress=rank_in_replica == 0 and os.environ.get("VLLM_NO_PROGRESS", "0") != "1",
        quantization=mc.quantization,
        load_format=mc.load_format,
        arch=mc.arch,
    )
    kv_ctx = KVConnectorContext.for_engine(config, rank_in_replica, dp_rank)
    connector = create_connector(kv_ctx, KVConnectorRole.WORKER)
    runner = ModelRunner(config, model, pc, device, connector=connector)
    plan = _kv_plan(config, runner, device)
    # every rank of the replica allocates the same number of blocks of each pool
    plan = KVCachePlan(*(pc.min_over_world(n) for n in msgspec.structs.astuple(plan)))
    if rank_in_replica == 0:
        allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        logger.info(
            "rank %d: weights per GPU %s%s; KV cache %.2f GiB (%d blocks)",
            global_rank,
            weights.describe(),
            f", {allocated / 2**30:.2f} GiB allocated after loading" if allocated else "",
            plan.num_blocks * runner.kv_bytes_per_block() / 2**30,
            plan.num_blocks,
        )
    runner.initialize_kv_cache(plan)
    if device.type == "cuda":  # CPU runs have no kernels to compile
        t0 = time.perf_counter()
        lengths = runner.warm_up()
        if rank_in_replica == 0 and not lengths:
            logger.info("warm-up skipped (no room in the KV cache): kernels compile at first use")
        if rank_in_replica == 0 and lengths:
            logger.info(
                "warm-up: %d prefill steps (prompts of %d-%d tokens), a mixed step and a chunked "
                "prompt in %.1f s",
                len(lengths),
                lengths[0],
                lengths[-1],
                time.perf_counter() - t0,
            )
    watch = None
    if device.type == "cuda":
        try:
            n, secs = runner.precompile()
            if rank_in_replica == 0 and n:
                logger.info("compiled %d context-dependent kernel variants in %.1f s", n, secs)
        except Exception:  # noqa: BLE001 - it touches no state: the kernels compile at first use
            logger.warning("start-up kernel compile failed; kernels compile at first use:\n%s",
                           traceback.format_exc())  # fmt: skip
        # from here every Triton compile is a stall inside a request: logged and counted
        watch = CompileWatch().start()
    # every attention layer's caches, MTP layers last (the order of model.attention_layers())
    connector.register_kv_caches(runner.kv_cache.transfer_caches())
    inp = ctx.socket(zmq.PULL)
    inp.connect(in_addr)
    freeze_gc_heap(f"worker {global_rank}")
    out.send(enc.encode(WorkerMessage(rank=global_rank, kind="ready", kv_plan=plan)))
    dec = decoder(SchedulerOutput)
    driver = rank_in_replica == 0
    prof = _StepProfiler(global_rank)
    pending = None  # a launched step whose results are held (--async-scheduling)

    def report(p) -> None:
        ro = runner.finish(p)
        prof.after(p.num_tokens)
        if p.compiles:
            ro.stats["jit_compiles"] = ro.stats.get("jit_compiles", 0) + p.compiles
        if driver:
            out.send(enc.encode(WorkerMessage(rank=global_rank, kind="output", output=ro)))
        elif kv_ctx is not None:  # the scheduler combines every rank's KV transfers
            kv = ModelRunnerOutput(step=ro.step, kv_connector_output=ro.kv_connector_output)
            out.send(enc.encode(WorkerMessage(rank=global_rank, kind="output", output=kv)))

    # the loop runs in inference mode (the runner's steps would enter it each time otherwise)
    with torch.inference_mode():
        while True:
            raw = inp.recv()
            if raw == b"SHUTDOWN":
                break
            if raw == b"FLUSH":  # nothing follows the held step: read it now
                if pending is not None:
                    report(pending)
                    pending = None
                continue
            so = dec.decode(raw)
            if pending is not None and not runner.can_pipeline(pending):
                report(pending)
                pending = None
            prof.before()
            seen = len(watch.compiles) if watch is not None else 0
            launched = runner.launch(so)  # kernels compile on the host, at their launch
            launched.compiles = len(watch.compiles) - seen if watch is not None else 0
            if pending is not None:  # step N + 1 is queued behind step N: now read step N
                launched.stats["pipelined_steps"] = 1
                report(pending)
            # the engine core sends the next step or FLUSH before it waits for this one's results
            pending = launched if so.pipelined else None
            if pending is None:
                report(launched)
    connector.shutdown()
    pc.destroy()


class _StepProfiler:
    """VLLM_PROFILE_DIR=dir (and optionally VLLM_PROFILE_STEPS=first:last, default 20:40 of the
    steps that run tokens): rank 0 records those steps with torch.profiler and writes dir/
    profile_rank0.txt, the ops by total device time and by host time, plus the steps' wall times.
    For finding where a step's time goes; off (no cost) without the variable."""

    def __init__(self, rank: int):
        self.dir = os.environ.get("VLLM_PROFILE_DIR") if rank == 0 else None
        a, _, b = os.environ.get("VLLM_PROFILE_STEPS", "20:40").partition(":")
        self.first, self.last = int(a), int(b)
        self.n, self.prof, self.walls, self.t0 = 0, None, [], 0.0

    def before(self) -> None:
        if self.dir is None:
            return
        import time

        if self.n == self.first and self.prof is None:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            )
            self.prof = profile(activities=acts)
            self.prof.__enter__()
        self.t0 = time.perf_counter()

    def after(self, num_tokens: int) -> None:
        if self.dir is None or num_tokens == 0:
            return
        import time

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if self.prof is not None:
            self.walls.append((time.perf_counter() - self.t0, num_tokens))
        self.n += 1
        if self.prof is not None and self.n > self.last:
            self.prof.__exit__(None, None, None)
            os.makedirs(self.dir, exist_ok=True)
            ka = self.prof.key_averages()
            with open(os.path.join(self.dir, "profile_rank0.txt"), "w") as f:
                f.write(f"steps {self.first}..{self.last}: wall s, tokens = {self.walls}\n\n")
                for key in ("cuda_time_total", "cpu_time_total", "self_cpu_time_total"):
                    try:
                        f.write(
                            ka.table(sort_by=key, row_limit=30, max_name_column_width=60) + "\n"
                        )
                    except Exception as e:  # noqa: BLE001  (no device column on CPU)
                        f.write(f"{key}: {e}\n")
            self.prof, self.dir = None, None
