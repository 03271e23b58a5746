"""One `VllmConfig` of typed sub-configs, validated once at construction.

Errors name the CLI flag. Derived values are properties, never patched in later. Components
below the engine receive only the sub-config (or fields) they need.
"""

from vllm.config.compilation import CompilationConfig  # noqa: F401
from vllm.config.vllm_config import (  # noqa: F401
    AttentionConfig,
    CacheConfig,
    HiSparseConfig,
    KVTransferConfig,
    ModelConfig,
    OffloadConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
