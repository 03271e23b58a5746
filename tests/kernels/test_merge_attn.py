"""LSE merge (DCP combine): against merge_attn_states_ref; empty shards contribute nothing, all
empty gives zeros and −inf, never NaN. fp32 throughout: 1e-5."""

from __future__ import annotations

import pytest
import torch

from vllm.kernels.merge_attn import merge_attn_states_ref


def _check(mod, n, t, h, dv, device, seed, in_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(n, t, h, dv, generator=g)
    lses = torch.randn(n, t, h, generator=g) * 3
    lses[torch.rand(n, t, h, generator=g) < 0.3] = float("-inf")  # empty shards
    lses[:, 0] = float("-inf")  # a token no shard has keys for
    outs[lses == float("-inf")] = 0.0  # what an empty shard returns
    outs, lses = outs.to(in_dtype).to(device), lses.to(device)
    out, lse = mod.merge_attn_states(outs, lses)
    ref_o, ref_l = merge_attn_states_ref(outs.float(), lses)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.allclose(out, ref_o, atol=1e-5, rtol=1e-5)
    assert torch.equal(lse.isfinite(), ref_l.isfinite())
    fin = ref_l.isfinite()
    assert torch.allclose(lse[fin], ref_l[fin], atol=1e-5, rtol=1e-5)
    assert out[0].abs().max().item() == 0.0


# ---- CPU: Triton interpreter, tiny shapes ----------------------------------------------------
@pytest.mark.parametrize("n,dv", [(1, 16), (3, 24), (8, 64)])
def test_merge_interpreter(interp, n, dv):
    _check(interp("merge_attn"), n, 5, 3, dv, "cpu", seed=n)


def test_merge_interpreter_ignores_garbage_in_empty_shards(interp):
    mod = interp("merge_attn")
    outs = torch.randn(2, 3, 2, 16)
    lses = torch.zeros(2, 3, 2)
    lses[1] = float("-inf")
    outs[1] = float("nan")  # an empty shard's output is never read
    out, lse = mod.merge_attn_states(outs, lses)
    assert torch.allclose(out, outs[0]) and torch.allclose(lse, lses[0])


# ---- GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2, 8])
@pytest.mark.parametrize("t", [1, 64, 1000])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_merge_gpu(n, t, in_dtype):
    from vllm.kernels.triton import merge_attn as mod

    _check(mod, n, t, 64, 512, "cuda", seed=n * t, in_dtype=in_dtype)
