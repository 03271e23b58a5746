"""A step's launch never synchronises the device (GPU): under --async-scheduling the worker
launches step N + 1 while step N runs, and any stream synchronisation inside the launch (a copy
from pageable memory, an .item(), a full staging arena) serialises the two steps again. Checked
with torch's sync debug mode raising on every synchronising call, over steps that add requests,
append blocks, mix a prompt chunk with decode rows and replay the decode and piecewise graphs,
each launched before the previous one is read, as the worker does. On CPU the same steps run
(the step sequence and its bookkeeping are checked; there is no stream to synchronise)."""

from __future__ import annotations

import pytest
import torch

from vllm.core.messages import (
    CachedRequestData,
    KVCachePlan,
    NewRequestData,
    SamplingOptions,
    SchedulerOutput,
)
from vllm.distributed.parallel_state import ParallelContext
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader import build_model
from vllm.worker.gpu.model_runner import ModelRunner


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_launch_never_synchronises(tiny_ckpt, device):
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    cfg = EngineArgs(
        model=tiny_ckpt,
        device=device,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        kv_cache_memory_bytes=1 << 30,
        async_scheduling=True,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
    ).create_engine_config()
    model = build_model(tiny_ckpt, dtype=cfg.model_config.dtype, device=dev)
    runner = ModelRunner(cfg, model, ParallelContext.single(), dev)
    runner.initialize_kv_cache(KVCachePlan(512))
    if cuda:
        runner.warm_up()  # compiles: not what is checked here
    bs = runner.scheduler_block_size
    greedy = SamplingOptions(temperature=0.0, max_tokens=10**6)
    lens = {"a": bs - 4, "b": 2 * bs + 2}  # "a" crosses a block boundary while decoding
    blocks = {"a": [0], "b": [1, 2, 3]}
    done = {"a": 0, "b": 0}
    nxt = 4
    pending = None
    for step in range(12):
        new, cached, sched = [], [], {}
        for r in list(lens):
            if done[r] == 0:  # its prompt, in one chunk
                toks = [(7 * i + ord(r)) % 500 + 3 for i in range(lens[r])]
                new.append(NewRequestData(r, toks, lens[r], list(blocks[r]), 0, greedy))
                sched[r] = lens[r]
            else:
                add = []
                if done[r] + 1 > len(blocks[r]) * bs:  # the next token starts a block
                    add = [nxt]
                    blocks[r].append(nxt)
                    nxt += 1
                cached.append(CachedRequestData(r, add, done[r]))
                sched[r] = 1
        if step == 4:  # a request joins while the others decode: a mixed step
            lens["c"], blocks["c"], done["c"] = 40, [nxt], 0
            nxt += 1
            toks = [(5 * i) % 500 + 3 for i in range(40)]
            new.append(NewRequestData("c", toks, 40, list(blocks["c"]), 0, greedy))
            sched["c"] = 40
        so = SchedulerOutput(
            step=step,
            new_reqs=new,
            cached_reqs=cached,
            num_scheduled_tokens=sched,
            total_num_scheduled_tokens=sum(sched.values()),
            pipelined=True,
        )
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        try:
            launched = runner.launch(so)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
        if pending is not None:
            out = runner.finish(pending)
            assert len(out.sampled_token_ids) == len(pending.req_ids)
        pending = launched
        for r, n in sched.items():
            done[r] += n
    runner.finish(pending)
    assert len(blocks["a"]) == 2  # "a" crossed into a second block while decoding
    assert runner.graphs is not None and runner.piecewise is not None


def _chunked_tokens(runner, lag: bool) -> list[int]:
    """One 200-token prompt in chunks of at most 64 (three steps that sample nothing, then one
    that samples), then 3 greedy decode steps; the sampled tokens. ``lag``: a long sleep kernel
    first, so the host runs every chunk's launch while the device is still behind."""
    bs = runner.scheduler_block_size
    greedy = SamplingOptions(temperature=0.0, max_tokens=10**6)
    toks = [(11 * i + 5) % 500 + 3 for i in range(200)]
    blocks = list(range(-(-204 // bs)))
    out, done = [], 0
    if lag:
        torch.cuda._sleep(1 << 30)  # ~0.5 s of device time
    for step in range(7):
        if done == 0:
            n, new, cached = 64, [NewRequestData("r", toks, 200, blocks, 0, greedy)], []
        else:
            n = min(64, 200 - done) if done < 200 else 1
            new, cached = [], [CachedRequestData("r", [], done)]
        so = SchedulerOutput(
            step=step,
            new_reqs=new,
            cached_reqs=cached,
            num_scheduled_tokens={"r": n},
            total_num_scheduled_tokens=n,
        )
        res = runner.execute(so)
        out += [t[0] for t in res.sampled_token_ids]
        done += n
    runner.execute(SchedulerOutput(step=7, finished_req_ids=["r"]))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_steps_without_results_keep_their_inputs(tiny_ckpt):
    """A prompt chunk that samples nothing has no results to read, so its finish does not wait:
    its staging arena must stay untouched until the device has run it, or the chunk after next
    overwrites the inputs it has not copied yet (with the device lagging, as behind long
    attention). Same tokens with the device lagging as with it idle."""
    dev = torch.device("cuda")
    cfg = EngineArgs(
        model=tiny_ckpt,
        device="cuda",
        max_num_seqs=4,
        max_num_batched_tokens=64,
        kv_cache_memory_bytes=1 << 30,
        enforce_eager=True,
    ).create_engine_config()
    model = build_model(tiny_ckpt, dtype=cfg.model_config.dtype, device=dev)
    runner = ModelRunner(cfg, model, ParallelContext.single(), dev)
    runner.initialize_kv_cache(KVCachePlan(64))
    runner.warm_up()
    want = _chunked_tokens(runner, lag=False)
    assert len(want) == 4  # the last chunk's token, then 3 decoded
    for _ in range(3):
        assert _chunked_tokens(runner, lag=True) == want
