"""The CUDA C++ FP8 sparse-MLA decode kernel (``vllm/kernels/cuda/sparse_mla_fp8_sm90.cu``).

CPU: the kernel builds for sm_90a with nvcc (CI's machine has nvcc 13.0), within its register
budget, with no wgmma serialisation and (almost) no spills, and its shared-memory size matches the
Python launcher's. GPU (H200): parity with the fp32 reference on fresh random caches, corner cases
(all −1 tokens, top-k past the context, ragged top-k lengths, tokens cut between the
CTAs and merged in the kernel, fewer heads), exact dequantisation
of every e4m3 code through PV, and queries / tile scales over a wide range of magnitudes.

Tolerances: PV uses bf16 operands (values rounded exactly like the reference, P in bf16) and QK
f16 ones, with fp32 accumulation: ‖out − ref‖/‖ref‖ < 1e-2, |lse − ref| < 2e-2, as for the
Triton/Gluon kernels (tests/kernels/test_sparse_mla.py).
"""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch

from vllm.attention.kv_cache import KVCacheLayout, read_mla_cache_ref
from vllm.attention.ops.sparse_mla import sparse_mla_attend_ref, sparse_mla_ref
from vllm.kernels import sparse_mla_cuda

from .test_sparse_mla import _cache, _check_decode, _rel, _slots, exact_dequant_inputs


def _need_nvcc():
    if sparse_mla_cuda.nvcc_path() is None:
        pytest.skip("no nvcc on this machine")


@pytest.mark.parametrize(
    "defines,max_spill",
    [
        # every build keeps a few of its 16 row sums and scalars in (L1-cached) local memory
        ((), 48),
        (("-DPRODUCER_CPASYNC=0",), 48),
        (("-DPV_F16=0",), 48),
        (("-DSEESAW_ORDER=0",), 112),
        (("-DSEESAW_ORDER=2",), 48),
        (("-DQK_FP8=1",), 48),
        (("-DNEXT_PREFETCH=0",), 48),
        (("-DQSTAGED=0",), 64),
        (("-DQK_GROUP=2",), 48),
        (("-DQAMAX_INT=0",), 48),
        (("-DQSKEW=0",), 48),
        (("-DPARTIAL_BF16=0",), 48),
        (("-DPARTIAL_EARLY=0",), 48),
        (("-DPROD_REGS=40", "-DCONS_REGS=232", "-DQK_GROUP=2"), 160),  # the earlier budget
    ],
)
def test_cuda_kernel_builds_for_sm90a(defines, max_spill):
    """ptxas's report for the default build and its variants: the consumer warpgroups' 240-register
    budget holds (a few loop-invariant scalars go to the stack, within the stated budget), and the
    wgmmas are pipelined, not serialised (C7512 / C7514)."""
    _need_nvcc()
    _, log = sparse_mla_cuda.compile_cubin(defines)
    res = sparse_mla_cuda.ptxas_resources(log)
    assert res["registers"] == 168, log  # 65536 / 384 threads at launch; setmaxnreg moves them
    assert res["wgmma_serialized"] == 0, log
    assert 0 <= res["spill_stores"] <= max_spill and 0 <= res["spill_loads"] <= max_spill, log


def test_cuda_kernel_smem_layout_matches_launcher():
    src = sparse_mla_cuda.SRC.read_text()
    consts = {}
    for name, expr in re.findall(r"constexpr int (\w+) = ([^;]+);", src):
        consts[name] = eval(expr, {}, dict(consts))  # the .cu's own arithmetic, in order
    assert consts["SMEM_ALLOC"] == sparse_mla_cuda.SMEM_ALLOC
    assert consts["SMEM_ALLOC"] <= 227 * 1024  # one CTA per SM on an H200
    assert consts["OFF_QT"] % 1024 == 0 and consts["OFF_PT"] % 1024 == 0  # 128-B swizzle atoms
    assert consts["MAX_PIECES"] == sparse_mla_cuda.MAX_PIECES  # the launcher's grid bound


