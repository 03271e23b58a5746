"""MoE sigmoid top-k routing: the Triton kernel against the reference (interpreter here, compiled
on GPU): the same experts in the same order, weights within fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from vllm.kernels.moe import route_topk, route_topk_ref


def _case(t: int, e: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g) * 3
    bias = torch.randn(e, generator=g) * 0.1
    return logits, bias


def test_reference_picks_by_biased_score_and_weights_unbiased():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # expert 3 chosen first for its bias alone
    w, ids = route_topk_ref(logits, bias, 2, norm=False, scaling=2.0)
    assert ids.tolist() == [[3, 1]]
    s = logits.sigmoid()[0]
    torch.testing.assert_close(w[0], 2.0 * s[[3, 1]])
    w, _ = route_topk_ref(logits, bias, 2, norm=True, scaling=1.0)
    torch.testing.assert_close(w.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("t,e,k,norm,scaling", [(5, 16, 4, True, 2.5), (3, 24, 8, False, 1.0)])
def test_kernel_interpreter(interp, t, e, k, norm, scaling):
    mod = interp("moe_route")
    logits, bias = _case(t, e, seed=t)
    w_ref, ids_ref = route_topk_ref(logits, bias, k, norm=norm, scaling=scaling)
    w, ids = mod.route_topk(logits, bias, k, norm, scaling)
    assert ids.dtype == torch.int64 and torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=0)
    # a strided logits view (rows of a wider buffer)
    wide = torch.cat([logits, logits], 1)[:, :e]
    assert torch.equal(mod.route_topk(wide, bias, k, norm, scaling)[1], ids_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 3000])
def test_kernel_matches_reference_on_cuda(t):
    logits, bias = _case(t, 256, seed=t)
    w_ref, ids_ref = route_topk_ref(logits.cuda(), bias.cuda(), 8, norm=True, scaling=2.5)
    w, ids = route_topk(logits.cuda(), bias.cuda(), 8, norm=True, scaling=2.5)
    assert torch.equal(ids.cpu(), ids_ref.cpu())
    torch.testing.assert_close(w.cpu(), w_ref.cpu(), rtol=1e-6, atol=0)
    # the choice in CUDA graphs: the same values on replay after new logits are copied in
    static, b = logits.cuda().clone(), bias.cuda()
    route_topk(static, b, 8, norm=True, scaling=2.5)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gw, gids = route_topk(static, b, 8, norm=True, scaling=2.5)
    static.copy_(-logits.cuda())
    graph.replay()
    w2, ids2 = route_topk_ref(-logits.cuda(), b, 8, norm=True, scaling=2.5)
    assert torch.equal(gids, ids2)
    torch.testing.assert_close(gw, w2, rtol=1e-6, atol=0)
