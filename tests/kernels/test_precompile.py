"""Kernel variants compiled at start-up: Triton's specialisation key as we compute it, and the
top-k's compile plan covering every launch a server makes.

A Triton kernel compiles at its first launch for each specialisation (constexprs, options, and
the class of every integer and pointer argument it specialises on); inside a server that is a
stall of a whole step. The top-k's constexprs follow the context, so a worker compiles its plan
(``topk_compile_plan``) at start-up. The CPU tests check the key against Triton's own binder and
the plan against the launches the launcher builds for every (rows, columns) a server sees; the
GPU tests check that no compile happens after the plan, through Triton's own compile hook.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vllm.kernels.indexer import topk_ref

triton = pytest.importorskip("triton")


def _topk_mod():
    from vllm.kernels.triton import topk

    return topk


def _key(launch):
    from vllm.kernels.triton.precompile import jit_key

    return jit_key(*launch)


def _binder_spec(kernel, args, kwargs):
    """Triton's own specialisation of a launch (its binder, built as JITFunction builds it)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, MockTensor, create_function_from_signature

    dns = getattr(kernel, "do_not_specialize", None) or kernel.kwargs.get("do_not_specialize")
    jf = JITFunction(kernel.fn, do_not_specialize=dns)
    binder = create_function_from_signature(jf.signature, jf.params, BaseBackend)
    _, spec, options = binder(*map(MockTensor.wrap_dtype, args), **kwargs)
    return tuple(tuple(x) for x in spec), options


@pytest.mark.parametrize("t,s", [(1, 1), (1, 16), (17, 40), (16, 4096), (3, 5000), (64, 70001)])
def test_jit_key_is_tritons_specialisation(t, s):
    """Our key's per-argument entries equal Triton's binder's, on real tensors (aligned and not)
    and on dtype placeholders, for ints of every class (1, multiples of 16, others) whether
    specialised or not."""
    topk = _topk_mod()
    cfg = topk.topk_launch_config(t, s, 64)
    buf = torch.empty(t * 16 + 8, dtype=torch.int32)
    odd = buf[1 : t + 1]  # a 4-byte offset: not 16-byte aligned
    tensors = (torch.empty(t, s), torch.empty(t, dtype=torch.int64), torch.empty(t, 64, dtype=torch.int32),
               odd, torch.empty(t, cfg["num_chunks"], dtype=torch.int32), odd,
               torch.empty(t, cfg["cap"], dtype=torch.int64))  # fmt: skip
    dtypes = tuple(x.dtype for x in tensors)
    for stride in (s, 16 * math.ceil(s / 16)):
        for bufs in (tensors, dtypes):
            for kernel, args, kw in topk._launches(cfg, t, s, stride, *bufs).values():
                name, spec, options = _key((kernel, args, kw))
                ref, ref_options = _binder_spec(kernel, args, kw)
                assert name == kernel.fn.__name__
                assert spec == ref, (name, spec, ref)
                assert dict(options) == {k: v for k, v in ref_options.items() if k in dict(options)}
    # the sizes named in NOT_SPECIALIZED carry no class; the stride does
    kernel, args, kw = topk._launches(cfg, t, s, 32, *dtypes)["collect"]
    spec = dict(zip(kernel.arg_names, _key((kernel, args, kw))[1], strict=True))
    assert spec["num_rows"][1] is None and spec["num_cols"][1] is None
    assert spec["stride_lt"] == ("i32", "D")


def _serving_launches(t, s, k):
    """The launches indexer_topk makes for T rows of S columns of the indexer's logits (rows
    strided by a multiple of 16, fresh buffers), as dtype placeholders."""
    topk = _topk_mod()
    cfg = topk.topk_launch_config(t, s, k)
    i32, i64, f32 = torch.int32, torch.int64, torch.float32
    stages = topk._launches(cfg, t, s, 16 * math.ceil(s / 16), f32, i64, i32, i32, i32, i32, i64)
    return [v for st, v in stages.items() if s > k or st == "pivot"]


