"""Random weights in place of a checkpoint: upstream's ``--load-format dummy``.

For timing an architecture without its weights (a GLM-5.3-dimensioned slice, or the whole model
on enough GPUs): every parameter is drawn on its own device, scaled as a trained model's are
roughly scaled, so that activations stay of order one, routing spreads over the experts and the
indexer's scores are distinct (degenerate weights would send the top-k down its tie path and
time something a real model never runs):

- linear weights [out, in] and expert weights [E, out, in]: N(0, 1/in); the lm_head 3/√in (as the
  built-in tiny checkpoint's, for logits of a few units);
- FP8 ones (an FP8 config, or ``--quantization fp8``): the same values quantised to e4m3 with
  128 × 128 block scales (:func:`quant_block_fp8`), a row band (an expert) at a time so the fp32
  temporary stays small;
- embeddings N(0, 1); norm weights 1 + 0.1·N(0, 1); biases 0.1·N(0, 1).

Outputs are meaningless; the shapes, dtypes, bytes and kernels are the real model's.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.kv_cache_interface import FP8_DTYPE
from vllm.model_executor.layers.linear import Linear, quant_block_fp8

_BAND = 4096  # rows quantised at a time


def _normal(shape, g, std: float, device) -> torch.Tensor:
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32) * std


def _fill_fp8(weight: torch.Tensor, scale: torch.Tensor, block, g, std: float) -> None:
    """weight e4m3 [N, K] and its scales [ceil(N/bn), ceil(K/bk)] from N(0, std²) values."""
    n, k = weight.shape
    bn = block[0]
    band = max(bn, _BAND // bn * bn)
    for r0 in range(0, n, band):
        r1 = min(n, r0 + band)
        q, s = quant_block_fp8(_normal((r1 - r0, k), g, std, weight.device), block)
        weight[r0:r1].copy_(q)
        scale[r0 // bn : r0 // bn + s.shape[0]].copy_(s)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter of ``model`` (before ``process_weights_after_loading``) in place."""
    from vllm.model_executor.models.glm_moe_dsa import Experts

    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    done: set[int] = set()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Linear) and m.weight.dtype == FP8_DTYPE:
                std = m.weight.shape[1] ** -0.5
                _fill_fp8(m.weight, m.weight_scale_inv, m.block, g, std)
                done.update((id(m.weight), id(m.weight_scale_inv)))
            elif isinstance(m, Experts):
                std13, std2 = m.w13_weight.shape[2] ** -0.5, m.w2_weight.shape[2] ** -0.5
                for e in range(m.w13_weight.shape[0]):
                    if m.block is None:
                        m.w13_weight[e].copy_(_normal(m.w13_weight.shape[1:], g, std13, dev))
                        m.w2_weight[e].copy_(_normal(m.w2_weight.shape[1:], g, std2, dev))
                        continue
                    # gate's row blocks, then up's: each half quantised on its own
                    inter = m.w13_weight.shape[1] // 2
                    half = m.w13_weight_scale_inv.shape[1] // 2
                    for part in range(2):
                        rows = slice(part * inter, (part + 1) * inter)
                        srows = slice(part * half, (part + 1) * half)
                        _fill_fp8(m.w13_weight[e, rows], m.w13_weight_scale_inv[e, srows],
                                  m.block, g, std13)  # fmt: skip
                    _fill_fp8(m.w2_weight[e], m.w2_weight_scale_inv[e], m.block, g, std2)
                for p in (m.w13_weight, m.w2_weight, m.w13_weight_scale_inv, m.w2_weight_scale_inv):
                    if p is not None:
                        done.add(id(p))
        for name, p in model.named_parameters():
            if id(p) in done:
                continue
            if p.dtype == FP8_DTYPE:
                raise TypeError(f"dummy weights: no rule for the e4m3 parameter {name}")
            leaf = name.rsplit(".", 1)[-1]
            if p.dim() == 1:
                v = _normal(p.shape, g, 0.1, dev) + (1.0 if leaf == "weight" else 0.0)
            elif "embed_tokens" in name:
                v = _normal(p.shape, g, 1.0, dev)
            elif name.startswith("lm_head"):
                v = _normal(p.shape, g, 3.0 * p.shape[-1] ** -0.5, dev)
            else:  # [out, in], or [E, out, in]
                v = _normal(p.shape, g, p.shape[-1] ** -0.5, dev)
            p.copy_(v.to(p.dtype))
