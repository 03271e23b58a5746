"""The start-up warm-up (`ModelRunner.warm_up`): which prompt lengths it runs, that it leaves
no request state behind, and that a runner that warmed up answers exactly as one that did not."""

from __future__ import annotations

import torch

from vllm.core.messages import (
    CachedRequestData,
    KVCachePlan,
    KVPageUpdate,
    NewRequestData,
    SamplingOptions,
    SchedulerOutput,
)
from vllm.distributed.parallel_state import ParallelContext
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader import build_model
from vllm.worker.gpu.model_runner import ModelRunner, warm_up_chunks, warm_up_lengths


def test_lengths_cover_every_integer_class():
    """1 (a constant for Triton), multiples of 16 and others, in every power-of-two bucket."""
    assert warm_up_lengths(2048) == sorted(
        {1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 511, 512, 1023, 1024}
        | {2047, 2048}
    )
    got = warm_up_lengths(100)
    assert got[-2:] == [99, 100] and 64 in got and 63 in got and 128 not in got
    assert warm_up_lengths(0) == [] and warm_up_lengths(1) == [1] and warm_up_lengths(2) == [1, 2]


def test_chunks_reach_the_dense_tail_and_the_sparse_path():
    """Half of index_topk, up to it, then past it, each within the step budget and the room."""
    assert warm_up_chunks(2048, 2048, 2239) == [(0, 1024), (1024, 1024), (2048, 191)]
    # then one token past index_topk (split-K merges), where the model's length leaves room
    assert warm_up_chunks(8192, 2048, 1 << 20) == [
        (0, 1024),
        (1024, 1024),
        (2048, 8192),
        (10240, 1),
    ]
    assert warm_up_chunks(96, 32, 511) == [(0, 16), (16, 16), (32, 96), (128, 1)]
    # a small budget: the chunks advance by it and stop at the topk boundary first
    assert warm_up_chunks(300, 2048, 4000) == [(0, 300), (300, 300), (600, 300)]
    # a short model: no chunk past topk; too short for two chunks: one
    assert warm_up_chunks(2048, 2048, 1500) == [(0, 1024), (1024, 476)]
    assert warm_up_chunks(2048, 2048, 1) == [(0, 1)]


def _runner(path, blocks=40, budget=96, max_num_seqs=4):
    cfg = EngineArgs(
        model=path,
        max_num_seqs=max_num_seqs,
        max_model_len=512,
        max_num_batched_tokens=budget,
        num_gpu_blocks_override=blocks,
        kv_cache_memory_bytes=1,
    ).create_engine_config()
    model = build_model(path, dtype=cfg.model_config.dtype, device=torch.device("cpu"))
    runner = ModelRunner(cfg, model, ParallelContext.single(), torch.device("cpu"))
    runner.initialize_kv_cache(KVCachePlan(blocks))
    return runner


