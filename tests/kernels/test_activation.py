"""SiLU · up with its FP8 quantisation in one launch, against the torch kernels and the quantiser
(interpreter here; compiled on GPU, bit for bit)."""

from __future__ import annotations

import pytest
import torch

from vllm.kernels.activation import silu_and_mul_quant, silu_and_mul_quant_ref
from vllm.kernels.fp8_gemm import per_token_group_quant_fp8_ref


@pytest.mark.parametrize("m,i", [(1, 128), (5, 384)])
@pytest.mark.parametrize("dtype", [torch.float32])  # the interpreter rounds to bf16 its own way
def test_kernel_interpreter(interp, m, i, dtype):
    mod = interp("activation")
    g = torch.Generator().manual_seed(m + i)
    x = (torch.randn(m, 2 * i, generator=g) * 4).to(dtype)
    h_ref, (q_ref, s_ref) = silu_and_mul_quant_ref(x)
    h, q, s = mod.silu_and_mul_quant(x, 128)
    # the interpreter's exp is numpy's and its bf16 rounding its own (the compiled kernel's exp
    # is libdevice's, as torch's CUDA SiLU: the GPU test asks for the same bits); here within a
    # unit of the dtype, and the quantisation exactly the quantiser's of the kernel's own h
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(h.float(), h_ref.float(), rtol=tol, atol=1e-6)
    q2, s2 = per_token_group_quant_fp8_ref(h, 128)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 300])
def test_kernel_bits_on_cuda(m):
    x = (torch.randn(m, 2 * 2048, device="cuda") * 4).to(torch.bfloat16)
    h_ref, (q_ref, s_ref) = silu_and_mul_quant_ref(x)
    h, (q, s) = silu_and_mul_quant(x)
    assert torch.equal(h, h_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