@pytest.mark.parametrize("max_rows,max_cols", [(2048, 2240), (2048, 100_000), (8192, 1 << 20)])
def test_topk_plan_covers_every_launch(max_rows, max_cols):
    """Every launch for T <= max_rows rows of S <= max_cols columns is a variant of the plan:
    S at every power of two and either side of it, and at random; T from 1 to max_rows with the
    row counts where rows-per-program changes."""
    topk = _topk_mod()
    k = 2048
    plan = topk.topk_compile_plan(max_rows, max_cols, k)
    keys = {_key(x) for x in plan}
    assert len(keys) == len(plan)  # one entry per variant
    rng = np.random.default_rng(0)
    cols = {1, 2, max_cols, max_cols - 1}
    b = 2
    while b <= 2 * max_cols:
        cols.update(x for x in (b - 1, b, b + 1) if 1 <= x <= max_cols)
        b *= 2
    cols.update(int(x) for x in rng.integers(1, max_cols + 1, 40))
    rows = {1, 2, 3, max_rows, max_rows - 1}
    rows.update(int(x) for x in rng.integers(1, max_rows + 1, 12))
    seen = set()
    for s in sorted(cols):
        nc = topk.topk_launch_config(1, s, k)["num_chunks"]
        # the row counts where T·chunks // 1024 crosses a power of two
        near = {max(1, min(max_rows, (1024 << j) // nc + d)) for j in range(7) for d in (-1, 0, 1)}
        for t in sorted(rows | near):
            for launch in _serving_launches(t, s, k):
                key = _key(launch)
                assert key in keys, (t, s, launch[0].fn.__name__, launch[2])
                seen.add(key)
    # the plan holds little beyond what the sweep launched (the rows-per-program bounds)
    assert len(seen) >= 0.8 * len(keys)


def test_topk_plan_is_small():
    """A few dozen variants for a million-token context (the collect's rows per program are
    powers of two; columns <= k need the pivot pass only)."""
    topk = _topk_mod()
    plan = topk.topk_compile_plan(8192, 1 << 20, 2048)
    names = [k.fn.__name__ for k, _, _ in plan]
    assert len(plan) <= 80, len(plan)
    assert names.count("_select_kernel") == 1
    small = topk.topk_compile_plan(4096, 2048, 2048)
    assert {k.fn.__name__ for k, _, _ in small} == {"_pivot_kernel"}
    assert topk.topk_compile_plan(0, 100, 8) == []


def test_rows_per_program_is_a_power_of_two():
    topk = _topk_mod()
    for t in (1, 5, 100, 1000, 3000, 9999):
        for s in (5000, 70_000, 300_000, 1 << 20):
            r = topk.topk_launch_config(t, s, 2048)["collect"]["ROWS"]
            assert r & (r - 1) == 0 and 1 <= r <= 32
    assert topk.topk_launch_config(100, 300_000, 2048, rows_per_program=3)["collect"]["ROWS"] == 3


def test_topk_launches_use_aligned_buffers(interp):
    """The launcher's own buffers start 16-byte aligned whatever T (an odd T once put the counts
    at a 4-byte offset: a pointer class, so a variant, that followed T), and a misaligned limit
    is copied: its launches specialise as the plan's placeholders do (the launch options differ
    on the CPU only, which drops the register cap)."""
    topk = interp("topk")
    for t in (1, 3, 5, 16):
        s = 3000
        logits = torch.empty(t, 16 * math.ceil(s / 16))[:, :s]
        lim = torch.empty(t + 1, dtype=torch.int64)[1:]
        _, cfg, launches, _ = topk.topk_launches(logits, lim, 64)
        got = [_key(v)[:2] for v in launches.values()]
        ref = [_key(v)[:2] for v in _serving_launches(t, s, 64)]
        assert got == ref


def test_topk_short_rows_run_the_pivot_only(interp):
    """S <= k: the pivot pass alone answers every row (the other three launches are skipped)."""
    mod = interp("topk")
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 40, generator=g)
    limit = torch.tensor([0, 1, 17, 40, 45])
    out, stages, _ = mod.topk_stages(logits, limit, 64)
    assert len(stages) == 1
    for launch in stages:
        launch()
    ref = topk_ref(logits, limit, 64)
    for r in range(5):
        assert set(out[r].tolist()) == set(ref[r].tolist())


# ---- GPU: no compile after the plan -----------------------------------------------------------
@pytest.mark.gpu
def test_no_topk_compile_after_plan():
    """Compile the plan for 512 rows × 70,000 columns, then run the top-k over a walk of shapes
    a server sees (prefill pieces, growing decode contexts, odd sizes): Triton compiles nothing
    (its own compile hook, through CompileWatch), and the results are the reference's."""
    from vllm.kernels.indexer import indexer_topk
    from vllm.kernels.triton.precompile import CompileWatch, precompile
    from vllm.kernels.triton.topk import topk_compile_plan

    k = 2048
    n, _ = precompile(topk_compile_plan(512, 70_000, k))
    assert n > 0
    g = torch.Generator(device="cuda").manual_seed(0)
    watch = CompileWatch().start()
    try:
        shapes = [(1, 1), (1, 2049), (7, 4097), (64, 8191), (64, 8192), (64, 8193), (512, 70_000),
                  (333, 65_537), (2, 30_000), (129, 16_385), (256, 2048)]  # fmt: skip
        for t, s in shapes:
            buf = torch.randn(t, 16 * math.ceil(s / 16), device="cuda", generator=g)
            logits = buf[:, :s]
            limit = torch.randint(0, s + 1, (t,), device="cuda", generator=g)
            out = indexer_topk(logits, limit, k)
            ref = topk_ref(logits, limit, k)
            a = torch.where(out < 0, 1 << 30, out).sort(dim=1).values
            b = torch.where(ref < 0, 1 << 30, ref).sort(dim=1).values
            assert torch.equal(a, b), (t, s)
        torch.cuda.synchronize()
    finally:
        watch.stop()
    assert watch.compiles == [], watch.compiles


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [True, False])
def test_indexer_logits_one_variant_per_dtype(fp8):
    """After one call, prefill and decode scoring at other sizes and contexts compile nothing
    (sizes not specialised, logits rows strided by a multiple of 16)."""
    from vllm.kernels.triton.indexer_logits import indexer_logits
    from vllm.kernels.triton.precompile import CompileWatch

    def run(t, s):
        q = torch.randn(t, 32, 128, device="cuda")
        k = torch.randn(s, 128, device="cuda")
        if fp8:
            q, k = q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn)
        out = indexer_logits(q, torch.ones(t, 32, device="cuda"), torch.randn(t, 32, device="cuda"),
                             k, torch.ones(s, device="cuda"))  # fmt: skip
        assert out.stride(0) % 16 == 0

    run(16, 256)
    watch = CompileWatch().start()
    try:
        for t, s in [(1, 1), (3, 17), (64, 8193), (17, 4096), (1, 65_537)]:
            run(t, s)
        torch.cuda.synchronize()
    finally:
        watch.stop()
    assert watch.compiles == [], watch.compiles