def _generate(runner, prompts, steps=4, hisparse=False):
    """Greedy tokens of each prompt (prefilled together, then decoded together). ``hisparse``:
    each request's pages resident with host and indexer pages of the same numbers (what
    HiSparse's manager gives a short request on a fresh engine)."""
    greedy = SamplingOptions(temperature=0.0, max_tokens=100)
    bs = runner.scheduler_block_size
    new, first = [], 0
    for i, p in enumerate(prompts):
        blocks = list(range(first, first + -(-(len(p) + steps + 1) // bs)))
        upd = KVPageUpdate(host=blocks, idx=list(blocks)) if hisparse else None
        new.append(NewRequestData(f"r{i}", p, len(p), blocks, 0, greedy, upd))
        first += len(blocks)
    ids = [r.req_id for r in new]
    out = runner.execute(
        SchedulerOutput(
            new_reqs=new,
            num_scheduled_tokens={r.req_id: len(r.token_ids) for r in new},
            total_num_scheduled_tokens=sum(len(p) for p in prompts),
        )
    )
    toks = {r: [t[0]] for r, t in zip(out.req_ids, out.sampled_token_ids, strict=True)}
    for s in range(1, steps):
        out = runner.execute(
            SchedulerOutput(
                step=s,
                cached_reqs=[
                    CachedRequestData(
                        r, [], len(p) + s - 1, KVPageUpdate(host=[], idx=[]) if hisparse else None
                    )
                    for r, p in zip(ids, prompts, strict=True)
                ],
                num_scheduled_tokens={r: 1 for r in ids},
                total_num_scheduled_tokens=len(ids),
            )
        )
        for r, t in zip(out.req_ids, out.sampled_token_ids, strict=True):
            toks[r].append(t[0])
    return [toks[r] for r in ids]


def test_warm_up_leaves_nothing_behind(tiny_ckpt):
    prompts = [[(11 * i + j) % 200 + 5 for i in range(n)] for j, n in enumerate((70, 9, 33))]
    cold = _generate(_runner(tiny_ckpt), prompts)
    warm = _runner(tiny_ckpt)
    steps = []
    execute = warm.execute
    warm.execute = lambda so: steps.append(so) or execute(so)
    lengths = warm.warm_up()
    assert lengths == warm_up_lengths(96)
    # the chunked prompt's later chunks run with their context in the cache, one past topk
    chunked = [
        (c.num_computed_tokens, so.num_scheduled_tokens[c.req_id])
        for so in steps
        for c in so.cached_reqs
        if c.req_id == "__warmup_chunked"
    ]
    assert chunked == warm_up_chunks(96, warm.arch.index_topk, 511)[1:]
    assert chunked[-1][0] + chunked[-1][1] > warm.arch.index_topk
    assert warm.states.slot_of == {}  # every warm-up request finished
    assert _generate(warm, prompts) == cold


def test_warm_up_fits_a_small_cache(tiny_ckpt):
    """Lengths are capped by what the cache holds; with no room for the mixed step it is left out."""
    runner = _runner(tiny_ckpt, blocks=2, budget=4096)
    bs = runner.scheduler_block_size
    lengths = runner.warm_up()
    assert lengths[-1] == 2 * bs - 1
    assert runner.states.slot_of == {}


def test_warm_up_with_one_sequence(tiny_ckpt):
    """--max-num-seqs 1: one request slot, so no mixed step (it needs two requests at once; it
    raised "no free request slot"); the rest runs, nothing is left behind, and the runner answers
    as a cold one."""
    prompt = [[(7 * i) % 200 + 5 for i in range(40)]]
    cold = _generate(_runner(tiny_ckpt, max_num_seqs=1), prompt)
    warm = _runner(tiny_ckpt, max_num_seqs=1)
    steps = []
    execute = warm.execute
    warm.execute = lambda so: steps.append(so) or execute(so)
    assert warm.warm_up() == warm_up_lengths(96)
    assert all(len(so.new_reqs) + len(so.cached_reqs) <= 1 for so in steps)
    assert not any(r.req_id == "__warmup_mixed" for so in steps for r in so.new_reqs)
    assert warm.states.slot_of == {}
    assert _generate(warm, prompt) == cold


def _hisparse_runner(path, blocks=14):
    cfg = EngineArgs(
        model=path,
        max_num_seqs=4,
        max_model_len=512,
        max_num_batched_tokens=96,
        attention_config={"hisparse_config": {"host_pool_gib": 0.05}},
        num_gpu_blocks_override=blocks,
    ).create_engine_config()
    model = build_model(path, dtype=cfg.model_config.dtype, device=torch.device("cpu"))
    runner = ModelRunner(cfg, model, ParallelContext.single(), torch.device("cpu"))
    runner.initialize_kv_cache(runner.plan_kv(1 << 30))
    return runner


def test_warm_up_under_hisparse(tiny_ckpt):
    """HiSparse's runner warms up too (its pages resident, with host and indexer pages), within
    its smallest pool, leaves nothing behind, and answers as a cold one."""
    prompts = [[(13 * i + j) % 200 + 5 for i in range(n)] for j, n in enumerate((70, 9, 33))]
    cold = _generate(_hisparse_runner(tiny_ckpt), prompts, hisparse=True)
    warm = _hisparse_runner(tiny_ckpt)
    plan = warm.kv_plan
    lengths = warm.warm_up()
    pages = min(plan.num_blocks, plan.num_host_blocks, plan.num_idx_blocks)
    assert lengths == warm_up_lengths(min(96, pages * warm.scheduler_block_size - 1))
    assert warm.states.slot_of == {}
    assert _generate(warm, prompts, hisparse=True) == cold
