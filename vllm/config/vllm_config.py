from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch

from vllm.config.arch import ModelArch
from vllm.config.compilation import CompilationConfig
from vllm.config.flags import parse_json_flag
from vllm.config.kv_transfer import KVTransferConfig  # noqa: F401  (re-exported)
from vllm.config.speculative import SpeculativeConfig

BLOCK_SIZE = 64  # tokens per physical KV block (the cache layouts assume it)

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "half": torch.float16,
    "float": torch.float32,
}


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str
    served_model_name: str
    arch: ModelArch
    dtype: torch.dtype
    max_model_len: int
    skip_tokenizer_init: bool = False
    seed: int = 0
    max_logprobs: int = 20
    quantization: str | None = None  # --quantization: None (the checkpoint's format) or "fp8"
    load_format: str = "auto"  # --load-format: "dummy" for random weights

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = BLOCK_SIZE
    cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    dcp_comm_backend: str = "ag_rs"
    cp_kv_cache_interleave_size: int = 1
    enable_expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        """Ranks of one engine replica: PP × PCP × TP (DCP reuses them)."""
        return (
            self.pipeline_parallel_size
            * self.prefill_context_parallel_size
            * self.tensor_parallel_size
        )

    @property
    def world_size_across_dp(self) -> int:
        return self.world_size * self.data_parallel_size

    def validate(self) -> None:
        tp, pp, dp = self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size
        pcp, dcp = self.prefill_context_parallel_size, self.decode_context_parallel_size
        for name, v in (
            ("--tensor-parallel-size", tp),
            ("--pipeline-parallel-size", pp),
            ("--data-parallel-size", dp),
            ("--prefill-context-parallel-size", pcp),
            ("--decode-context-parallel-size", dcp),
            ("--cp-kv-cache-interleave-size", self.cp_kv_cache_interleave_size),
        ):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if pp != 1:
            raise ValueError(
                "--pipeline-parallel-size > 1 is not supported yet (PP keeps its place in the rank layout)"
            )
        if self.dcp_comm_backend not in ("ag_rs", "a2a"):
            raise ValueError(
                f"--dcp-comm-backend must be ag_rs or a2a, got {self.dcp_comm_backend!r}"
            )
        if pcp > 1:
            if dcp not in (1, pcp, tp * pcp):
                raise ValueError(
                    f"--decode-context-parallel-size {dcp} with --prefill-context-parallel-size {pcp} "
                    f"and --tensor-parallel-size {tp}: DCP must be 1, PCP ({pcp}) or TP×PCP ({tp * pcp})"
                )
        elif tp % dcp:
            raise ValueError(
                f"--decode-context-parallel-size {dcp} must divide --tensor-parallel-size {tp} "
                "(DCP reuses TP ranks; with --prefill-context-parallel-size > 1 it may also span PCP ranks)"
            )

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the routed experts are split over with --enable-expert-parallel: DP × PCP × TP."""
        if not self.enable_expert_parallel:
            return 1
        return (
            self.data_parallel_size * self.prefill_context_parallel_size * self.tensor_parallel_size
        )

    def validate_for_model(self, arch: ModelArch) -> None:
        """The model's heads, intermediates and experts split evenly across the requested ranks
        (checked here, before any worker starts)."""
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        splits = [
            ("attention heads", arch.num_attention_heads),
            ("indexer heads", arch.index_n_heads),
            ("dense MLP intermediate_size", arch.intermediate_size),
            ("shared-expert intermediate size", arch.moe_intermediate_size * arch.n_shared_experts),
        ]
        if not self.enable_expert_parallel:  # routed experts are then TP-sharded like the MLPs
            splits.append(("moe_intermediate_size", arch.moe_intermediate_size))
        for what, n in splits:
            if n % tp:
                raise ValueError(
                    f"--tensor-parallel-size {tp} does not divide the model's {n} {what}"
                )
        if arch.n_routed_experts % ep:
            raise ValueError(
                f"--enable-expert-parallel splits the {arch.n_routed_experts} routed experts over "
                f"{ep} ranks (--data-parallel-size × --prefill-context-parallel-size × "
                "--tensor-parallel-size), which does not divide them"
            )


@dataclass(frozen=True)
class HiSparseConfig:
    host_pool_gib: float = 0.0
    hot_buffer_rows: int | None = None  # default 2×topk per request ((n_spec+2)×topk with MTP)


@dataclass(frozen=True)
class AttentionConfig:
    sparse_mla_force_mqa: bool = False
    hisparse: HiSparseConfig | None = None

    @classmethod
    def from_json(cls, value) -> AttentionConfig:
        raw = parse_json_flag(value, "--attention-config")
        known = {"sparse_mla_force_mqa", "hisparse_config"}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(
                f"--attention-config: unknown keys {sorted(unknown)} (known: {sorted(known)})"
            )
        hs = raw.get("hisparse_config")
        hisparse = None
        if hs is not None:
            if not isinstance(hs, dict):
                raise ValueError("--attention-config hisparse_config must be an object")
            bad = set(hs) - {"host_pool_gib", "hot_buffer_rows"}
            if bad:
                raise ValueError(f"--attention-config hisparse_config: unknown keys {sorted(bad)}")
            hisparse = HiSparseConfig(**hs)
        return cls(
            sparse_mla_force_mqa=bool(raw.get("sparse_mla_force_mqa", False)), hisparse=hisparse
        )


KV_OFFLOADING_BACKENDS = ("native",)


@dataclass(frozen=True)
class OffloadConfig:
    """``--kv-offloading-size`` / ``--kv-offloading-backend`` (upstream's names): a host-memory
    tier of whole KV blocks keyed by the prefix cache's hashes. The size is the engine replica's
    total over its ranks (upstream's meaning); each rank holds ``size / ranks``."""

    kv_offloading_size_gib: float | None = None
    kv_offloading_backend: str = "native"

    @property
    def enabled(self) -> bool:
        return bool(self.kv_offloading_size_gib)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # per-request prompt tokens per step (0: no cap)
    # schedule step N + 1 while step N runs (its sampled tokens stay on the device)
    async_scheduling: bool = False
    # streamed responses carry this many tokens a chunk (the first token and the last chunk
    # at once): fewer writes per token for the API server at high concurrency
    stream_interval: int = 1


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"  # "cpu" | "cuda"


@dataclass(frozen=True)
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    parallel_config: ParallelConfig
    scheduler_config: SchedulerConfig
    attention_config: AttentionConfig
    device_config: DeviceConfig
    speculative_config: SpeculativeConfig | None = None
    kv_transfer_config: KVTransferConfig | None = None
    offload_config: OffloadConfig = field(default_factory=OffloadConfig)
    compilation_config: CompilationConfig = field(
        default_factory=lambda: CompilationConfig(cudagraph_mode="NONE")
    )

    def __post_init__(self) -> None:
        self.validate()

    @property
    def scheduler_block_size(self) -> int:
        """Tokens per scheduler block: a DCP "virtual block" holds 64 tokens on each DCP rank."""
        return self.cache_config.block_size * self.parallel_config.decode_context_parallel_size

    @property
    def hot_buffer_min_rows(self) -> int:
        return (self.num_spec_tokens + 1) * self.model_config.arch.index_topk

    @property
    def hot_buffer_rows(self) -> int:
        """Hot rows per request: default 2×topk ((n_spec+2)×topk with MTP)."""
        hs = self.attention_config.hisparse
        if hs is not None and hs.hot_buffer_rows:
            return hs.hot_buffer_rows
        return (self.num_spec_tokens + 2) * self.model_config.arch.index_topk

    @property
    def uses_kv_connector(self) -> bool:
        """A KV connector runs: --kv-transfer-config, the offload tier's, or both."""
        return self.kv_transfer_config is not None or self.offload_num_blocks > 0

    @property
    def hisparse_host_pool_gib(self) -> float:
        """HiSparse's pinned pool per rank. --kv-offloading-size adds its share to it: HiSparse
        already backs every completed page up there and keeps it, keyed by block hash, as the
        prefix cache, so the offload tier is the same pool (one pinned budget, no second copy
        of each page)."""
        hs = self.attention_config.hisparse
        extra = 0.0
        if self.offload_config.enabled:
            extra = self.offload_config.kv_offloading_size_gib / self.parallel_config.world_size
        return (hs.host_pool_gib if hs is not None else 0.0) + extra

    @property
    def num_spec_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    def validate(self) -> None:
        pc, sc, cc = self.parallel_config, self.scheduler_config, self.cache_config
        from vllm.kv_cache_interface import normalize_cache_dtype

        pc.validate()
        pc.validate_for_model(self.model_config.arch)
        from vllm.config.quantization import resolve_quantization

        resolve_quantization(self.model_config.arch, self.model_config.quantization)
        self._check_devices()
        normalize_cache_dtype(cc.cache_dtype)
        if cc.block_size != BLOCK_SIZE:
            raise ValueError(
                f"--block-size must be {BLOCK_SIZE} for sparse MLA, got {cc.block_size}"
            )
        if not 0 < cc.gpu_memory_utilization <= 1:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1], got {cc.gpu_memory_utilization}"
            )
        if sc.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {sc.max_num_seqs}")
        if sc.long_prefill_token_threshold < 0:
            raise ValueError(
                f"--long-prefill-token-threshold must be >= 0, got {sc.long_prefill_token_threshold}"
            )
        if sc.max_num_batched_tokens < 1:
            raise ValueError(
                f"--max-num-batched-tokens must be >= 1, got {sc.max_num_batched_tokens}"
            )
        if (
            not sc.enable_chunked_prefill
            and sc.max_num_batched_tokens < self.model_config.max_model_len
        ):
            raise ValueError(
                f"--max-num-batched-tokens ({sc.max_num_batched_tokens}) must be >= --max-model-len "
                f"({self.model_config.max_model_len}) when chunked prefill is disabled"
            )
        if self.model_config.max_model_len < 1:
            raise ValueError("--max-model-len must be >= 1")
        if self.model_config.max_model_len > self.model_config.arch.max_position_embeddings:
            raise ValueError(
                f"--max-model-len {self.model_config.max_model_len} exceeds the model's "
                f"max_position_embeddings {self.model_config.arch.max_position_embeddings}"
            )
        hs = self.attention_config.hisparse
        if hs is not None:
            if hs.host_pool_gib <= 0:
                raise ValueError("--attention-config hisparse_config.host_pool_gib must be > 0")
            if pc.prefill_context_parallel_size > 1 or pc.decode_context_parallel_size > 1:
                raise ValueError(
                    "--attention-config hisparse_config is a decode-side feature for TP/DP/EP layouts; "
                    "it cannot be combined with --prefill-context-parallel-size or "
                    "--decode-context-parallel-size > 1"
                )
            if hs.hot_buffer_rows is not None and hs.hot_buffer_rows < self.hot_buffer_min_rows:
                raise ValueError(
                    f"--attention-config hisparse_config.hot_buffer_rows must be >= "
                    f"{self.hot_buffer_min_rows} ((num_speculative_tokens + 1) × index_topk)"
                )
        self._check_speculative()
        self._check_offload()
        self._check_hisparse_host_memory()
        self._refuse_unlanded()

    def _check_hisparse_host_memory(self) -> None:
        """HiSparse pins its host pool on every rank of this host at start-up: refuse a pool the
        host cannot hold instead of an OOM kill while pinning."""
        if self.attention_config.hisparse is None:
            return
        avail = available_host_memory()
        ranks = self.parallel_config.world_size_across_dp
        need = self.hisparse_host_pool_gib * ranks
        if avail is not None and need * 2**30 > avail:
            raise ValueError(
                f"--attention-config hisparse_config.host_pool_gib: {self.hisparse_host_pool_gib:.2f} "
                f"GiB per rank (with --kv-offloading-size's share) × {ranks} rank(s) needs "
                f"{need:.1f} GiB of host memory; this host has {avail / 2**30:.1f} GiB available"
            )

    def _check_offload(self) -> None:
        """--kv-offloading-size: a host tier of prefix-cache blocks, so it needs the prefix cache
        and room for at least one block on every rank."""
        oc = self.offload_config
        if oc.kv_offloading_backend not in KV_OFFLOADING_BACKENDS:
            raise ValueError(
                f"--kv-offloading-backend must be one of {list(KV_OFFLOADING_BACKENDS)}, got "
                f"{oc.kv_offloading_backend!r} (lmcache is not bundled with this engine)"
            )
        if oc.kv_offloading_size_gib is None:
            return
        size = oc.kv_offloading_size_gib
        if isinstance(size, bool) or not isinstance(size, (int, float)) or size < 0:
            raise ValueError(f"--kv-offloading-size must be a number of GiB >= 0, got {size!r}")
        if not oc.enabled:
            return
        if not self.cache_config.enable_prefix_caching:
            raise ValueError(
                "--kv-offloading-size keeps prefix-cache blocks in host memory: it needs prefix "
                "caching (drop --no-enable-prefix-caching)"
            )
        avail = available_host_memory()
        need = size * self.parallel_config.data_parallel_size  # every replica on this host
        if avail is not None and need * 2**30 > avail:
            raise ValueError(
                f"--kv-offloading-size {size} GiB per replica × {self.parallel_config.data_parallel_size} "
                f"replica(s) needs {need:.1f} GiB of host memory; this host has "
                f"{avail / 2**30:.1f} GiB available"
            )
        if self.attention_config.hisparse is not None:
            return  # the tier is HiSparse's own host pool, grown by the size (hisparse_host_pool_gib)
        if self.offload_num_blocks < 1:
            from vllm.kv_cache_interface import kv_bytes_per_token

            mc = self.model_config
            block = self.cache_config.block_size * kv_bytes_per_token(
                mc.arch, self.cache_config.cache_dtype, mc.dtype, self._num_mtp_layers
            )
            raise ValueError(
                f"--kv-offloading-size {size} GiB holds no KV block: it is split over "
                f"{self.parallel_config.world_size} ranks and one block takes {block / 2**20:.2f} "
                "MiB on each"
            )

    @property
    def _num_mtp_layers(self) -> int:
        return self.model_config.arch.num_nextn_predict_layers if self.speculative_config else 0

    @property
    def offload_num_blocks(self) -> int:
        """Blocks the host tier holds on each rank (every rank holds the same ones)."""
        from vllm.kv_cache_interface import kv_bytes_per_token

        if not self.offload_config.enabled or self.attention_config.hisparse is not None:
            return 0
        mc = self.model_config
        per_block = self.cache_config.block_size * kv_bytes_per_token(
            mc.arch, self.cache_config.cache_dtype, mc.dtype, self._num_mtp_layers
        )
        per_rank = (
            self.offload_config.kv_offloading_size_gib * 2**30 / self.parallel_config.world_size
        )
        return int(per_rank // per_block)

    def _check_speculative(self) -> None:
        """MTP needs the checkpoint's MTP layer; combinations not built yet are named."""
        spec = self.speculative_config
        if spec is None:
            return
        if self.model_config.arch.num_nextn_predict_layers == 0:
            raise ValueError(
                f"--speculative-config method 'mtp': the checkpoint {self.model_config.model} has "
                "no MTP layer (num_nextn_predict_layers = 0 in its config.json)"
            )

    def _check_devices(self) -> None:
        """One GPU per rank: more ranks than this machine's GPUs would share devices."""
        if self.device_config.device != "cuda":
            return
        ranks, gpus = self.parallel_config.world_size_across_dp, torch.cuda.device_count()
        if gpus == 0:
            why = "torch has no CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise ValueError(f"--device cuda: {why} on this machine (use --device cpu)")
        if ranks > gpus:
            raise ValueError(
                f"{ranks} ranks (--data-parallel-size × --prefill-context-parallel-size × "
                f"--tensor-parallel-size) need {ranks} GPUs; this machine has {gpus}"
            )

    def _refuse_unlanded(self) -> None:
        """Flags whose features have not landed yet fail here, saying so; none is ignored."""
        not_yet = []
        kvt = self.kv_transfer_config
        if kvt is not None and self.attention_config.hisparse is not None and kvt.is_kv_producer:
            not_yet.append(
                f"--kv-transfer-config kv_role {kvt.kv_role!r} with --attention-config "
                "hisparse_config (a HiSparse engine receives KV into its host pool: use kv_role "
                "'kv_consumer'; sending from the host pool is not built)"
            )
        if not_yet:
            raise NotImplementedError("not implemented yet in this engine: " + "; ".join(not_yet))

    def with_(self, **kw) -> VllmConfig:
        return replace(self, **kw)


def resolve_dtype(name: str, arch: ModelArch, device: str) -> torch.dtype:
    """`auto` = the checkpoint dtype on CUDA, float32 on CPU (exact, and fast without AMX)."""
    if name == "auto":
        if device == "cpu":
            return torch.float32
        return _DTYPES.get(arch.torch_dtype, torch.bfloat16)
    if name not in _DTYPES:
        raise ValueError(f"--dtype must be auto, bfloat16, float16 or float32, got {name!r}")
    return _DTYPES[name]


def available_host_memory() -> int | None:
    """Bytes of host memory available now (Linux ``MemAvailable``), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def env_flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("0", "", "false", "False")
