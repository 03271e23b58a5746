"""Per-head products of MLA's absorption in Triton: out[t, h, :] = x[t, h, :] · w[h] for the
decode queries through W_UK (K = 128 -> N = 512) and the attention output through W_UVᵀ
(K = 512 -> N = 128), each written straight into its (strided) destination.

cuBLAS's batched GEMM ran these at ~30 % of the copy bandwidth at decode sizes (9.3 and 8.2 µs
for 8 MB of weights each at T = 64 on an H100): its tiles are sized for long batches of big
matrices. Here a program owns (head, BLOCK_N columns, BLOCK_T tokens): the head's weight slice is
read once, the tokens' rows from L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.triton.utils import check_cuda_or_interpreter

__all__ = ["head_bmm"]


@triton.jit(do_not_specialize=("t", "sxt", "sxh", "sot", "soh"))
def _head_bmm_kernel(
    x_ptr,  # [T, H, K], strides (sxt, sxh, 1)
    w_ptr,  # [H, K, N], strides (swh, swk, swn)
    o_ptr,  # [T, H, N], strides (sot, soh, 1)
    t,
    sxt,
    sxh,
    sot,
    soh,
    swh: tl.constexpr,
    swk: tl.constexpr,
    swn: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    rm = rows < t
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * sxt + h * sxh + k[None, :], mask=rm[:, None], other=0.0)
        w = tl.load(w_ptr + h * swh + k[:, None] * swk + n[None, :] * swn)
        if FP32_DOT:  # the interpreter (and fp32 models): exact fp32 products
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(
        o_ptr + rows[:, None] * sot + h * soh + n[None, :],
        acc.to(o_ptr.dtype.element_ty),
        mask=rm[:, None],
    )


def head_bmm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, fp32_dot: bool = False) -> None:
    """out [T, H, N] (unit last stride) = x [T, H, K] (unit last stride) · w [H, K, N] (any
    strides: a transposed view for W_UVᵀ), fp32 accumulation; K and N multiples of 64."""
    check_cuda_or_interpreter(x, w, out)
    t, h, k = x.shape
    n = w.shape[2]
    if t == 0:
        return
    block_t = 16 if t <= 16 else 32 if t <= 32 else 64
    block_n, block_k = 64, 64
    grid = (h, triton.cdiv(n, block_n), triton.cdiv(t, block_t))
    _head_bmm_kernel[grid](
        x, w, out, t, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        swh=w.stride(0), swk=w.stride(1), swn=w.stride(2), K=k, N=n, BLOCK_T=block_t,
        BLOCK_N=block_n, BLOCK_K=block_k, FP32_DOT=fp32_dot or x.dtype == torch.float32, num_stages=3,
        num_warps=4,
    )  # fmt: skip
