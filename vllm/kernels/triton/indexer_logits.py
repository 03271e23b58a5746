"""Lightning-indexer scores in Triton (spec: :mod:`vllm.kernels.indexer`; DSA, SPEC §2):

    logit[t, s] = k_scale[s] · Σ_h w[t,h] · q_scale[t,h] · ReLU(q[t,h,:] · k[s,:])

Two kernels:
  * prefill — many queries against one flat context [S, D]. A program owns a [BLOCK_T, BLOCK_S]
    tile, keeps its BLOCK_S keys in shared memory and loops over the heads: one [BLOCK_T, D] ×
    [D, BLOCK_S] FP8 tensor-core dot per head, then ReLU and the weighted head sum in registers.
    Compute-bound (2·H·D FLOPs per output, 16 KB of fresh q per head and tile).
  * decode — each query against its own request's paged keys (the FP8 page layout: 64×128 e4m3
    values, then 64 fp32 scales), in local position space, nothing written past the context. A
    program owns one token and strides over its blocks of BLOCK_S positions: one [BLOCK_S, D] ×
    [D, H] dot each. Memory-bound (132 B per key).

When q and k are both FP8 the dots run in e4m3 (fp32 accumulate); otherwise operands are upcast to
fp32 and the GPU uses tf32, which is exact for FP8- or bf16-valued inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.triton.utils import check_cuda_or_interpreter, next_pow2, record
from vllm.kv_cache_interface import FP8_DTYPE, KVCacheLayout

__all__ = ["indexer_logits", "indexer_logits_paged"]


@triton.jit
def _load_operand(ptrs, mask, IS_FP8: tl.constexpr, BOTH_FP8: tl.constexpr):
    if IS_FP8:
        x = tl.load(ptrs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True)
        if not BOTH_FP8:
            x = x.to(tl.float32)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return x


# Sizes that change with every call are not specialised on, and the logits' rows are strided by a
# multiple of 16 (:func:`_logits_buffer`): one compiled variant per dtype pair, whatever the
# context (a first-use compile inside a server is a stall of the whole step).
@triton.jit(do_not_specialize=("num_q", "num_k", "num_s_blocks"))
def _indexer_logits_kernel(
    q_ptr,  # [T, H, D] e4m3 bytes or float, strides (stride_qt, stride_qh, 1)
    coef_ptr,  # [T, H] fp32 = w · q_scale, contiguous
    k_ptr,  # [S, D] e4m3 bytes or float, strides (stride_ks, 1)
    ks_ptr,  # [S] fp32 key scales
    out_ptr,  # [T, S] fp32, strides (stride_ot, 1)
    num_q,
    num_k,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_ot,
    num_s_blocks,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    Q_FP8: tl.constexpr,
    K_FP8: tl.constexpr,
):
    BOTH: tl.constexpr = Q_FP8 and K_FP8
    # consecutive programs share a query block (re-read once per head) and stream the keys
    pid = tl.program_id(0)
    tb = pid // num_s_blocks
    sb = pid % num_s_blocks
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    s = sb * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S]
    d = tl.arange(0, D)
    tmask = t < num_q
    smask = s < num_k
    k = _load_operand(
        k_ptr + s[:, None].to(tl.int64) * stride_ks + d[None, :], smask[:, None], K_FP8, BOTH
    )
    k_t = tl.trans(k)  # [D, BLOCK_S]
    q_rows = q_ptr + t[:, None].to(tl.int64) * stride_qt + d[None, :]  # [BLOCK_T, D]
    acc = tl.zeros((BLOCK_T, BLOCK_S), tl.float32)
    for h in range(H):
        qh = _load_operand(q_rows + h * stride_qh, tmask[:, None], Q_FP8, BOTH)
        c = tl.load(coef_ptr + t * H + h, mask=tmask, other=0.0)  # [BLOCK_T]
        acc += tl.maximum(tl.dot(qh, k_t), 0.0) * c[:, None]
    ks = tl.load(ks_ptr + s, mask=smask, other=0.0)
    out = acc * ks[None, :]
    o_ptrs = out_ptr + t[:, None].to(tl.int64) * stride_ot + s[None, :]
    tl.store(o_ptrs, out, mask=tmask[:, None] & smask[None, :])


@triton.jit(do_not_specialize=("max_ctx",))
def _indexer_logits_paged_kernel(
    q_ptr,  # [T, H, D] e4m3 bytes or float, strides (stride_qt, stride_qh, 1)
    coef_ptr,  # [T, H] fp32 = w · q_scale, contiguous
    cache_ptr,  # FP8: uint8 [NB, PAGE·(D+4)]; else [NB·PAGE, D] float
    block_table_ptr,  # [B, max_blocks] int32, strides (stride_bt, 1)
    token_req_ptr,  # [T] int, request row of each token
    ctx_ptr,  # [T] int, keys j < ctx[t] are valid
    out_ptr,  # [T, max_ctx] fp32, strides (stride_ot, 1)
    max_ctx,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_ot,
    H: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    Q_FP8: tl.constexpr,
    K_FP8: tl.constexpr,
):
    BOTH: tl.constexpr = Q_FP8 and K_FP8
    t = tl.program_id(1).to(tl.int64)
    ctx = tl.minimum(tl.load(ctx_ptr + t), max_ctx)
    req = tl.load(token_req_ptr + t).to(tl.int64)
    d = tl.arange(0, D)
    hh = tl.arange(0, BLOCK_HEADS)
    hmask = hh < H
    qp = q_ptr + t * stride_qt + hh[:, None] * stride_qh + d[None, :]
    q = _load_operand(qp, hmask[:, None], Q_FP8, BOTH)  # [BLOCK_HEADS, D]
    c = tl.load(coef_ptr + t * H + hh, mask=hmask, other=0.0)
    # the token's blocks of BLOCK_S positions, strided over the row's programs; positions past
    # its context are never touched, so the cost follows the context, not max_ctx
    for jb in range(tl.program_id(0), tl.cdiv(ctx, BLOCK_S), tl.num_programs(0)):
        j = jb * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S] local positions
        valid = j < ctx
        page = tl.load(block_table_ptr + req * stride_bt + j // PAGE, mask=valid, other=0)
        page = page.to(tl.int64)
        off = j % PAGE
        if K_FP8:
            page_base = cache_ptr + page * (PAGE * (D + 4))  # [BLOCK_S]
            k = _load_operand(
                (page_base + off * D)[:, None] + d[None, :], valid[:, None], True, BOTH
            )
            ks_ptr = (page_base + PAGE * D + off * 4).to(tl.pointer_type(tl.float32))
            ks = tl.load(ks_ptr, mask=valid, other=0.0)
        else:
            rows = (page * PAGE + off)[:, None] * D + d[None, :]
            k = _load_operand(cache_ptr + rows, valid[:, None], False, False)
            ks = tl.where(valid, 1.0, 0.0)
        dots = tl.dot(k, tl.trans(q))  # [BLOCK_S, BLOCK_HEADS]
        logit = tl.sum(tl.maximum(dots, 0.0) * c[None, :], axis=1) * ks
        tl.store(out_ptr + t * stride_ot + j, logit, mask=valid)


def _as_operand(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(tensor the kernel reads, is FP8): FP8 goes in as its bytes (the interpreter has no fp8
    pointers), anything else as is; the last dim made contiguous."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dtype == FP8_DTYPE:
        return x.view(torch.uint8), True
    if not x.is_floating_point():
        raise ValueError(f"indexer operands must be e4m3 or float, got {x.dtype}")
    return x, False


def _logits_buffer(t: int, s: int, device) -> torch.Tensor:
    """[t, s] fp32 whose rows are strided by a multiple of 16 (aligned row starts for the
    kernels that read it, and one compiled variant of each whatever s is)."""
    return torch.empty(t, -(-s // 16) * 16, dtype=torch.float32, device=device)[:, :s]


def _coef(w: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
    return (w.float() * q_scale.float()).contiguous()


def indexer_logits(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    block_t: int = 64,
    block_s: int = 128,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Prefill scores of T queries against one context of S keys (no mask: callers pass the
    causal limit to top-k).

    q: [T, H, D] e4m3 (``torch.float8_e4m3fn``) or float; q_scale, w: [T, H] float (w already
    × H^-0.5 · D^-0.5); k: [S, D] e4m3 or float; k_scale: [S] float. D a power of two (128).
    Returns logits [T, S] fp32 — ``indexer_logits_ref`` — with rows strided by a multiple of 16.
    """
    t, h, d = q.shape
    s = k.shape[0]
    if k.shape != (s, d) or q_scale.shape != (t, h) or w.shape != (t, h) or k_scale.shape != (s,):
        raise ValueError("indexer_logits: q [T,H,D], q_scale/w [T,H], k [S,D], k_scale [S]")
    if d != next_pow2(d) or d < 16:
        raise ValueError(f"index_head_dim must be a power of two >= 16, got {d}")
    check_cuda_or_interpreter(q, k, w)
    qx, q8 = _as_operand(q)
    kx, k8 = _as_operand(k)
    out = _logits_buffer(t, s, q.device)
    if t == 0 or s == 0:
        return out
    if num_stages is None:  # measured on an H200; fp32 tiles need the shallower pipe
        num_stages = 3 if (q8 and k8) else 2
    n_s = triton.cdiv(s, block_s)
    k = _indexer_logits_kernel[(triton.cdiv(t, block_t) * n_s,)](
        qx, _coef(w, q_scale), kx, k_scale.float().contiguous(), out, t, s,
        qx.stride(0), qx.stride(1), kx.stride(0), out.stride(0), n_s,
        H=h, D=d, BLOCK_T=block_t, BLOCK_S=block_s, Q_FP8=q8, K_FP8=k8,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    record("indexer_logits", k)
    return out


def indexer_logits_paged(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    w: torch.Tensor,
    cache: torch.Tensor,
    layout: KVCacheLayout,
    block_table: torch.Tensor,
    token_req: torch.Tensor,
    ctx_lens: torch.Tensor,
    max_ctx: int,
    block_s: int = 128,
    num_warps: int = 4,
) -> torch.Tensor:
    """Decode scores against paged keys, in each request's *local* position space.

    Key j of request r lives at slot block_table[r, j // block_size]·block_size + j % block_size
    of the indexer cache (``layout``: FP8 pages of block_size×D e4m3 values then block_size fp32
    scales, or [NB, block_size, D] model dtype with unit scales). q: [T, H, D] e4m3 or float;
    q_scale, w: [T, H]; token_req: [T] request row of each token; ctx_lens: [T].
    Returns logits [T, max_ctx] fp32 (rows strided by a multiple of 16); columns j >= ctx_lens[t] are not written (their values
    are unspecified: callers read a row only below its context, as top-k's limit does). The grid
    is (splits, T) with each program striding over its row's blocks, so a generous max_ctx (a
    CUDA graph's fixed width) costs nothing past each row's context.
    """
    t, h, d = q.shape
    if d != layout.index_head_dim or d != next_pow2(d):
        raise ValueError(f"q head dim {d} must equal index_head_dim (a power of two)")
    check_cuda_or_interpreter(q, cache, block_table)
    qx, q8 = _as_operand(q)
    out = _logits_buffer(t, max_ctx, q.device)
    if t == 0 or max_ctx == 0:
        return out
    bs = layout.block_size
    block_s = next_pow2(block_s)
    kx = cache.view(torch.uint8) if layout.is_fp8 else cache.view(-1, d)
    bt = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    # enough programs to fill the GPU at any batch; each strides over its row's blocks
    grid = (min(triton.cdiv(max_ctx, block_s), max(8, triton.cdiv(4096, t))), t)
    _indexer_logits_paged_kernel[grid](
        qx, _coef(w, q_scale), kx, bt, token_req.contiguous(), ctx_lens.contiguous(), out,
        max_ctx, qx.stride(0), qx.stride(1), bt.stride(0), out.stride(0),
        H=h, BLOCK_HEADS=max(16, next_pow2(h)), D=d, PAGE=bs, BLOCK_S=block_s,
        Q_FP8=q8, K_FP8=layout.is_fp8, num_warps=num_warps,
    )  # fmt: skip
    return out
