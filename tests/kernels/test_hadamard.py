"""The indexer's Walsh–Hadamard rotation: the 16-bit GEMM form against the exact rotation."""

from __future__ import annotations

import pytest
import torch

from vllm.kernels.hadamard import hadamard_transform, hadamard_transform_ref


def _exact(x: torch.Tensor) -> torch.Tensor:
    """x · H / sqrt(D) in float64, H built independently (H[i, j] = (-1)^popcount(i & j))."""
    d = x.shape[-1]
    i = torch.arange(d)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    h = 1.0 - 2.0 * parity.double()
    return (x.double() @ h) * d**-0.5


def _bound(x: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half a unit in the last place of the output dtype at the exact value, plus the fp32 sum's
    rounding (D terms of |x| / sqrt(D), each step within 2^-24 relative)."""
    e = exact.to(dtype)
    up = torch.nextafter(e, torch.full_like(e, float("inf"))).double()
    down = torch.nextafter(e, torch.full_like(e, float("-inf"))).double()
    half_ulp = torch.maximum(up - e.double(), e.double() - down) / 2
    d = x.shape[-1]
    return half_ulp + d * 2.0**-24 * x.double().abs().sum(-1, keepdim=True) * d**-0.5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(257, 32, 128), (64, 128), (5, 3, 64)])
def test_gemm_form_rounds_the_exact_rotation(dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    x[0, ..., :] = x[0, ..., :1]  # a constant row: all but the first output exactly 0
    got = hadamard_transform(x)
    assert got.dtype == dtype and got.shape == x.shape
    exact = _exact(x)
    err = (got.double() - exact).abs()
    assert bool((err <= _bound(x, exact, dtype)).all()), err.max()
    # the reference obeys the same bound: the two forms differ by rounding only
    ref = hadamard_transform_ref(x)
    assert bool(((ref.double() - exact).abs() <= _bound(x, exact, dtype)).all())
    assert (got[1:] != ref[1:]).float().mean() < 0.01  # row 0: exact zeros (module doc)
    assert bool((got[0, ..., 1:] == 0).all())


def test_rotation_is_orthonormal_and_fp32_uses_the_reference():
    x = torch.randn(17, 4, 64, dtype=torch.float32)
    y = hadamard_transform(x)
    assert torch.equal(y, hadamard_transform_ref(x))
    torch.testing.assert_close(hadamard_transform(y), x, rtol=1e-5, atol=1e-5)  # H·H = I
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), _exact(x), rtol=1e-5, atol=1e-5)


def test_non_contiguous_input():
    base = torch.randn(8, 6, 128).to(torch.bfloat16)
    x = base[:, 1:5]  # a head slice: strided rows
    got, want = hadamard_transform(x), hadamard_transform(x.contiguous())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