def test_cuda_kernel_errors_name_the_problem():
    q = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    rows = torch.zeros(10, 656, dtype=torch.uint8)
    idx = torch.zeros(2, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="<=64"):
        sparse_mla_cuda.sparse_mla_fp8_cuda(q.repeat(1, 2, 1), rows, idx, 0.1, torch.bfloat16)
    with pytest.raises(ValueError, match="656"):
        sparse_mla_cuda.sparse_mla_fp8_cuda(q, rows[:, :600], idx, 0.1, torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 or fp32"):
        sparse_mla_cuda.sparse_mla_fp8_cuda(q, rows, idx, 0.1, torch.float16)
    from vllm.kernels.sparse_mla_decode import sparse_mla_decode

    layout = KVCacheLayout("auto", torch.bfloat16, 512, 64, 64)
    cache = layout.allocate_mla(1, "cpu")
    with pytest.raises(ValueError, match="CUDA (sparse-MLA kernel|tensors)"):
        sparse_mla_decode(q, cache, idx, layout, 0.1, kernel="cuda")


def test_cuda_kernel_env_choice_falls_back(monkeypatch):
    """VLLM_SPARSE_MLA_KERNEL=cuda takes the calls the CUDA kernel serves (FP8 decode on sm_90)
    and leaves the rest (here: CPU tensors, bf16 rows) to the default kernels; only an explicit
    kernel="cuda" is an error where it cannot run."""
    from vllm.kernels.sparse_mla_fwd import RowFormat, _use_cuda, _use_ws

    q = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    fp8, bf16 = RowFormat(512, 64, True), RowFormat(512, 64, False)
    rows8 = torch.zeros(10, 656, dtype=torch.uint8)
    rows16 = torch.zeros(10, 576, dtype=torch.bfloat16)
    monkeypatch.setenv("VLLM_SPARSE_MLA_KERNEL", "cuda")
    assert _use_cuda(None, q, rows8, fp8, False) is False
    assert _use_cuda(None, q, rows16, bf16, False) is False
    assert _use_ws(None, q, rows16, bf16, False) is False  # CPU: the Triton kernel, no error
    with pytest.raises(ValueError, match="CUDA sparse-MLA kernel"):
        _use_cuda("cuda", q, rows8, fp8, False)
    monkeypatch.setenv("VLLM_SPARSE_MLA_KERNEL", "cudnn")
    with pytest.raises(ValueError, match="kernel must be"):
        _use_cuda(None, q, rows8, fp8, False)


def test_cuda_launch_defines_per_grid(monkeypatch):
    """The launcher's build: the source's default (PARTIAL_BF16 1) where tokens are cut between
    CTAs, PARTIAL_BF16 0 where none is, and what DEFINES sets, either way."""
    monkeypatch.setattr(sparse_mla_cuda, "DEFINES", {})
    assert sparse_mla_cuda.launch_defines(True) == ()
    assert sparse_mla_cuda.launch_defines(False) == (("PARTIAL_BF16", 0),)
    monkeypatch.setattr(sparse_mla_cuda, "DEFINES", {"QSKEW": 0, "PARTIAL_BF16": 1})
    assert sparse_mla_cuda.launch_defines(False) == (("PARTIAL_BF16", 1), ("QSKEW", 0))
    assert sparse_mla_cuda.launch_defines(True) == (("PARTIAL_BF16", 1), ("QSKEW", 0))
    # which grids split: the default grid at T=64 (two pieces a token) does, T >= #SMs / 2 not
    sms = 132
    assert sparse_mla_cuda.splits_tokens(64, sparse_mla_cuda.default_ctas(64, 32, sms))
    assert not sparse_mla_cuda.splits_tokens(128, sparse_mla_cuda.default_ctas(128, 32, sms))
    assert not sparse_mla_cuda.splits_tokens(1024, sparse_mla_cuda.default_ctas(1024, 32, sms))
    assert sparse_mla_cuda.splits_tokens(9, 4) and not sparse_mla_cuda.splits_tokens(8, 4)


def test_cuda_build_error_is_reported_once(monkeypatch, caplog):
    """A kernel that fails to build or load: build_error says why (the default dispatch then
    takes the Gluon kernel), logs it once, and keeps the answer for the process."""
    calls = []

    def broken(device_index, defines):
        calls.append(defines)
        raise RuntimeError("nvcc failed on sparse_mla_fp8_sm90.cu: boom")

    monkeypatch.setattr(sparse_mla_cuda, "_function", broken)
    monkeypatch.setattr(sparse_mla_cuda, "DEFINES", {"NEXT_PREFETCH": 0})
    sparse_mla_cuda._build_error.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="vllm"):
            why = sparse_mla_cuda.build_error(torch.device("cuda", 0))
            assert sparse_mla_cuda.build_error(torch.device("cuda", 0)) == why
        assert why.startswith("failed to build or load") and "boom" in why
        assert len(calls) == 1 and caplog.text.count("unavailable") == 1
    finally:
        sparse_mla_cuda._build_error.cache_clear()


