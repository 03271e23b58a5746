"""Top-k selection: identical to topk_ref (same positions, same order), including ties, −0.0,
−inf scores, limits shorter than k (−1 padding), limit 0 and rows longer than one chunk."""

from __future__ import annotations

import pytest
import torch

from vllm.attention.ops.indexer import topk_ref


def _logits(t, s, g, ties=True):
    x = torch.randn(t, s, generator=g)
    if ties:  # coarse values: many exact ties, zeros of both signs, a few −inf
        x = (x * 4).round() / 4
        x[x == 0] = torch.where(torch.rand(int((x == 0).sum()), generator=g) < 0.5, 0.0, -0.0)
        x[torch.rand(t, s, generator=g) < 0.01] = float("-inf")
    return x


def _check(mod, t, s, topk, device, seed, ties=True, limits=None, **kw):
    g = torch.Generator().manual_seed(seed)
    logits = _logits(t, s, g, ties)
    if limits is None:
        limits = torch.randint(0, s + 3, (t,), generator=g)
        limits[0] = s
        if t > 1:
            limits[1] = 0
    logits, limits = logits.to(device), limits.to(device)
    got = mod.indexer_topk(logits, limits, topk, **kw)
    ref = topk_ref(logits, limits, topk)
    assert got.dtype == torch.int32 and got.shape == (t, topk)
    assert torch.equal(got.cpu(), ref.cpu())


# ---- CPU: Triton interpreter, tiny shapes ----------------------------------------------------
# cap 256: the sampled candidate list holds every row's candidates; cap 16 (< 1.5·k): every row
# falls back to the whole-row radix select; sampled=False: no pre-filter at all
@pytest.mark.parametrize("kw", [dict(cap=256), dict(cap=16), dict(sampled=False)])
@pytest.mark.parametrize("t,s,topk,chunk", [(5, 300, 16, 64), (3, 40, 64, 16), (4, 129, 7, 32)])
def test_topk_interpreter(interp, t, s, topk, chunk, kw):
    _check(interp("topk"), t, s, topk, "cpu", seed=s, chunk=chunk, num_warps=4, sample=64, **kw)


def test_topk_interpreter_distinct_scores(interp):
    _check(interp("topk"), 3, 200, 32, "cpu", seed=9, ties=False, chunk=64, num_warps=4, sample=64)


# ---- GPU ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(
    "t,s,topk", [(7, 1000, 2048), (64, 131072, 2048), (300, 5000, 2048), (16, 70000, 100)]
)
@pytest.mark.parametrize("ties", [True, False])
@pytest.mark.parametrize("sampled", [True, False])
def test_topk_gpu(t, s, topk, ties, sampled):
    from vllm.kernels import topk as mod

    _check(mod, t, s, topk, "cuda", seed=t + s, ties=ties, sampled=sampled)


@pytest.mark.gpu
def test_topk_gpu_one_million():
    from vllm.kernels import topk as mod

    _check(mod, 2, 1 << 20, 2048, "cuda", seed=1, ties=False,
           limits=torch.tensor([1 << 20, 777_777]))  # fmt: skip
