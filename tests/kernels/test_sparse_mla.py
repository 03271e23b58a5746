"""Sparse MLA decode (paged fp8_ds_mla / bf16 cache) and MQA prefill against the fp32 references.

Tolerances: the kernels feed bf16 operands to tensor-core dots (q, dequantised rows, P) with fp32
accumulation, so outputs carry bf16 rounding: ‖out − ref‖/‖ref‖ < 1e-2 and |lse − ref| < 2e-2
(lse is a log of a sum of ~K terms, each with bf16-rounded logits). Under the interpreter
everything is fp32: 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm.attention.kv_cache import KVCacheLayout, write_mla_cache_ref
from vllm.attention.ops.sparse_mla import sparse_mla_ref


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


def _check_decode(mod, layout, t, h, k, num_blocks, device, q_dtype, tol, seed, **kw):
    g = torch.Generator().manual_seed(seed)
    cache = _cache(layout, num_blocks, device, g)
    q = torch.randn(t, h, layout.mla_dim, generator=g).to(q_dtype).to(device)
    empty = (0,) if t > 1 else ()
    slots = _slots(t, k, num_blocks * layout.block_size, device, g, empty_rows=empty)
    scale = 1.0 / math.sqrt(256)
    out = torch.full((t, h, layout.kv_lora_rank), float("nan"))
    out, lse = mod.sparse_mla_decode(q, cache, slots, layout, scale, **kw)
    ref_o, ref_l = sparse_mla_ref(q.float(), cache, slots, layout, scale)
    assert not out.isnan().any() and not lse.isnan().any()
    assert _rel(out, ref_o) < tol
    fin = ref_l.isfinite()
    assert torch.equal(fin, lse.isfinite())
    assert (lse[fin] - ref_l[fin]).abs().max().item() < 2 * tol
    if t > 1:  # the all −1 token: zeros and −inf
        assert out[0].abs().max().item() == 0.0 and (lse[0] == float("-inf")).all()


def _check_prefill(mod, t, h, s, k, d_v, rope, device, dtype, tol, seed, **kw):
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
    out, lse = mod.sparse_mla_prefill(q, kv, idx, scale, d_v, **kw)
    ref_o, ref_l = mod.sparse_mla_prefill_ref(q.float(), kv.float(), idx, scale, d_v)
    assert not out.isnan().any()
    assert _rel(out, ref_o) < tol
    fin = ref_l.isfinite()
    assert torch.equal(fin, lse.isfinite())
    assert (lse[fin] - ref_l[fin]).abs().max().item() < 2 * tol


# ---- CPU: Triton interpreter, tiny shapes ----------------------------------------------------
@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
@pytest.mark.parametrize("splits", [1, 2])
def test_decode_interpreter(interp, cache_dtype, splits):
    mod, fwd = interp("sparse_mla_decode"), interp("sparse_mla_fwd")
    layout = KVCacheLayout(cache_dtype, torch.float32, 128, 16, 32, block_size=16)
    cfg = fwd.SparseMLAConfig(16, 16, 4, 1, splits)
    _check_decode(mod, layout, 3, 4, 40, 4, "cpu", torch.float32, 1e-5, seed=splits, config=cfg)


def test_decode_interpreter_int_dequant(interp):
    mod = interp("sparse_mla_decode")
    layout = KVCacheLayout("fp8_ds_mla", torch.float32, 128, 16, 32, block_size=16)
    _check_decode(mod, layout, 2, 4, 24, 3, "cpu", torch.float32, 1e-5, seed=7, int_dequant=True)


def test_prefill_interpreter(interp):
    mod = interp("sparse_mla_prefill")
    _check_prefill(mod, 4, 3, 50, 24, 64, 16, "cpu", torch.float32, 1e-5, seed=3)


# ---- GPU ---------------------------------------------------------------------------------------
GLM = dict(r=512, rope=64, h=64, topk=2048)
# ws: the warp-specialised Gluon kernel (Hopper only) with its default consumer schedule, or
# forced to "seesaw" / "split" (``sparse_mla_ws.SCHEDULE``), and "+staged": FP8 rows through
# shared memory (``sparse_mla_ws.FP8_STAGED``); "+noidx": top-k ids read from global memory, not
# staged in shared memory (``IDX_SMEM``); "+syncq": the query loaded before the fork, not by
# cp.async (``Q_ASYNC``); "+late": the split schedule releases a stage after issuing the next
# block's QK (``EARLY_RELEASE``); "+cexp": the consumers expand the staged FP8 rows
# (``FP8_CONSUMER_EXPAND``); "+wide": the raw bytes copied a row per warp instruction
# (``WIDE_COPY``); "+s4": the tile scales 4 bytes per copy (``SCALE_BYTES``; these two apply where
# the consumers expand, as in "ws-asym", whose rows the expander expands); "+r64": 64 rows per
# producer batch (``STAGED_FP8_ROWS``); "ws-asym": the FP8 schedule with a scoring and an
# expanding warpgroup (``FP8_SCHEDULE``; bf16 rows keep theirs), "+b32" in 32-row blocks and 4
# stages (``ASYM_BLOCK_N``), "+pvf" with the expander's PV before its expansion (``ASYM_ORDER``),
# "+halves" with S begun on the first half of the expanded columns (``ASYM_HALVES``).
# Flags not named are off, so
# "ws-split+staged" is the producer-expanded FP8 path and "ws" the module's defaults.
KERNELS = ["triton", "ws", "ws-seesaw", "ws-split", "ws-seesaw+staged", "ws-split+staged",
           "ws-split+staged+cexp+wide+s4+r64", "ws-split+staged+cexp", "ws-asym+staged+wide+s4",
           "ws-asym+staged", "ws-asym+staged+wide+s4+b32", "ws-asym+staged+wide+s4+pvf",
           "ws-asym+staged+wide+s4+halves", "ws-asym+staged+wide+s4+pvf+halves"]  # fmt: skip


def _need(kernel, monkeypatch=None):
    """Skip the Gluon kernel off sm_90; select its variant; return the dispatch's kernel name."""
    if kernel.startswith("ws") and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialised kernel is built for sm_90")
    if kernel.startswith("ws-"):
        from vllm.kernels import sparse_mla_ws

        schedule, *flags = kernel[3:].split("+")
        if schedule == "asym":  # fp8_ds_mla rows only: bf16 rows keep their default
            monkeypatch.setattr(sparse_mla_ws, "SCHEDULE", None)
            monkeypatch.setattr(sparse_mla_ws, "FP8_SCHEDULE", "asym")
            monkeypatch.setattr(sparse_mla_ws, "FP8_ONE_WAVE_SCHEDULE", "asym")
        else:
            monkeypatch.setattr(sparse_mla_ws, "SCHEDULE", schedule)
        monkeypatch.setattr(sparse_mla_ws, "FP8_STAGED", "staged" in flags)
        monkeypatch.setattr(sparse_mla_ws, "IDX_SMEM", "noidx" not in flags)
        monkeypatch.setattr(sparse_mla_ws, "Q_ASYNC", "syncq" not in flags)
        monkeypatch.setattr(sparse_mla_ws, "EARLY_RELEASE", "late" not in flags)
        monkeypatch.setattr(sparse_mla_ws, "FP8_CONSUMER_EXPAND", "cexp" in flags)
        monkeypatch.setattr(sparse_mla_ws, "WIDE_COPY", "wide" in flags)
        monkeypatch.setattr(sparse_mla_ws, "SCALE_BYTES", 4 if "s4" in flags else 16)
        monkeypatch.setattr(sparse_mla_ws, "STAGED_FP8_ROWS", 64 if "r64" in flags else 32)
        monkeypatch.setattr(sparse_mla_ws, "ASYM_BLOCK_N", 32 if "b32" in flags else 64)
        monkeypatch.setattr(
            sparse_mla_ws, "ASYM_ORDER", "pv_first" if "pvf" in flags else "expand_first"
        )
        monkeypatch.setattr(sparse_mla_ws, "ASYM_HALVES", "halves" in flags)
        return "ws"
    return kernel


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
@pytest.mark.parametrize("t,h", [(1, 64), (7, 64), (64, 64), (130, 64), (5, 16), (9, 8), (3, 4)])
def test_decode_gpu(cache_dtype, t, h, kernel, monkeypatch):
    from vllm.kernels import sparse_mla_decode as mod

    kernel = _need(kernel, monkeypatch)
    layout = KVCacheLayout(cache_dtype, torch.bfloat16, GLM["r"], GLM["rope"], 128)
    _check_decode(
        mod, layout, t, h, GLM["topk"], 64, "cuda", torch.bfloat16, 1e-2, seed=t * h, kernel=kernel
    )


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
@pytest.mark.parametrize("splits,k", [(1, 64), (2, 2048), (3, 2048), (5, 700), (1, 3000)])
@pytest.mark.parametrize(
    "variant",
    ["ws-split", "ws-seesaw", "ws-split+staged", "ws-seesaw+staged",
     "ws-split+staged+noidx+syncq+late", "ws-seesaw+noidx+syncq", "ws-seesaw+syncq",
     "ws-split+staged+cexp", "ws-split+staged+cexp+wide+s4+r64", "ws-split+staged+cexp+noidx+syncq",
     "ws-split+staged+cexp+wide+s4+late", "ws-asym+staged+wide+s4", "ws-asym+staged+noidx+syncq",
     "ws", "ws-asym+staged+wide+s4+b32",
     "ws-asym+staged+b32+noidx+syncq", "ws-asym+staged+wide+s4+pvf", "ws-asym+staged+b32+pvf",
     "ws-asym+staged+wide+s4+halves", "ws-asym+staged+noidx+syncq+pvf+halves",
     "ws-asym+staged+b32+halves"],
)  # fmt: skip
def test_decode_gpu_ws_splits(cache_dtype, splits, k, variant, monkeypatch):
    """The Gluon kernel's split-K slices (merged like the Triton kernel's), ragged top-k; a
    3000-row slice is past the shared-memory id copy (IDX_CAP), so its ids come from global."""
    from vllm.kernels import sparse_mla_decode as mod
    from vllm.kernels.sparse_mla_fwd import SparseMLAConfig

    _need(variant, monkeypatch)
    layout = KVCacheLayout(cache_dtype, torch.bfloat16, 512, 64, 128)
    cfg = SparseMLAConfig(64, 64, 8, 2, splits)
    _check_decode(
        mod, layout, 9, 64, k, 64, "cuda", torch.bfloat16, 1e-2, seed=splits, config=cfg,
        kernel="ws",
    )  # fmt: skip


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
@pytest.mark.parametrize(
    "kernel,dequant",
    [("triton", None)] + [(k, d) for k in KERNELS[2:] for d in (0, 1)],
)
def test_decode_gpu_fp8_dequant_exact(kernel, dequant, monkeypatch):
    """One valid row per token, so P = 1 and the output is that row's dequantised values: every
    finite e4m3 code (subnormals and ±448 included) times tile scales from 2^-24 to 2^7 must come
    out as the fp32 product rounded to bf16 — exactly for the conversion-instruction dequant,
    within one bf16 ulp for the ws kernel's bit-move + bf16-fma dequant (``dequant`` 1)."""
    from vllm.attention.kv_cache import read_mla_cache_ref
    from vllm.kernels import sparse_mla_decode as mod

    kernel = _need(kernel, monkeypatch)
    if dequant is not None:
        from vllm.kernels import sparse_mla_ws

        monkeypatch.setattr(sparse_mla_ws, "FP8_DEQUANT", dequant)
    layout, cache, slots, q, n = exact_dequant_inputs()
    out, _ = mod.sparse_mla_decode(q, cache, slots, layout, 0.04, kernel=kernel)
    want = read_mla_cache_ref(cache, slots[:, 17], layout)[:, None, :512].expand(n, 64, 512)
    want = want.to(torch.bfloat16).float()
    got = out.float()
    if dequant == 1:
        ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-38))) - 7)
        assert ((got - want).abs() <= ulp).all()
        assert (got == want).float().mean().item() > 0.99
    else:
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
def test_ws_misaligned_rows_fall_back(cache_dtype):
    """Rows not 16-byte aligned (the Gluon kernel copies them in 16-byte pieces): the default
    dispatch takes the Triton kernel, with the same result; forcing "ws" is a clear error."""
    from vllm.kernels.sparse_mla_fwd import RowFormat, sparse_mla_fwd

    _need("ws")
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
    idx = torch.randint(0, 128, (5, 64), generator=g, dtype=torch.int32).cuda()
    fmt = RowFormat(512, 64, fp8)
    want, _ = sparse_mla_fwd(q, rows, fmt, idx, 0.05, kernel="triton")
    got, _ = sparse_mla_fwd(q, shifted, fmt, idx, 0.05)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="16-byte aligned"):
        sparse_mla_fwd(q, shifted, fmt, idx, 0.05, kernel="ws")