# ---- GPU ---------------------------------------------------------------------------------------
def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    why = sparse_mla_cuda.is_available(torch.device("cuda"))
    if why:
        pytest.skip(why)


FP8 = dict(cache_dtype="fp8_ds_mla", q_dtype=torch.bfloat16, compute_dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("t,h", [(1, 64), (7, 64), (64, 64), (130, 64), (5, 16), (9, 8), (3, 4)])
def test_cuda_decode_gpu(t, h):
    from vllm.kernels import sparse_mla_decode as mod

    _gpu()
    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 128)
    _check_decode(mod, layout, t, h, 2048, 64, "cuda", torch.bfloat16, 1e-2, seed=t * h + 1,
                  kernel="cuda")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    "ctas,t,k", [(1, 9, 64), (2, 9, 2048), (3, 9, 2048), (5, 9, 700), (7, 2, 3000), (4, 9, 1),
                 (13, 5, 2048), (200, 3, 2048)],
)  # fmt: skip
def test_cuda_decode_gpu_ctas(ctas, t, k, monkeypatch):
    """The grid at other sizes: tokens cut between CTAs (up to 8 pieces of one token
    merged in the kernel), one CTA for all tokens, ragged top-k lengths (the last block partly
    past the list), a 3000-row list, one row, more CTAs asked for than there are blocks."""
    from vllm.kernels import sparse_mla_decode as mod

    _gpu()
    monkeypatch.setattr(sparse_mla_cuda, "NUM_CTAS", ctas)
    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 128)
    _check_decode(mod, layout, t, 64, k, 64, "cuda", torch.bfloat16, 1e-2, seed=ctas + k,
                  kernel="cuda")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("ctas", [None, 7])
def test_cuda_decode_gpu_fp32_out_merged(ctas, monkeypatch):
    """fp32 output, through the in-kernel merge of split tokens (7 CTAs) and without it, twice:
    the launch leaves the stream's token counters zero (a stale count would skip a merge)."""
    from vllm.kernels import sparse_mla_decode as mod

    _gpu()
    monkeypatch.setattr(sparse_mla_cuda, "NUM_CTAS", ctas)
    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 64)
    for seed in (3, 4):
        _check_decode(mod, layout, 5, 64, 2048, 64, "cuda", torch.float32, 1e-2, seed=seed,
                      kernel="cuda", out_dtype=torch.float32)  # fmt: skip
    torch.cuda.synchronize()
    assert sparse_mla_cuda._COUNTERS and all(
        int(c.abs().sum()) == 0 for c in sparse_mla_cuda._COUNTERS.values()
    )


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_cuda_decode_gpu_split_few_heads(out_dtype, monkeypatch):
    """Tokens of 16 heads cut between CTAs (3 or 4 pieces each): the merging piece combines
    the others' partials with its own, kept in registers, and stores only its heads."""
    from vllm.kernels import sparse_mla_decode as mod

    _gpu()
    monkeypatch.setattr(sparse_mla_cuda, "NUM_CTAS", 11)
    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 64)
    _check_decode(mod, layout, 3, 16, 2048, 64, "cuda", torch.bfloat16, 1e-2, seed=21,
                  kernel="cuda", out_dtype=out_dtype)  # fmt: skip


@pytest.mark.gpu
def test_cuda_decode_gpu_fp32_out_and_query():
    from vllm.kernels import sparse_mla_decode as mod

    _gpu()
    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 64)
    _check_decode(mod, layout, 6, 64, 300, 32, "cuda", torch.float32, 1e-2, seed=11,
                  kernel="cuda", out_dtype=torch.float32)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("pv_f16", [1, 0])
