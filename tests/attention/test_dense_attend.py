"""The MHA form of prefill attention (contexts no longer than index_topk): the fused SDPA path
that bf16 models take against the fp32 reference, on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.attention.layer import SparseMLAAttention, _is_tail, joined


def _layer(h, nope, v, r, rope, device, seed):
    g = torch.Generator().manual_seed(seed)
    attn = SparseMLAAttention(0, h, nope, v, r, rope, (nope + rope) ** -0.5, has_indexer=False)
    kv_b = torch.randn(h * (nope + v), r, generator=g) * r**-0.5
    attn.set_kv_b(kv_b.to(device), torch.bfloat16)
    return attn, g


def _check(attn, g, t, s, positions, device, tail):
    h, r, rope = attn.num_heads, attn.kv_lora_rank, attn.rope_dim
    rows = torch.randn(s, r + rope, generator=g).to(device, torch.bfloat16)
    q_nope = torch.randn(t, h, attn.qk_nope, generator=g).to(device, torch.bfloat16)
    q_pe = torch.randn(t, h, rope, generator=g).to(device, torch.bfloat16)
    pos = torch.as_tensor(positions, device=device)
    assert _is_tail(np.asarray(positions), s) == tail
    got = attn._dense_attend(q_nope, q_pe, rows, pos, tail)
    assert got.dtype == torch.bfloat16 and got.shape == (t, h, attn.v_dim)
    # the model's query: both halves views of one [T, H, nope + rope] tensor (taken as it is)
    q = torch.cat([q_nope, q_pe], -1)
    halves = q[..., : attn.qk_nope], q[..., attn.qk_nope :]
    assert joined(*halves).data_ptr() == q.data_ptr()
    assert torch.equal(attn._dense_attend(*halves, rows, pos, tail), got)
    ref = attn._dense_attend_fp32(q_nope, q_pe, rows, pos)
    err = (got.float() - ref).abs().max().item()
    assert err <= 2e-2 * ref.abs().max().item(), err


@pytest.mark.parametrize(
    "t,s,positions,tail",
    [
        (24, 24, list(range(24)), True),  # a whole prompt
        (8, 40, list(range(32, 40)), True),  # a later chunk
        (8, 16, list(range(4)) + list(range(12, 16)), False),  # a PCP rank's two runs
        (5, 20, [3, 4, 5, 6, 7], False),  # not aligned to the last key
    ],
)
def test_sdpa_matches_reference_cpu(t, s, positions, tail):
    attn, g = _layer(4, 16, 16, 32, 8, "cpu", seed=t * 100 + s)
    _check(attn, g, t, s, positions, "cpu", tail)


def test_joined_only_for_adjacent_halves_of_one_tensor():
    q = torch.randn(3, 4, 10)
    a, b = q[..., :6], q[..., 6:]
    assert torch.equal(joined(a, b), q)
    assert joined(b, a) is None  # wrong order
    assert joined(a, q[..., 6:9]) is not None  # a narrower tail still lies inside each row
    assert joined(a.clone(), b) is None  # separate tensors
    assert joined(q[:, :2, :6], q[:, 1:3, 6:]) is None  # not the same rows
    wide = torch.randn(3, 4, 7)
    assert joined(wide[..., :3], wide[..., 3:6].contiguous()) is None  # other strides


def test_fp32_queries_take_the_reference():
    attn, g = _layer(2, 8, 8, 16, 4, "cpu", seed=1)
    q_nope, q_pe = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 4, generator=g)
    rows, pos = torch.randn(3, 20, generator=g), torch.arange(3)
    got = attn._dense_attend(q_nope, q_pe, rows, pos, True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, attn._dense_attend_fp32(q_nope, q_pe, rows, pos))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t,s", [(2048, 2048), (512, 2048), (300, 1000)])
def test_sdpa_matches_reference_glm_dims_cuda(t, s):
    """GLM-5.3's head dims (qk 192 + 64, v 256): a chunk at the context's end takes the
    flash-attention kernel, never cuDNN's (which compiles a graph for every new length: a stall
    inside a serving step); a PCP rank's two runs take the masked path."""
    attn, g = _layer(64, 192, 256, 512, 64, "cuda", seed=t + s)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _check(attn, g, t, s, list(range(s - t, s)), "cuda", True)
    names = {e.name for e in prof.events()}
    assert "aten::_scaled_dot_product_flash_attention" in names, sorted(names)
    assert not any("cudnn" in n for n in names), sorted(names)
    _check(attn, g, 16, s, list(range(8)) + list(range(s - 8, s)), "cuda", False)
