"""SwiGLU's activation, ``silu(gate) * up``, for the MLPs' down projection (the dense layers' MLP
and the shared expert; the routed experts fuse theirs into the grouped GEMM's epilogue).

In torch it is two elementwise kernels over the gate/up GEMM's output (SiLU on a strided half,
then the product), and under FP8 the down projection's GEMM quantises the product again: three
launches at decode sizes for a few hundred KB. ``silu_and_mul_quant`` does all three in one
Triton launch (``vllm/kernels/triton/activation.py``), with the reference's roundings: SiLU
rounded to the input dtype, the product rounded again, then ``per_token_group_quant_fp8``'s
bytes of that product.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.kernels import kernel_module
from vllm.kernels.fp8_gemm import per_token_group_quant_fp8_ref


def silu_and_mul_quant(
    x: torch.Tensor, group: int = 128
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """x [M, 2I] (gate columns, then up) -> (h = silu(gate) · up [M, I] in x's dtype, and where
    the Triton kernel runs (CUDA, I a multiple of ``group`` = 128) h's per-token-group
    quantisation (e4m3 [M, I], scales fp32 [M, I/128]) for an FP8 GEMM that reads it next;
    elsewhere (h, None))."""
    i = x.shape[-1] // 2
    ok = x.dim() == 2 and x.stride(-1) == 1 and group == 128 and i % group == 0 and i > 0
    fast = kernel_module("triton.activation", x, ok)
    if fast is None:
        return silu_and_mul_ref(x), None
    h, q, s = fast.silu_and_mul_quant(x, group)
    return h, (q, s)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return nn.functional.silu(gate) * up


def silu_and_mul_quant_ref(
    x: torch.Tensor, group: int = 128
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The reference of the fused form: the product, then its quantisation."""
    h = silu_and_mul_ref(x)
    return h, per_token_group_quant_fp8_ref(h, group)