def test_cuda_decode_gpu_fp8_dequant_exact(pv_f16, monkeypatch):
    """One valid row per token, so P = 1 and the output is that row's dequantised values: every
    finite e4m3 code (subnormals and ±448 included) times tile scales from 2^-24 to 2^7.
    PV_F16=0: the fp32 product rounded to bf16, exactly (the PV operand is rounded like the
    reference). PV_F16=1 (default): rows whose tile scales lie within 2^11 of each other take the
    f16 PV, within 2^-10 of the exact product (the tile scale rounded to f16, then the product);
    the others (most rows here: their scales span up to 2^31) the exact bf16 PV. A second cache
    with each row's scales within 2^3 sends every row through the f16 PV."""
    from vllm.kernels import sparse_mla_decode as mod

    _gpu()
    monkeypatch.setattr(sparse_mla_cuda, "DEFINES", {"PV_F16": pv_f16})
    layout, cache, slots, q, n = exact_dequant_inputs()
    out, lse = mod.sparse_mla_decode(q, cache, slots, layout, 0.04, kernel="cuda")
    want = read_mla_cache_ref(cache, slots[:, 17], layout)[:, None, :512].expand(n, 64, 512)
    if not pv_f16:
        assert torch.equal(out.float(), want.to(torch.bfloat16).float())
    narrow = cache.clone().view(n, -1)
    g = torch.Generator().manual_seed(9)
    sc = torch.exp2(torch.randint(-12, 4, (n, 1), generator=g).float())
    sc = sc * (1 + 7 * torch.rand(n, 4, generator=g))
    narrow[:, 512:528] = sc.contiguous().view(torch.uint8).cuda()
    narrow = narrow.view_as(cache)
    for c in (cache, narrow):
        o32, _ = mod.sparse_mla_decode(q, c, slots, layout, 0.04, torch.float32, kernel="cuda")
        truth = read_mla_cache_ref(c, slots[:, 17], layout)[:, None, :512].expand(n, 64, 512)
        err = (o32 - truth).abs()
        exact = o32 == truth.to(torch.bfloat16).float()
        if pv_f16 and c is narrow:
            assert (err <= 2**-10 * truth.abs()).all(), err.max()
        elif pv_f16:  # each row either way
            assert ((err <= 2**-10 * truth.abs()) | exact).all(), err.max()
        else:
            assert torch.equal(o32, truth.to(torch.bfloat16).float())
    # With one row the lse is that row's logit, here up to ~1e4 (codes up to 448 times scales up
    # to 2^8), so its rounding error is large in absolute terms: the f16 QK operands (11-bit)
    # must do at least as well as bf16 operands (what the Triton and Gluon kernels use) would.
    _, ref_l = sparse_mla_ref(q.float(), cache, slots, layout, 0.04)
    k = read_mla_cache_ref(cache, slots[:, 17], layout)  # [n, 576] fp32
    bf16_l = 0.04 * torch.einsum("nhd,nd->nh", q.float(), k.to(torch.bfloat16).float())
    err, bf16_err = (lse - ref_l).abs(), (bf16_l - ref_l).abs()
    assert err.max().item() <= bf16_err.max().item() and err.mean() <= bf16_err.mean()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "defines",
    [
        {"PRODUCER_CPASYNC": 0},
        {"PV_F16": 0},
        {"SEESAW_ORDER": 0},
        {"SEESAW_ORDER": 2},
        {"QK_FP8": 1},
        {"QSTAGED": 0},
        {"QAMAX_INT": 0},
        {"QSKEW": 0},
        {"PARTIAL_BF16": 0},
    ],
)
def test_cuda_decode_gpu_build_variants(defines, monkeypatch):
    """The other builds (the bulk-copy producer, the exact PV, the other two orders of a
    warpgroup's work): GLM shapes, few heads, tokens cut between 4 CTAs."""
    from vllm.kernels import sparse_mla_decode as mod

    _gpu()
    monkeypatch.setattr(sparse_mla_cuda, "DEFINES", defines)
    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 128)
    _check_decode(mod, layout, 7, 64, 2048, 64, "cuda", torch.bfloat16, 1e-2, seed=3,
                  kernel="cuda")  # fmt: skip
    _check_decode(mod, layout, 5, 16, 700, 64, "cuda", torch.bfloat16, 1e-2, seed=4,
                  kernel="cuda")  # fmt: skip
    monkeypatch.setattr(sparse_mla_cuda, "NUM_CTAS", 4)
    _check_decode(mod, layout, 9, 64, 2048, 64, "cuda", torch.bfloat16, 1e-2, seed=5,
                  kernel="cuda")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("q_scale", [1e-6, 1e-2, 1e3, 3e4])
