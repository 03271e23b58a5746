"""Indexer scores: prefill (flat keys) and decode (paged keys) against the fp32 references.

Tolerances: with FP8 q and k every product is exact in fp32 and Hopper's FP8 MMA accumulates with
reduced precision (~2^-13 relative), so ‖out − ref‖/‖ref‖ < 2e-3; the float path uses tf32, which
is exact for FP8/bf16-valued operands (what the model passes; prefill test: 1e-4, summation order
only) and rounds arbitrary fp32 q to 10 mantissa bits (paged test, random fp32 q: 5e-3).
Under the interpreter everything is fp32: 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from vllm.kernels.indexer import indexer_logits_paged_ref, indexer_logits_ref
from vllm.kernels.kv_cache import quantize_indexer_fp8, write_indexer_cache_ref
from vllm.kv_cache_interface import KVCacheLayout


def _rel(a, b):
    fin = b.isfinite()
    assert torch.equal(fin, a.isfinite())
    return ((a[fin] - b[fin]).norm() / b[fin].norm().clamp_min(1e-30)).item()


def _check_prefill(mod, t, s, h, d, device, fp8, tol, seed, **kw):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g)
    k = torch.randn(s, d, generator=g)
    w = torch.randn(t, h, generator=g) * (h * d) ** -0.5
    if fp8:
        q, qs = quantize_indexer_fp8(q)
        k, ks = quantize_indexer_fp8(k)
    else:  # bf16-valued, as the model's `auto` path feeds them: tf32 dots are then exact
        q, k = q.bfloat16().float(), k.bfloat16().float()
        qs, ks = torch.ones(t, h), torch.rand(s, generator=g) + 0.5
    args = [x.to(device) for x in (q, qs, w, k, ks)]
    out = mod.indexer_logits(*args, **kw)
    ref = indexer_logits_ref(*args)
    assert out.stride(0) % 16 == 0  # rows padded: one compiled variant whatever S
    err = _rel(out, ref)
    assert err < tol, err


def _check_paged(mod, cache_dtype, num_req, h, d, bs, device, q_fp8, tol, seed, **kw):
    g = torch.Generator().manual_seed(seed)
    layout = KVCacheLayout(cache_dtype, torch.float32, 64, 16, d, block_size=bs)
    ctx = torch.randint(1, 5 * bs, (num_req,), generator=g)
    ctx[0] = 0 if num_req > 2 else ctx[0]  # an empty context: all −inf
    max_blocks = int(ctx.max()) // bs + 1
    num_blocks = num_req * max_blocks + 1
    block_table = torch.randperm(num_blocks, generator=g)[: num_req * max_blocks]
    block_table = block_table.view(num_req, max_blocks).to(torch.int32)
    cache = layout.allocate_indexer(num_blocks, "cpu")
    keys = torch.randn(num_blocks * bs, d, generator=g)
    write_indexer_cache_ref(cache, keys, torch.arange(num_blocks * bs), layout)
    tokens_per_req = 2  # MTP-like: several query tokens per request
    token_req = torch.arange(num_req).repeat_interleave(tokens_per_req)
    t = token_req.shape[0]
    ctx_t = (ctx[token_req] - torch.arange(t) % tokens_per_req).clamp_min(0)
    q = torch.randn(t, h, d, generator=g)
    qs = torch.ones(t, h)
    if q_fp8:
        q, qs = quantize_indexer_fp8(q)
    w = torch.randn(t, h, generator=g)
    # a generous width (a CUDA graph's): the kernel leaves columns past each context unwritten
    max_ctx = int(ctx_t.max()) + 3 * bs
    dev = [x.to(device) for x in (q, qs, w, cache, block_table, token_req, ctx_t)]
    q, qs, w, cache, block_table, token_req, ctx_t = dev
    out = mod.indexer_logits_paged(
        q, qs, w, cache, layout, block_table, token_req, ctx_t, max_ctx, **kw
    )
    ref = indexer_logits_paged_ref(
        q.float(), qs, w, cache, layout, block_table, token_req, ctx_t, max_ctx
    )
    assert out.stride(0) % 16 == 0
    valid = torch.arange(max_ctx, device=ref.device).unsqueeze(0) < ctx_t.unsqueeze(1)
    assert torch.isneginf(ref[~valid]).all()
    assert _rel(out[valid], ref[valid]) < tol


# ---- CPU: Triton interpreter, tiny shapes ----------------------------------------------------
@pytest.mark.parametrize("fp8", [True, False])
def test_indexer_logits_interpreter(interp, fp8):
    _check_prefill(interp("indexer_logits"), 20, 40, 4, 32, "cpu", fp8, 1e-5, seed=1,
                   block_t=16, block_s=16, num_warps=4)  # fmt: skip


@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
@pytest.mark.parametrize("q_fp8", [True, False])
def test_indexer_logits_paged_interpreter(interp, cache_dtype, q_fp8):
    _check_paged(interp("indexer_logits"), cache_dtype, 3, 4, 32, 16, "cpu", q_fp8, 1e-5,
                 seed=2, block_s=32)  # fmt: skip


# ---- GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("t,s", [(1, 1), (100, 3000), (1024, 4096), (257, 8191)])
@pytest.mark.parametrize("fp8", [True, False])
def test_indexer_logits_gpu(t, s, fp8):
    from vllm.kernels.triton import indexer_logits as mod

    _check_prefill(mod, t, s, 32, 128, "cuda", fp8, 2e-3 if fp8 else 1e-4, seed=t + s)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["fp8_ds_mla", "auto"])
@pytest.mark.parametrize("q_fp8", [True, False])
def test_indexer_logits_paged_gpu(cache_dtype, q_fp8):
    from vllm.kernels.triton import indexer_logits as mod

    _check_paged(mod, cache_dtype, 9, 32, 128, 64, "cuda", q_fp8, 5e-3, seed=3)
