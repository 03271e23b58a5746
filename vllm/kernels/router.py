"""The MoE router's GEMM on the tensor cores: logits = x · Wᵀ in fp32, for bf16 activations x [N, H]
and an fp32 router weight W [E, H] (the checkpoint's dtype; HF computes the logits in fp32).

cuBLAS runs an fp32 GEMM of this shape on the SIMT units (H 6144, E 256, H100: 20.1 µs at N = 64,
36.1 at 256). Every fp32 W is exactly the sum of at most three bf16 terms (round to bf16, subtract,
repeat: each term takes the next 8 of fp32's 24 significand bits, and each subtraction is exact),
and a bf16 × bf16 product is exact in fp32. So Σ_i x · T_iᵀ, accumulated in fp32 on the tensor
cores (``torch.mm(..., out_dtype=torch.float32)``, one GEMM over the stacked terms), is the fp32
GEMM up to summation order: 10.9 / 14.3 µs, the same top-8 on every row measured. A bf16-valued
W (a checkpoint whose router is stored in bf16) takes one term. Upstream vLLM instead keeps the
router weight in the model dtype (W rounded to bf16), which this path equals for such a W.
"""

from __future__ import annotations

import functools

import torch

MAX_TERMS = 3


def split_bf16_terms(w: torch.Tensor, max_terms: int = MAX_TERMS) -> torch.Tensor | None:
    """fp32 w [E, H] -> bf16 [n·E, H]: the fewest terms (n ≤ max_terms) whose fp32 sum is w
    exactly, stacked term by term; None if max_terms do not reach w (only for values whose low
    bits fall below bf16's subnormal range)."""
    if w.dtype != torch.float32 or w.dim() != 2:
        raise ValueError(f"split_bf16_terms: fp32 [E, H] expected, got {w.dtype} {tuple(w.shape)}")
    terms, rest = [], w
    for _ in range(max_terms):
        t = rest.to(torch.bfloat16)
        terms.append(t)
        rest = rest - t.float()  # exact: t is rest rounded to its leading 8 bits
        if not bool(rest.any()):
            return torch.cat(terms)
    return None


def router_logits(x: torch.Tensor, terms: torch.Tensor, num_terms: int) -> torch.Tensor:
    """x [N, H], terms bf16 [num_terms·E, H] (:func:`split_bf16_terms`) -> fp32 [N, E]. For bf16 x
    where ``torch.mm`` takes an fp32 output dtype (CUDA): one tensor-core GEMM over the stacked
    terms, their logits summed; otherwise :func:`router_logits_ref`."""
    if x.dtype != torch.bfloat16 or not fp32_out_mm_available(x.device):
        return router_logits_ref(x, terms, num_terms)
    y = torch.mm(x, terms.t(), out_dtype=torch.float32)
    if num_terms == 1:
        return y
    return y.view(x.shape[0], num_terms, -1).sum(1)


def router_logits_ref(x: torch.Tensor, terms: torch.Tensor, num_terms: int) -> torch.Tensor:
    """The reference of :func:`router_logits`: the fp32 GEMM with the weight the terms sum to."""
    e = terms.shape[0] // num_terms
    w = terms.float().view(num_terms, e, -1).sum(0)
    return torch.nn.functional.linear(x.float(), w)


@functools.cache
def fp32_out_mm_available(device: torch.device) -> bool:
    """Whether ``torch.mm`` takes ``out_dtype=torch.float32`` for bf16 inputs on ``device``
    (CUDA with torch ≥ 2.8; not on the CPU)."""
    if device.type != "cuda":
        return False
    try:
        a = torch.ones(1, 8, dtype=torch.bfloat16, device=device)
        return torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False