def test_cuda_decode_gpu_magnitudes(q_scale):
    """Queries from tiny to near bf16's f16-unsafe range, and rows whose four tile scales span
    2^-20..2^5: the f16 QK's per-query and per-row power-of-two normalisation keeps logits within
    the usual tolerance. The softmax temperature is scaled down with the query so the attention
    stays non-degenerate."""
    from vllm.kernels.sparse_mla_decode import sparse_mla_decode

    _gpu()
    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 64)
    g = torch.Generator().manual_seed(int(q_scale * 1e6) % 1000)
    nb = 16
    n = nb * 64
    kv_c = torch.randn(n, 512, generator=g)
    kv_c *= torch.exp2(torch.randint(-20, 6, (n, 4, 1), generator=g).float()).repeat(1, 1, 128).view(n, 512)  # fmt: skip
    k_pe = torch.randn(n, 64, generator=g)
    cache = layout.allocate_mla(nb, "cpu")
    from vllm.attention.kv_cache import write_mla_cache_ref

    write_mla_cache_ref(cache, kv_c, k_pe, torch.arange(n), layout)
    cache = cache.cuda()
    slots = _slots(5, 512, n, "cuda", g)
    q = (torch.randn(5, 64, 576, generator=g) * q_scale).to(torch.bfloat16).cuda()
    scale = 0.05 / q_scale
    out, lse = sparse_mla_decode(q, cache, slots, layout, scale, kernel="cuda")
    ref_o, ref_l = sparse_mla_ref(q.float(), cache, slots, layout, scale)
    assert not out.isnan().any()
    assert _rel(out, ref_o) < 1e-2
    fin = ref_l.isfinite()
    assert torch.equal(fin, lse.isfinite())
    # lse here is ~40 (wide tile scales): bound its error by what bf16 operands would give
    kv = read_mla_cache_ref(cache, slots, layout).to(torch.bfloat16).float()
    _, bf16_l = sparse_mla_attend_ref(q.float(), kv, slots >= 0, scale, 512)
    bound = max(2e-2, (bf16_l[fin] - ref_l[fin]).abs().max().item())
    assert (lse[fin] - ref_l[fin]).abs().max().item() <= bound


def _gpu_inputs(layout, num_blocks, t, k, seed):
    """A random cache of ``num_blocks`` blocks, ``t`` tokens' top-``k`` slots and 64-head bf16
    queries, on the GPU."""
    g = torch.Generator().manual_seed(seed)
    cache = _cache(layout, num_blocks, "cuda", g)
    slots = _slots(t, k, num_blocks * layout.block_size, "cuda", g)
    q = torch.randn(t, 64, 576, generator=g).to(torch.bfloat16).cuda()
    return cache, slots, q


@pytest.mark.gpu
def test_cuda_decode_gpu_query_amax_builds_agree(monkeypatch):
    """The query's largest |value| from its bf16 bit patterns (QAMAX_INT 1, the default) is the
    float pass's (QAMAX_INT 0) exactly, so both builds give the same bits (no token is cut
    between CTAs here: a cut token's bits depend on which piece merges)."""
    from vllm.kernels.sparse_mla_decode import sparse_mla_decode

    _gpu()
    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 128)
    cache, slots, q = _gpu_inputs(layout, 64, 133, 2048, seed=17)
    q[5] *= 1e4  # tokens whose power of two differs from the others'
    q[6] *= 1e-5
    q[7, :, :512] = 0  # no nope part: the amax is 0
    outs = []
    for v in (0, 1):
        monkeypatch.setattr(sparse_mla_cuda, "DEFINES", {"QAMAX_INT": v})
        outs.append(sparse_mla_decode(q, cache, slots, layout, 1 / math.sqrt(256), kernel="cuda"))
    (a, la), (b, lb) = outs
    assert a.isfinite().all() and torch.equal(a, b) and torch.equal(la, lb)


@pytest.mark.gpu
def test_cuda_decode_gpu_partial_bf16_error(monkeypatch):
    """Tokens cut into two pieces (the default grid does this to every token at T=64): with bf16
    output the storing piece's normalised partial goes through the workspace in bf16
    (PARTIAL_BF16 1, the default), one rounding more than in fp32 (PARTIAL_BF16 0). The LSEs are
    the same bits; the outputs differ, by at most 2^-7 of the largest value, and the error against
    the fp32 reference grows by at most half."""
    from vllm.kernels.sparse_mla_decode import sparse_mla_decode

    _gpu()
    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 128)
    cache, slots, q = _gpu_inputs(layout, 64, 9, 2048, seed=23)
    monkeypatch.setattr(sparse_mla_cuda, "NUM_CTAS", 18)
    outs = []
    for v in (0, 1):
        monkeypatch.setattr(sparse_mla_cuda, "DEFINES", {"PARTIAL_BF16": v})
        outs.append(sparse_mla_decode(q, cache, slots, layout, 1 / math.sqrt(256), kernel="cuda"))
    (a, la), (b, lb) = outs
    ref_o, _ = sparse_mla_ref(q.float(), cache, slots, layout, 1 / math.sqrt(256))
    a, b = a.float().reshape(ref_o.shape), b.float().reshape(ref_o.shape)
    assert torch.equal(la, lb)
    assert not torch.equal(a, b)  # the bf16 partials were taken
    assert (a - b).abs().max() <= 2**-7 * a.abs().amax()
    assert _rel(b, ref_o) <= 1.5 * _rel(a, ref_o) + 1e-4, (_rel(b, ref_o), _rel(a, ref_o))


