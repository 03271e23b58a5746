"""The router GEMM on the tensor cores (``vllm/kernels/router.py``).

CPU: the bf16 terms sum exactly to the fp32 weight (one term for a bf16-valued weight, three at
most, none for non-finite or too small values), the reference GEMM (the CPU's path) equals the
fp32 GEMM bit for bit, and the router keeps its fp32 weight where the fast GEMM is not available.
GPU: the tensor-core logits against the fp32 GEMM (relative 1e-5: summation order only; the
measured gap is 2-8e-6), the same routing through the model's ``Router``, a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from vllm.config.arch import ModelArch
from vllm.kernels.router import (
    fp32_out_mm_available,
    router_logits,
    router_logits_ref,
    split_bf16_terms,
)
from vllm.model_executor.models.glm_moe_dsa import Router
from vllm.model_executor.tiny import TINY_CONFIG


def _weight(e, h, seed, scale=0.02):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, h, generator=g) * scale


def _sum(terms, n):
    return terms.float().view(n, terms.shape[0] // n, -1).sum(0)


# ---- CPU ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [0.02, 1e3, 1e-20, 1e30])
def test_terms_sum_exactly(scale):
    """Random fp32 weights over many magnitudes take three terms whose fp32 sum is the weight
    bit for bit."""
    w = _weight(16, 256, seed=1, scale=scale)
    terms = split_bf16_terms(w)
    assert terms is not None and terms.dtype == torch.bfloat16
    n = terms.shape[0] // 16
    assert 2 <= n <= 3  # random fp32 values need more than bf16's 8 bits
    assert torch.equal(_sum(terms, n), w)


def test_bf16_valued_weight_takes_one_term():
    w = _weight(8, 128, seed=2).bfloat16().float()
    terms = split_bf16_terms(w)
    assert terms.shape == (8, 128) and torch.equal(terms.float(), w)


def test_no_terms_for_non_finite_or_tiny_values():
    """inf - inf is nan: the rest never vanishes. Low bits below bf16's smallest subnormal
    (2^-133) cannot be a term: the router keeps its fp32 GEMM."""
    w = _weight(4, 64, seed=3)
    w[1, 2] = float("inf")
    assert split_bf16_terms(w) is None
    assert split_bf16_terms(_weight(4, 64, seed=3, scale=1e-36)) is None
    with pytest.raises(ValueError, match="fp32"):
        split_bf16_terms(w.bfloat16())


def test_reference_is_the_fp32_gemm():
    w = _weight(32, 256, seed=4)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    terms = split_bf16_terms(w)
    got = router_logits_ref(x, terms, terms.shape[0] // 32)
    assert torch.equal(got, torch.nn.functional.linear(x.float(), w))
    assert torch.equal(router_logits(x, terms, terms.shape[0] // 32), got)  # the CPU's path


def test_router_keeps_fp32_weight_on_cpu():
    arch = ModelArch.from_dict(TINY_CONFIG)
    r = Router(arch, torch.bfloat16)
    r.weight.data.copy_(_weight(*r.weight.shape, seed=6))
    before = r.weight.detach().clone()
    assert not fp32_out_mm_available(torch.device("cpu"))
    r.process_weights_after_loading()
    assert r.num_terms == 0 and torch.equal(r.weight, before)


def test_router_with_terms_routes_as_fp32():
    """A router holding terms (as after loading on CUDA) routes as its fp32 weight did; on the
    CPU through the reference GEMM, so exactly."""
    arch = ModelArch.from_dict(TINY_CONFIG)
    r = Router(arch, torch.bfloat16)
    r.weight.data.copy_(_weight(*r.weight.shape, seed=8, scale=1.0))
    x = torch.randn(6, arch.hidden_size, generator=torch.Generator().manual_seed(9)).bfloat16()
    want = r(x)
    terms = split_bf16_terms(r.weight.data)
    r.num_terms, r.weight = terms.shape[0] // arch.n_routed_experts, torch.nn.Parameter(terms)
    got = r(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---- GPU ---------------------------------------------------------------------------------------
needs_mm = pytest.mark.skipif(
    not torch.cuda.is_available() or not fp32_out_mm_available(torch.device("cuda")),
    reason="needs CUDA and torch.mm(..., out_dtype=torch.float32)",
)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.gpu
@needs_mm
@pytest.mark.parametrize("n", [1, 64, 256, 1000])
def test_logits_against_fp32_gemm_gpu(n):
    """GLM-5.3's router shape (E 256, H 6144), fresh inputs each size."""
    w = _weight(256, 6144, seed=n).cuda()
    x = torch.randn(n, 6144, device="cuda").bfloat16()
    terms = split_bf16_terms(w)
    k = terms.shape[0] // 256
    got = router_logits(x, terms, k)
    want = torch.nn.functional.linear(x.float(), w)
    assert got.dtype == torch.float32 and got.shape == (n, 256)
    assert _rel(got, want) < 1e-5
    one = router_logits(x, w.bfloat16(), 1)  # the weight rounded to bf16: visibly further
    assert _rel(one, want) > 10 * _rel(got, want)


@pytest.mark.gpu
@needs_mm
def test_router_module_and_graph_gpu():
    """The model's Router on CUDA in bf16: its weight becomes three exact terms, routing equals
    the fp32 GEMM's (same experts; weights within 1e-5), and the step replays in a graph."""
    arch = ModelArch.from_dict(TINY_CONFIG)
    with torch.device("cuda"):
        r = Router(arch, torch.bfloat16)
    w = _weight(*r.weight.shape, seed=7, scale=1.0).cuda()
    r.weight.data.copy_(w)
    r.e_score_correction_bias.data.copy_(0.05 * torch.randn(arch.n_routed_experts))
    x = torch.randn(48, arch.hidden_size, device="cuda").bfloat16()
    want_w, want_ids = r(x)
    r.process_weights_after_loading()
    assert r.num_terms in (2, 3) and r.weight.dtype == torch.bfloat16
    assert torch.equal(_sum(r.weight, r.num_terms), w)
    got_w, got_ids = r(x)
    assert torch.equal(got_ids, want_ids)
    assert (got_w - want_w).abs().max().item() < 1e-5
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gw, gi = r(x)
    x2 = torch.randn_like(x)
    x.copy_(x2)
    graph.replay()
    ew, ei = r(x2)
    assert torch.equal(gi, ei) and torch.equal(gw, ew)


@pytest.mark.gpu
@needs_mm
def test_loaded_model_routers_hold_terms_gpu(tmp_path):
    """Loading a bf16 model on CUDA turns every router (MTP's included) into exact terms."""
    from vllm.model_executor.model_loader import build_model
    from vllm.model_executor.tiny import tiny_state_dict, write_checkpoint

    write_checkpoint(
        str(tmp_path), TINY_CONFIG, tiny_state_dict(TINY_CONFIG, seed=2), tokenizer=False
    )
    routers = [m for m in build_model(str(tmp_path), dtype=torch.bfloat16, device="cuda").modules()
               if isinstance(m, Router)]  # fmt: skip
    assert routers and all(r.num_terms > 0 and r.weight.dtype == torch.bfloat16 for r in routers)
