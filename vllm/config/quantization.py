"""Weight quantisation: which format the engine holds a checkpoint's weights in.

FP8 block scaling (DeepSeek-V3 / upstream vLLM's "fp8" with ``weight_block_size``): every linear
and routed expert e4m3 with one fp32 scale per 128 × 128 tile; norms, the router, embeddings,
lm_head and the indexer's fp32 ``weights_proj`` stay in their dtype. An FP8 checkpoint is detected
from ``config.json``'s ``quantization_config``; ``--quantization fp8`` (upstream's flag) also
quantises a bf16/fp32 checkpoint tensor by tensor as it loads.
"""

from __future__ import annotations

from dataclasses import replace

from vllm.config.arch import ModelArch

QUANTIZATION_METHODS = ("fp8",)
FP8_WEIGHT_BLOCK = (128, 128)
# what a checkpoint quantised at load is held as (upstream's dynamic block FP8)
FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(FP8_WEIGHT_BLOCK),
}


def resolve_quantization(arch: ModelArch, quantization: str | None) -> ModelArch:
    """The architecture as the engine holds the weights: ``arch`` itself for a full-precision
    checkpoint without ``--quantization``, else with an FP8 ``quantization_config`` of 128 × 128
    blocks. Raises ValueError naming ``--quantization`` or the ``quantization_config`` field."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"--quantization {quantization!r} is not supported: this engine holds weights in "
            f"full precision or as block-scaled FP8 (--quantization fp8)"
        )
    q = arch.quantization_config
    if q:
        method = q.get("quant_method")
        if method != "fp8":
            raise ValueError(
                f"config.json quantization_config.quant_method {method!r} is not supported "
                "(only block-scaled fp8)"
            )
        block = q.get("weight_block_size")
        if block is None or [int(b) for b in block] != list(FP8_WEIGHT_BLOCK):
            raise ValueError(
                f"config.json quantization_config.weight_block_size {block} is not supported: "
                f"FP8 weights need 128 × 128 blocks ([128, 128]); per-tensor or per-channel FP8 "
                "checkpoints are not"
            )
        return arch
    if quantization == "fp8":
        return replace(arch, quantization_config=dict(FP8_QUANTIZATION_CONFIG))
    return arch