@pytest.mark.gpu
def test_cuda_decode_gpu_matches_ws_kernel():
    """Same inputs through the CUDA and the Gluon kernels: both within bf16 rounding of each
    other (a second, independent fast path)."""
    from vllm.kernels.sparse_mla_decode import sparse_mla_decode

    _gpu()
    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 128)
    cache, slots, q = _gpu_inputs(layout, 64, 33, 2048, seed=7)
    a, la = sparse_mla_decode(q, cache, slots, layout, 1 / math.sqrt(256), kernel="cuda")
    b, lb = sparse_mla_decode(q, cache, slots, layout, 1 / math.sqrt(256), kernel="ws")
    _, ref_l = sparse_mla_ref(q.float(), cache, slots, layout, 1 / math.sqrt(256))
    assert _rel(a, b) < 1e-2
    fin = ref_l.isfinite()
    assert fin.any()
    assert torch.equal(la.isfinite(), fin), f"{la.isfinite().sum()} finite, want {fin.sum()}"
    assert torch.equal(lb.isfinite(), fin), f"ws: {lb.isfinite().sum()} finite, {lb.flatten()[:4]}"
    assert (la[fin] - lb[fin]).abs().max().item() < 2e-2


def test_cuda_kernel_default_grid():
    """One CTA per token from half the SM count up (the hardware runs them in waves); below,
    each token in equal pieces (at most MAX_PIECES, at least MIN_BLOCKS_PER_CTA blocks)."""
    grid = sparse_mla_cuda.default_ctas
    assert grid(1024, 32, 132) == 1024 and grid(128, 32, 132) == 128 and grid(67, 32, 132) == 67
    assert grid(64, 32, 132) == 128 and grid(44, 32, 132) == 132 and grid(16, 32, 132) == 128
    assert grid(1, 32, 132) == sparse_mla_cuda.MAX_PIECES
    assert grid(3, 1, 132) == 3 and grid(3, 8, 132) == 6  # short top-k lists: fewer pieces


@pytest.mark.gpu
def test_cuda_default_dispatch_and_build_failure(monkeypatch, tmp_path, caplog):
    """With no kernel chosen, FP8 decode at 64 heads takes the CUDA kernel and at 16 heads the
    Gluon one. With a failing nvcc the default falls back to the Gluon kernel (same output as
    kernel="ws", the error logged) while kernel="cuda" is an error that names it."""
    from vllm.kernels.sparse_mla_decode import sparse_mla_decode

    _gpu()
    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 64)
    cache, slots, q = _gpu_inputs(layout, 8, 3, 256, seed=5)
    heads = []
    real = sparse_mla_cuda.sparse_mla_fp8_cuda

    def counted(q, *args, **kwargs):
        heads.append(q.shape[1])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(sparse_mla_cuda, "sparse_mla_fp8_cuda", counted)
    monkeypatch.delenv("VLLM_SPARSE_MLA_KERNEL", raising=False)
    out, _ = sparse_mla_decode(q, cache, slots, layout, 0.1)
    ref_o, _ = sparse_mla_ref(q.float(), cache, slots, layout, 0.1)
    assert heads == [64] and _rel(out, ref_o) < 1e-2
    sparse_mla_decode(q[:, :16].contiguous(), cache, slots, layout, 0.1)
    assert heads == [64]

    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho 'nvcc: broken' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("VLLM_NVCC", str(fake))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))  # nothing built here yet
    sparse_mla_cuda._function.cache_clear()
    sparse_mla_cuda._build_error.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="vllm"):
            o, lse = sparse_mla_decode(q, cache, slots, layout, 0.1)
        assert heads == [64] and "unavailable" in caplog.text
        ws_o, ws_l = sparse_mla_decode(q, cache, slots, layout, 0.1, kernel="ws")
        assert torch.equal(o, ws_o) and torch.equal(lse, ws_l)
        with pytest.raises(ValueError, match="failed to build"):
            sparse_mla_decode(q, cache, slots, layout, 0.1, kernel="cuda")
    finally:
        sparse_mla_cuda._function.cache_clear()
        sparse_mla_cuda._build_error.cache_clear()
