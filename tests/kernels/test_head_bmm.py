"""MLA's per-head absorption products: the Triton kernel against torch.bmm, into strided
destinations, with a transposed weight (interpreter here in fp32; bf16 on GPU)."""

from __future__ import annotations

import pytest
import torch

from vllm.kernels.mla_absorb import head_bmm, head_bmm_ref


def _case(t, h, k, n, dtype, transposed, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x_full = torch.randn(t, h, k + 64, generator=g).to(dtype)  # x: the first k of each head
    w = torch.randn(h, n, k, generator=g).to(dtype) * k**-0.5
    w = w.transpose(1, 2) if transposed else w.transpose(1, 2).contiguous()  # [H, K, N]
    out_full = torch.zeros(t, h, n + 64, dtype=dtype)  # out: the first n of each head
    return (a.to(device) for a in (x_full[..., :k], w, out_full))


@pytest.mark.parametrize("t,h,k,n,transposed", [(3, 2, 128, 128, False), (20, 3, 64, 128, True)])
def test_kernel_interpreter(interp, t, h, k, n, transposed):
    mod = interp("head_bmm")
    x, w, out_full = _case(t, h, k, n, torch.float32, transposed, seed=t)
    out = out_full[..., :n]
    mod.head_bmm(x, w, out)
    want = torch.einsum("thk,hkn->thn", x.double(), w.double()).float()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert out_full[..., n:].eq(0).all()  # nothing written past the view


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 64, 200])
@pytest.mark.parametrize("k,n,transposed", [(128, 512, False), (512, 128, True)])
def test_kernel_matches_bmm_on_cuda(t, k, n, transposed):
    x, w, out_full = _case(t, 64, k, n, torch.bfloat16, transposed, seed=t, device="cuda")
    got = head_bmm(x, w, out_full[..., :n].clone())
    want = head_bmm_ref(x, w, torch.empty_like(got))
    exact = torch.einsum("thk,hkn->thn", x.double(), w.double())
    # both round one fp32 sum to bf16: within a unit of bf16 of the exact product
    for r in (got, want):
        torch.testing.assert_close(r.double(), exact, rtol=2**-7, atol=1e-3)
