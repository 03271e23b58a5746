"""Sparse MLA decode (paged fp8_ds_mla / bf16 cache) and MQA prefill against the fp32 references:
each implementation called directly (the Triton kernel, the Gluon kernel for bf16 rows on
Hopper), and the op as the engine calls it (``vllm.kernels.sparse_mla``, which picks one). The
CUDA C++ FP8 kernel has its own file (``test_sparse_mla_cuda.py``).

Tolerances: the kernels feed bf16 operands to tensor-core dots (q, dequantised rows, P) with fp32
accumulation, so outputs carry bf16 rounding: ‖out − ref‖/‖ref‖ < 1e-2 and |lse − ref| < 2e-2
(lse is a log of a sum of ~K terms, each with bf16-rounded logits). Under the interpreter
everything is fp32: 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm.kernels import sparse_mla as op
from vllm.kernels.kv_cache import write_mla_cache_ref
from vllm.kernels.merge_attn import merge_attn_states
from vllm.kernels.sparse_mla import RowFormat, sparse_mla_prefill_ref, sparse_mla_ref
from vllm.kv_cache_interface import KVCacheLayout


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _cache(layout, num_blocks, device, g):
    """A cache filled by the reference writer (every slot written), so reads are meaningful."""
    n = num_blocks * layout.block_size
    cache = layout.allocate_mla(num_blocks, "cpu")
    kv_c = torch.randn(n, layout.kv_lora_rank, generator=g)
    k_pe = torch.randn(n, layout.rope_dim, generator=g)
    write_mla_cache_ref(cache, kv_c, k_pe, torch.arange(n), layout)
    return cache.to(device)


def _slots(t, k, num_slots, device, g, frac_invalid=0.2, empty_rows=()):
    slots = torch.stack([torch.randperm(num_slots, generator=g)[:k] for _ in range(t)])
    slots[torch.rand(t, k, generator=g) < frac_invalid] = -1
    for r in empty_rows:
        slots[r] = -1
    return slots.to(torch.int32).to(device)


def _run_decode(impl, q, cache, slots, layout, scale, config=None):
    """One implementation on the paged cache's rows (``op``: the op's own choice)."""
    if impl == "op":
        return op.sparse_mla_decode(q, cache, slots, layout, scale)
    rows = cache.view(-1, cache.shape[-1])
    fmt = RowFormat(layout.kv_lora_rank, layout.rope_dim, layout.is_fp8)
    return _run_rows(impl, q, rows, fmt, slots, scale, config)


def _run_rows(impl, q, rows, fmt, idx, scale, config=None):
    if impl == "triton":
        from vllm.kernels.triton.sparse_mla_fwd import sparse_mla_fwd

        return sparse_mla_fwd(q, rows, fmt, idx, scale, torch.float32, config)
    assert impl == "ws", impl
    from vllm.kernels.sparse_mla_ws import sparse_mla_ws

    splits = config.num_splits if config is not None else 1
    part_o, part_l = sparse_mla_ws(q, rows, idx.to(torch.int32), scale, torch.float32, splits)
    return merge_attn_states(part_o, part_l)


def _check_decode(impl, layout, t, h, k, num_blocks, device, q_dtype, tol, seed, config=None):
    g = torch.Generator().manual_seed(seed)
    cache = _cache(layout, num_blocks, device, g)
    q = torch.randn(t, h, layout.mla_dim, generator=g).to(q_dtype).to(device)
    empty = (0,) if t > 1 else ()
    slots = _slots(t, k, num_blocks * layout.block_size, device, g, empty_rows=empty)
    scale = 1.0 / math.sqrt(256)
    out, lse = _run_decode(impl, q, cache, slots, layout, scale, config)
    ref_o, ref_l = sparse_mla_ref(q.float(), cache, slots, layout, scale)
    assert not out.isnan().any() and not lse.isnan().any()
    assert _rel(out, ref_o) < tol
    fin = ref_l.isfinite()
    assert torch.equal(fin, lse.isfinite())
    assert (lse[fin] - ref_l[fin]).abs().max().item() < 2 * tol
    if t > 1:  # the all −1 token: zeros and −inf
        assert out[0].abs().max().item() == 0.0 and (lse[0] == float("-inf")).all()


def _check_prefill(impl, t, h, s, k, d_v, rope, device, dtype, tol, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d_v + rope, generator=g).to(dtype).to(device)
    kv = torch.randn(s, d_v + rope, generator=g).to(dtype).to(device)
    # causal-style rows: query i may use rows < limit_i; topk longer than the context pads −1
    limit = torch.randint(0, s + 1, (t,), generator=g)
    idx = torch.full((t, k), -1, dtype=torch.int32)
    for i in range(t):
        n = min(k, int(limit[i]))
        idx[i, :n] = torch.randperm(int(limit[i]), generator=g)[:n].to(torch.int32)
    idx = idx.to(device)
    scale = (d_v + rope) ** -0.5
    if impl == "op":
        out, lse = op.sparse_mla_prefill(q, kv, idx, scale, d_v)
    else:  # on CUDA the op hands the kernels bf16 rows (fp32 would double their shared memory)
        rows = kv.to(torch.bfloat16) if kv.is_cuda else kv
        out, lse = _run_rows(impl, q, rows, RowFormat(d_v, rope, False), idx, scale)
    ref_o, ref_l = sparse_mla_prefill_ref(q.float(), kv.float(), idx, scale, d_v)
    assert not out.isnan().any()
    assert _rel(out, ref_o) < tol
    fin = ref_l.isfinite()
    assert torch.equal(fin, lse.isfinite())
    assert (lse[fin] - ref_l[fin]).abs().max().item() < 2 * tol


# ---- CPU ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
@pytest.mark.parametrize("splits", [1, 2])
def test_decode_interpreter(interp, cache_dtype, splits):
    fwd = interp("sparse_mla_fwd")
    layout = KVCacheLayout(cache_dtype, torch.float32, 128, 16, 32, block_size=16)
    cfg = fwd.SparseMLAConfig(16, 16, 4, 1, splits)
    _check_decode(
        "triton", layout, 3, 4, 40, 4, "cpu", torch.float32, 1e-5, seed=splits, config=cfg
    )


def test_prefill_interpreter(interp):
    interp("sparse_mla_fwd")
    _check_prefill("triton", 4, 3, 50, 24, 64, 16, "cpu", torch.float32, 1e-5, seed=3)


@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
def test_op_on_cpu_is_the_reference(cache_dtype):
    """CPU tensors: the op is its reference (fp32 out, the chunked prefill reference too)."""
    layout = KVCacheLayout(cache_dtype, torch.float32, 128, 16, 32, block_size=16)
    _check_decode("op", layout, 70, 4, 40, 4, "cpu", torch.float32, 1e-6, seed=1)
    _check_prefill("op", 70, 3, 50, 24, 64, 16, "cpu", torch.float32, 1e-6, seed=2)


# ---- GPU ---------------------------------------------------------------------------------------
GLM = dict(r=512, rope=64, h=64, topk=2048)
# "op": the op's own choice (fp8_ds_mla: the CUDA kernel on Hopper; bf16: the Gluon kernel);
# "ws": the Gluon kernel called directly (bf16 rows, Hopper); "triton": the portable kernel
IMPLS = ["triton", "ws", "op"]


def _need(impl, cache_dtype="auto"):
    if impl == "ws" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialised kernel is built for sm_90")
    if impl == "ws" and cache_dtype != "auto":
        pytest.skip("the Gluon kernel reads bf16 rows (fp8_ds_mla rows: the CUDA kernel)")
    return impl


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
@pytest.mark.parametrize("t,h", [(1, 64), (7, 64), (64, 64), (130, 64), (5, 16), (9, 8), (3, 4)])
def test_decode_gpu(cache_dtype, t, h, impl):
    impl = _need(impl, cache_dtype)
    layout = KVCacheLayout(cache_dtype, torch.bfloat16, GLM["r"], GLM["rope"], 128)
    _check_decode(impl, layout, t, h, GLM["topk"], 64, "cuda", torch.bfloat16, 1e-2, seed=t * h)


@pytest.mark.gpu
@pytest.mark.parametrize("splits,k", [(1, 64), (2, 2048), (3, 2048), (5, 700), (1, 3000)])
def test_decode_gpu_ws_splits(splits, k):
    """The Gluon kernel's split-K slices (merged like the Triton kernel's), ragged top-k; a
    3000-row slice is past the shared-memory id copy (IDX_CAP), so its ids come from global."""
    from vllm.kernels.triton.sparse_mla_fwd import SparseMLAConfig

    _need("ws")
    layout = KVCacheLayout("auto", torch.bfloat16, 512, 64, 128)
    cfg = SparseMLAConfig(64, 64, 8, 2, splits)
    _check_decode("ws", layout, 9, 64, k, 64, "cuda", torch.bfloat16, 1e-2, seed=splits, config=cfg)


def exact_dequant_inputs():
    """One valid row per token (slot column 17) of a 64-row fp8_ds_mla cache holding every
    finite e4m3 code (subnormals and ±448 included) in every row, tile scales 2^-24..2^7, bf16
    rope; random bf16 queries. Returns (layout, cache, slots, q, n) on the GPU."""
    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 64)
    g = torch.Generator().manual_seed(5)
    n = 64
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    cache = layout.allocate_mla(1, "cpu").view(n, -1)
    for r in range(n):
        cache[r, :512] = codes[torch.randint(0, len(codes), (512,), generator=g)]
        cache[r, :254] = codes[torch.randperm(len(codes), generator=g)]  # every code in every row
    exps = torch.randint(-24, 7, (n, 4), generator=g).float()
    scales = torch.exp2(exps) * (1 + torch.rand(n, 4, generator=g))
    cache[:, 512:528] = scales.contiguous().view(torch.uint8)
    cache[:, 528:] = torch.randn(n, 64, generator=g).to(torch.bfloat16).view(torch.uint8)
    cache = cache.view(layout.mla_cache_shape(1)).cuda()
    slots = torch.full((n, 64), -1, dtype=torch.int32)
    slots[:, 17] = torch.randperm(n, generator=g).to(torch.int32)
    slots = slots.cuda()
    q = torch.randn(n, 64, 576, generator=g).to(torch.bfloat16).cuda()
    return layout, cache, slots, q, n


@pytest.mark.gpu
def test_decode_gpu_fp8_dequant_exact():
    """One valid row per token, so P = 1 and the output is that row's dequantised values: every
    finite e4m3 code (subnormals and ±448 included) times tile scales from 2^-24 to 2^7 must come
    out of the Triton kernel as the fp32 product rounded to bf16, exactly (the CUDA kernel's own
    check is in test_sparse_mla_cuda.py)."""
    from vllm.kernels.kv_cache import read_mla_cache

    layout, cache, slots, q, n = exact_dequant_inputs()
    out, _ = _run_decode("triton", q, cache, slots, layout, 0.04)
    want = read_mla_cache(cache, slots[:, 17], layout)[:, None, :512].expand(n, 64, 512)
    assert torch.equal(out.to(torch.bfloat16).float(), want.to(torch.bfloat16).float())


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
def test_misaligned_rows_take_the_triton_kernel(cache_dtype):
    """Rows not 16-byte aligned (the Hopper kernels copy them in 16-byte pieces): the op takes the
    Triton kernel, with the same result as on aligned rows."""
    g = torch.Generator().manual_seed(3)
    fp8 = cache_dtype == "fp8_ds_mla"
    layout = KVCacheLayout(cache_dtype, torch.bfloat16, 512, 64, 64)
    rows = _cache(layout, 2, "cuda", g).view(128, -1)
    width = rows.shape[1]
    # the same rows 4 bytes (FP8: the fp32 scales stay aligned) or one bf16 further into a larger
    # buffer: a base that is not 16-byte aligned, same contents
    shift = 4 if fp8 else 1
    buf = torch.zeros(rows.numel() + shift, dtype=rows.dtype, device="cuda")
    shifted = buf[shift:].view(128, width)
    shifted.copy_(rows)
    q = torch.randn(5, 64, 576, generator=g).to(torch.bfloat16).cuda()
    fmt = RowFormat(512, 64, fp8)
    assert op._decode_impl(q, shifted, fmt) == "triton"
    idx = torch.randint(0, 128, (5, 64), generator=g, dtype=torch.int32).cuda()
    want, _ = _run_rows("triton", q, rows, fmt, idx, 0.05)
    got, _ = op.sparse_mla_decode(q, shifted.view(2, 64, width), idx, layout, 0.05)
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_op_picks_the_hopper_kernels():
    """On an H200 with vllm._C built: fp8_ds_mla rows -> the CUDA kernel, bf16 rows -> Gluon."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("Hopper only")
    q = torch.zeros(2, 64, 576, dtype=torch.bfloat16, device="cuda")
    fp8_rows = torch.zeros(64, 656, dtype=torch.uint8, device="cuda")
    bf16_rows = torch.zeros(64, 576, dtype=torch.bfloat16, device="cuda")
    assert op._decode_impl(q, fp8_rows, RowFormat(512, 64, True)) == "cuda"
    assert op._decode_impl(q, bf16_rows, RowFormat(512, 64, False)) == "ws"
    assert op._prefill_impl(q, bf16_rows, RowFormat(512, 64, False)) == "ws"


@pytest.mark.gpu
@pytest.mark.parametrize("bn,warps,splits", [(32, 8, 1), (64, 8, 1), (32, 4, 2), (64, 8, 3)])
def test_decode_gpu_triton_configs(bn, warps, splits):
    from vllm.kernels.triton.sparse_mla_fwd import SparseMLAConfig

    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 128)
    cfg = SparseMLAConfig(64, bn, warps, 2, splits)
    _check_decode(
        "triton", layout, 11, 64, 2048, 64, "cuda", torch.bfloat16, 1e-2, seed=bn, config=cfg
    )


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "op"])
def test_decode_gpu_fp32_query_and_short_topk(impl):
    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 128)
    _check_decode(impl, layout, 6, 64, 100, 4, "cuda", torch.float32, 1e-2, seed=11)


@pytest.mark.gpu
@pytest.mark.parametrize("t,h,s", [(1, 64, 100), (77, 64, 4096), (300, 64, 3000), (33, 16, 5000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_gpu(t, h, s, dtype, impl):
    impl = _need(impl)
    _check_prefill(impl, t, h, s, 2048, 512, 64, "cuda", dtype, 1e-2, seed=t + s)