def test_compile_watch_records_and_chains():
    """CompileWatch through Triton's hook points (called as Triton calls them): a compile after
    start is recorded with its kernel and constexprs, a manual warm-up (precompile) is not, hooks
    already installed still run, and stop restores them."""
    from triton import knobs
    from triton.runtime.jit import JitFunctionInfo

    from vllm.kernels.triton.precompile import CompileWatch

    topk = _topk_mod()
    kernel = topk._collect_kernel
    seen = []
    rt = knobs.runtime
    saved = (rt.jit_cache_hook, rt.jit_post_compile_hook)
    rt.jit_cache_hook = lambda **kw: seen.append(("pre", kw["key"]))
    rt.jit_post_compile_hook = lambda **kw: seen.append(("post", kw["key"]))
    try:
        watch = CompileWatch().start()
        names = list(kernel.arg_names)
        info = JitFunctionInfo(kernel.fn.__module__, kernel.fn.__name__, kernel)

        def call(key, warmup):
            kw = dict(key=key, repr="", fn=info, is_manual_warmup=warmup, already_compiled=False,
                      compile={"constants": {(names.index("ROWS"),): 4}})  # fmt: skip
            assert rt.jit_cache_hook(**kw) is None  # never skips the compile
            rt.jit_post_compile_hook(**kw)

        call("k1", warmup=True)
        call("k2", warmup=False)
        assert [c[0] for c in watch.compiles] == ["_collect_kernel{'ROWS': 4}"]
        assert seen == [("pre", "k1"), ("post", "k1"), ("pre", "k2"), ("post", "k2")]
        watch.stop()
        assert rt.jit_cache_hook is not None and rt.jit_cache_hook.__name__ == "<lambda>"
        call("k3", warmup=False)
        assert len(watch.compiles) == 1
    finally:
        rt.jit_cache_hook, rt.jit_post_compile_hook = saved