@pytest.mark.gpu
@pytest.mark.parametrize("int_dequant", [False, True])
@pytest.mark.parametrize("bn,warps,splits", [(32, 8, 1), (64, 8, 1), (32, 4, 2), (64, 8, 3)])
def test_decode_gpu_configs(int_dequant, bn, warps, splits):
    from vllm.kernels import sparse_mla_decode as mod
    from vllm.kernels.sparse_mla_fwd import SparseMLAConfig

    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 128)
    cfg = SparseMLAConfig(64, bn, warps, 2, splits)
    _check_decode(
        mod, layout, 11, 64, 2048, 64, "cuda", torch.bfloat16, 1e-2, seed=bn, config=cfg,
        int_dequant=int_dequant,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("q_dtype", [torch.float32])
def test_decode_gpu_fp32_query_and_short_topk(q_dtype, kernel, monkeypatch):
    from vllm.kernels import sparse_mla_decode as mod

    kernel = _need(kernel, monkeypatch)
    layout = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 128)
    _check_decode(mod, layout, 6, 64, 100, 4, "cuda", q_dtype, 1e-2, seed=11, kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("t,h,s", [(1, 64, 100), (77, 64, 4096), (300, 64, 3000), (33, 16, 5000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", KERNELS)
def test_prefill_gpu(t, h, s, dtype, kernel, monkeypatch):
    from vllm.kernels import sparse_mla_prefill as mod

    kernel = _need(kernel, monkeypatch)
    _check_prefill(mod, t, h, s, 2048, 512, 64, "cuda", dtype, 1e-2, seed=t + s, kernel=kernel)
