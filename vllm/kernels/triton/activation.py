"""SiLU · up and its FP8 quantisation in one Triton launch (spec: :mod:`vllm.kernels.activation`).

SiLU is torch's CUDA formula, x / (1 + expf(-x)) in fp32 with the correctly rounded libdevice
``expf`` and an IEEE division, rounded to the input dtype; the product of the two rounded
operands is rounded again; each 128-column group is then quantised by the quantiser's own
arithmetic (``_quant_groups``): the bytes of the two torch kernels and ``quant_per_token_group``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.kernels.fp8_gemm import AMAX_FLOOR, FP8_DTYPE, FP8_MAX
from vllm.kernels.triton.fp8_gemm import _quant_groups
from vllm.kernels.triton.moe_sorted import _group_major
from vllm.kernels.triton.utils import check_cuda_or_interpreter, exp_f32, interpreting

__all__ = ["silu_and_mul_quant"]

# 128-column groups per program
SPLIT_G = 4


# sx stays specialised: unknown to be a multiple of 16, the row loads compile to 2-byte loads
# (a 16-byte-aligned variant loads 4-8 bytes at once).
@triton.jit
def _silu_mul_quant_kernel(
    x_ptr,  # [M, 2I], row stride sx
    h_ptr,  # [M, I] contiguous, x's dtype (unused unless STORE_H)
    q_ptr,  # uint8 view of e4m3 [M, I]
    s_ptr,  # fp32 [M, ng], strides (stride_sm, stride_sg); [ng · M] group-major if GROUP_MAJOR
    n_rows_ptr,  # int32: rows from here on are skipped (unused unless HAS_N_ROWS)
    grp_ptr,  # int64 [M]: each row's group (unused unless GROUP_MAJOR)
    off_ptr,  # int32 [E + 1]: group e's rows are [off[e], off[e + 1]) (unused unless GROUP_MAJOR)
    sx,
    stride_sm,
    stride_sg,
    INTER: tl.constexpr,
    GROUP: tl.constexpr,
    SPLIT_G: tl.constexpr,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    SOFT_FP8: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    STORE_H: tl.constexpr,
    HAS_N_ROWS: tl.constexpr,
    GROUP_MAJOR: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    if HAS_N_ROWS:
        if r >= tl.load(n_rows_ptr):
            return
    gi = tl.program_id(1) * SPLIT_G + tl.arange(0, SPLIT_G)
    cols = gi[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [SPLIT_G, GROUP]
    m = cols < INTER
    g = tl.load(x_ptr + r * sx + cols, mask=m, other=0.0)
    u = tl.load(x_ptr + r * sx + INTER + cols, mask=m, other=0.0)
    dt = h_ptr.dtype.element_ty
    gf = g.to(tl.float32)
    one = tl.full(gf.shape, 1.0, tl.float32)
    silu = tl.math.div_rn(gf, one + exp_f32(-gf, USE_LIBDEVICE)).to(dt)
    h = (silu.to(tl.float32) * u.to(tl.float32)).to(dt)
    if STORE_H:
        tl.store(h_ptr + r * INTER + cols, h, mask=m)
    q, scale = _quant_groups(tl.where(m, h.to(tl.float32), 0.0), FLOOR, QMAX, SOFT_FP8)
    tl.store(q_ptr + r * INTER + cols, q, mask=m)
    if GROUP_MAJOR:
        dst = _group_major(grp_ptr, off_ptr, r, gi, (INTER + GROUP - 1) // GROUP)
    else:
        dst = r * stride_sm + gi * stride_sg
    tl.store(s_ptr + dst, scale, mask=gi * GROUP < INTER)


def silu_and_mul_quant(
    x: torch.Tensor,
    group: int = 128,
    store_h: bool = True,
    n_rows: torch.Tensor | None = None,
    groups: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """x [M, 2I] (unit last stride) -> (h [M, I] x.dtype, hq e4m3 [M, I], scale fp32 [M, I/group]
    as an M-contiguous view, the quantiser's layout). ``store_h=False``: h is not written (None
    returned; for a consumer of the quantised form only). ``n_rows``: an int32 device scalar;
    rows from ``n_rows`` on are left unset (rows the caller will not read, counted on the device).
    ``groups``: (grp int64 [M], offsets int32 [E + 1]) of expert-sorted rows; the scales are then
    returned flat [I/group · M] in the group-major layout of the grouped GEMM
    (``moe_sorted.gather_quantised_rows``), written where the program quantises them."""
    check_cuda_or_interpreter(x)
    m, two_i = x.shape
    i = two_i // 2
    ng = triton.cdiv(i, group)
    h = torch.empty(m if store_h else 0, i, dtype=x.dtype, device=x.device)
    q = torch.empty(m, i, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(ng, m, dtype=torch.float32, device=x.device).t()
    if groups is not None:
        s = s.t().reshape(-1)
        check_cuda_or_interpreter(*groups)
    grp, offsets = groups if groups is not None else (q, q)
    if m:
        _silu_mul_quant_kernel[(m, triton.cdiv(ng, SPLIT_G))](
            x, h, q.view(torch.uint8), s, q if n_rows is None else n_rows, grp, offsets,
            x.stride(0), s.stride(0), s.stride(-1), INTER=i, GROUP=group, SPLIT_G=SPLIT_G,
            FLOOR=AMAX_FLOOR, QMAX=FP8_MAX, SOFT_FP8=interpreting(),
            USE_LIBDEVICE=not interpreting(), STORE_H=store_h, HAS_N_ROWS=n_rows is not None,
            GROUP_MAJOR=groups is not None, num_warps=4,
        )  # fmt: skip
    return (h if store_h else None), q, s
