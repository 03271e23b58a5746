"""RMSNorm and rotary embedding, each one pass over its tensor.

In plain torch each is a chain of elementwise kernels over fp32 copies: RMSNorm six (cast, square,
mean, scale, cast back, weight), the interleaved rotation ten (cast, four products, two sums, a
stack, a flatten, a cast back), and the rotated half then went back into its head through a
``torch.cat`` of the whole head. On an H100 an 8,192-token prefill step of the 4-layer GLM-5.3
slice spent ~10 of its 34 ms of device time in those chains and concatenations, and a decode step
~140 of its launches. The Triton kernels (``vllm/kernels/triton/norm_rope.py``) read each element
once and write it once, the rotation in place into the head it belongs to.

Numerics: the references define them (fp32 inside, one rounding to the input dtype, then the
weight's product rounded again, as the model's torch code did). The kernels compute the same
formulas; the mean's summation order and fused multiply-adds may move a value by one unit in the
last place of the output dtype.
"""

from __future__ import annotations

import torch

from vllm.kernels import kernel_module


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x², -1) + eps))`` over the last dim, computed in fp32 and
    rounded to x's dtype before the weight's product (as HF's GLM and DeepSeek norms). x [..., D]
    with a contiguous last dim (rows may be strided: a split of a fused projection)."""
    fast = kernel_module("triton.norm_rope", x, x.stride(-1) == 1 and x.dim() >= 1)
    if fast is not None:
        return fast.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


# rows up to which rms_norm_quant fuses the quantisation (decode sizes): every program of the
# fused kernel re-sums its row, which loses to the two kernels at prefill sizes
QUANT_MAX_ROWS = 64


def rms_norm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, group: int = 128
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """:func:`rms_norm`, and where the Triton kernel runs (up to :data:`QUANT_MAX_ROWS` rows,
    groups of 128), its output also quantised per token per group (``quant_per_token_group``'s
    e4m3 bytes and scales) in the same launch, for an FP8 GEMM that reads it next
    (``x_quant``); elsewhere (y, None)."""
    d = x.shape[-1]
    rows = x.numel() // max(1, d)
    ok = x.stride(-1) == 1 and x.dim() >= 1 and d > group == 128 and rows <= QUANT_MAX_ROWS
    fast = kernel_module("triton.norm_rope", x, ok)
    if fast is None:
        return rms_norm(x, weight, eps), None
    y, q, s = fast.rms_norm_quant(x, weight, eps, group)
    return y, (q, s)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`rms_norm` of s, s) for s = x + residual rounded to x's dtype (torch's add): the
    residual stream's add and the next norm in one pass (upstream's ``fused_add_rms_norm``,
    without writing into its inputs). The same bits as the add then the norm."""
    ok = _fusable(x, residual)
    fast = kernel_module("triton.norm_rope", x, ok)
    if fast is not None:
        return fast.rms_norm(x, weight, eps, residual)
    s = x + residual
    return rms_norm(s, weight, eps), s


def add_rms_norm_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: int = 128
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """:func:`add_rms_norm` and, where :func:`rms_norm_quant` would, the norm's quantisation in
    the same launch: (y, s, x_quant or None)."""
    d = x.shape[-1]
    rows = x.numel() // max(1, d)
    ok = _fusable(x, residual) and d > group == 128 and rows <= QUANT_MAX_ROWS
    fast = kernel_module("triton.norm_rope", x, ok)
    if fast is None:
        y, s = add_rms_norm(x, residual, weight, eps)
        return y, s, None
    y, q, sc, s = fast.rms_norm_quant(x, weight, eps, group, residual=residual)
    return y, s, (q, sc)


def _fusable(x: torch.Tensor, residual: torch.Tensor) -> bool:
    return (
        x.dim() >= 1
        and residual.shape == x.shape
        and residual.dtype == x.dtype
        and x.stride(-1) == 1
        and residual.stride(-1) == 1
    )


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleave: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate x [T, ..., dim] (at most one middle dim: heads) by the angles cos/sin [T, dim/2]
    (fp32; broadcast over the middle dim). ``interleave`` rotates pairs (x0, x1), (x2, x3), …
    (DeepSeek/GLM checkpoints), otherwise the halves (x[:d/2], x[d/2:]) (NeoX). Computed in fp32,
    rounded to ``out``'s dtype. ``out``: where to write (x's shape; may be x itself or a view of
    a larger tensor: the rotation in place inside its head); a new tensor of x's dtype if None.
    Returns ``out``."""
    half = x.shape[-1] // 2
    ok = x.dim() in (2, 3) and x.stride(-1) == 1 and (out is None or out.stride(-1) == 1)
    ok = ok and half >= 1 and half & (half - 1) == 0 and x.shape[-1] == 2 * half
    fast = kernel_module("triton.norm_rope", x, ok and cos.is_contiguous() and sin.is_contiguous())
    if fast is not None:
        return fast.apply_rope(x, cos, sin, interleave, out)
    r = apply_rope_ref(x, cos, sin, interleave)
    if out is None:
        return r
    return out.copy_(r)


def apply_rope_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        r = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        r = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return r.to(x.dtype)


def rms_norm_cost(num_rows: int, dim: int, itemsize: int = 2) -> tuple[int, int]:
    """(flops, bytes): each row read and written once, the weight once (L2-resident after)."""
    return 4 * num_rows * dim, (2 * num_rows + 1) * dim * itemsize


def apply_rope_cost(num_tokens: int, heads: int, dim: int, itemsize: int = 2) -> tuple[int, int]:
    """(flops, bytes): the rotated dims read and written once, the fp32 angles read once."""
    return 3 * num_tokens * heads * dim, 2 * num_tokens * heads * dim * itemsize + (
        num_tokens * dim * 4
    )
