"""The built-in tiny checkpoint: the GLM-5.3 architecture at toy size, written as a real HF folder
(config.json, safetensors, tokenizer.json, tokenizer_config.json with a chat template).

    vllm tiny-checkpoint DIR [--fp8]     # write it
    vllm tiny-checkpoint DIR --slice [--fp8]   # the GLM-5.3-shaped slice (GPU tests, benchmarks)
    vllm serve                           # serves it (written once under $VLLM_CACHE_ROOT)
"""

from vllm.model_executor.tiny.checkpoint import (  # noqa: F401
    GLM_SLICE,
    TINY_CONFIG,
    default_tiny_path,
    ensure_tiny_checkpoint,
    slice_config,
    tiny_state_dict,
    write_checkpoint,
    write_slice_checkpoint,
    write_tiny_checkpoint,
)
