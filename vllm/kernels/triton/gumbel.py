"""Gumbel-max sampling in Triton (spec: :func:`vllm.kernels.sampling.gumbel_sample`): the noise
hash, the Gumbel transform and the argmax in one pass over the logits.

The torch formula builds the [B, V] uniforms through a dozen int64 and float64 tensors (~300
bytes of traffic per token, milliseconds at B = 256, V = 154,880) before the argmax. Here each
program reads a CHUNK of a row once and computes, per token, the same uniform bit for bit: the
hash in uint32 (the int64 formula's products, masked to 32 bits, are the uint32 products), u =
fp32(2h + 1) · 2^-33 (one rounding of (h + 0.5) / 2^32, as the double formula's .float()), the
clamp, then -log(-log(u)) with CUDA's logf (libdevice; torch's log on CUDA) and the argmax,
lowest index on ties. A block whose max logit plus the largest Gumbel noise (-log(-log(1 -
2^-24)) < 17) cannot beat the chunk's best so far skips the noise: rows filtered by top-k / top-p
(mostly -inf) cost little more than their read. Chunks combine through an atomic max on
(order-preserving value key << 32 | ~index).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.triton.topk import _key_of
from vllm.kernels.triton.utils import check_cuda_or_interpreter, interpreting, log_f32, record

__all__ = ["gumbel_sample", "uniforms"]

G_MAX = tl.constexpr(17.0)  # above every Gumbel noise the clamped uniforms give (16.64)


@triton.jit
def _mix32(h):
    """The sampler's 32-bit finaliser on uint32 (wrapping products = the int64 ones & 2^32 - 1)."""
    h = ((h >> 16) ^ h) * 0x45D9F3B
    h = ((h >> 16) ^ h) * 0x45D9F3B
    return (h >> 16) ^ h


@triton.jit
def _row_hash(seed_ptr, pos_ptr, row):
    """The row's hash of (seed, position), as uniform_noise's b (uint32)."""
    seed = tl.load(seed_ptr + row).to(tl.int64)
    s = (seed ^ (seed >> 32)) & 0xFFFFFFFF
    pos = tl.load(pos_ptr + row).to(tl.int64) & 0xFFFFFFFF
    return _mix32(_mix32(s.to(tl.uint32)) ^ pos.to(tl.uint32))


@triton.jit
def _uniform(b, idx):
    """The row's hash b (uint32), token indices -> uniform_noise's values, bit for bit."""
    h = _mix32(b ^ idx.to(tl.uint32))
    u = (h.to(tl.int64) * 2 + 1).to(tl.float32) * 1.1641532182693481e-10  # RNE(2h + 1) · 2^-33
    return tl.minimum(u, 0.99999994039535522)  # 1 - 2^-24


@triton.jit
def _gumbel_argmax_kernel(
    x_ptr,  # [B, V] fp32, row stride stride_x
    temp_ptr,  # [B] fp32: rows with temperature > 0 sample, the others take the argmax
    seed_ptr,  # [B] int64
    pos_ptr,  # [B] int64
    best_ptr,  # [B] int64, INT64_MIN on entry: max over chunks of key << 32 | (2^32 - 1 - index)
    V,
    stride_x,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * CHUNK
    noisy = tl.load(temp_ptr + row) > 0
    b = _row_hash(seed_ptr, pos_ptr, row)
    xrow = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), c0, tl.int32)
    for b0 in range(c0, tl.minimum(c0 + CHUNK, V), BLOCK):
        idx = b0 + offs
        x = tl.load(xrow + idx, mask=idx < V, other=float("-inf"))
        bm = tl.max(x, 0)
        if noisy:
            if bm + G_MAX >= best:  # else no token of the block can win
                u = _uniform(b, idx)
                s_ = x - log_f32(-log_f32(u, USE_LIBDEVICE), USE_LIBDEVICE)
                s_ = tl.where(idx < V, s_, float("-inf"))
                sm = tl.max(s_, 0)
                if sm > best:
                    best = sm
                    best_i = tl.min(tl.where(s_ == sm, idx, 2147483647))
        else:
            if bm > best:
                best = bm
                best_i = tl.min(tl.where(x == bm, idx, 2147483647))
    key = _key_of(best.to(tl.int32, bitcast=True)).to(tl.int64)
    tl.atomic_max(best_ptr + row, (key << 32) | (4294967295 - best_i.to(tl.int64)))


@triton.jit
def _uniform_kernel(seed_ptr, pos_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = _row_hash(seed_ptr, pos_ptr, row)
    for b0 in range(0, V, BLOCK):
        idx = b0 + tl.arange(0, BLOCK)
        tl.store(out_ptr + row * V + idx, _uniform(b, idx), mask=idx < V)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The uniforms the sampling kernel draws, as a [B, vocab] tensor (for checks against
    ``uniform_noise``; the sampler never materialises them)."""
    check_cuda_or_interpreter(seeds, positions)
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    if seeds.shape[0] and vocab:
        _uniform_kernel[(seeds.shape[0],)](seeds.contiguous(), positions.contiguous(), out, vocab,
                                           BLOCK=1024)  # fmt: skip
    return out


def gumbel_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    chunk: int = 8192,
    block: int = 1024,
    num_warps: int = 4,
) -> torch.Tensor:
    """:func:`vllm.kernels.sampling.gumbel_sample` on CUDA (or the interpreter); ``chunk``
    tokens per program (rows split so that small batches still fill the GPU), ``block`` per
    step."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    check_cuda_or_interpreter(logits, temperature, seeds, positions)
    b, v = logits.shape
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        logits = logits.float().contiguous()
    best = torch.full((b,), torch.iinfo(torch.int64).min, dtype=torch.int64, device=logits.device)
    if b == 0 or v == 0:
        return best
    chunk = max(block, chunk // block * block)
    kern = _gumbel_argmax_kernel[(b, triton.cdiv(v, chunk))](
        logits, temperature.float().contiguous(), seeds.contiguous(), positions.contiguous(),
        best, v, logits.stride(0), CHUNK=chunk, BLOCK=block, USE_LIBDEVICE=not interpreting(),
        num_warps=num_warps,
    )  # fmt: skip
    record("gumbel_sample", kern)
    return 4294967295 - (best & 4294967295)
