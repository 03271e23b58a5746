"""Engine arguments: one dataclass whose fields are upstream vLLM's flag names.

`vllm serve` and `LLM(**kwargs)` both go through `EngineArgs.create_engine_config()`, which
validates everything once and names the offending flag.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

import torch

from vllm.config import (
    AttentionConfig,
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    OffloadConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.config.arch import ModelArch
from vllm.config.compilation import CompilationConfig
from vllm.config.flags import parse_json_flag
from vllm.config.vllm_config import DeviceConfig, resolve_dtype

DEFAULT_MODEL = "tiny-glm-5.3"
# CPU has no device memory to measure: KV capacity defaults to this unless --kv-cache-memory-bytes.
CPU_DEFAULT_KV_BYTES = 512 * 2**20
CPU_DEFAULT_MAX_MODEL_LEN = 32768  # without --max-model-len on CPU


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    served_model_name: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    load_format: str = "auto"
    hf_overrides: str | dict | None = None
    seed: int = 0
    max_model_len: int | None = None
    max_logprobs: int = 20
    device: str = "auto"
    # parallelism
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    dcp_comm_backend: str = "ag_rs"
    cp_kv_cache_interleave_size: int = 1
    enable_expert_parallel: bool = False
    # cache
    block_size: int = 64
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    # scheduler
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False
    stream_interval: int = 1
    # features
    attention_config: str | dict | None = None
    speculative_config: str | dict | None = None
    kv_transfer_config: str | dict | None = None
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    enforce_eager: bool = False
    compilation_config: str | dict | None = None

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        return cls(model=model, **kwargs)

    def resolve_model_path(self) -> str:
        if self.model in (None, "", DEFAULT_MODEL):
            from vllm.model_executor.tiny import ensure_tiny_checkpoint

            return ensure_tiny_checkpoint()
        if self.model == DEFAULT_MODEL + "-fp8":
            from vllm.model_executor.tiny import ensure_tiny_checkpoint

            return ensure_tiny_checkpoint(fp8=True)
        path = os.path.expanduser(self.model)
        if not os.path.isdir(path):
            raise ValueError(
                f"model {self.model!r}: no such folder (this engine loads local HF checkpoint folders)"
            )
        return path

    def _check_async_scheduling(self) -> None:
        """--async-scheduling with what it does not support yet: a start-up error naming both."""
        if self.speculative_config is not None:
            raise ValueError("--async-scheduling is not supported with --speculative-config yet")

    def create_engine_config(self) -> VllmConfig:
        path = self.resolve_model_path()
        from vllm.model_executor.model_loader import LOAD_FORMATS

        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"--load-format {self.load_format!r} is not supported: one of "
                f"{', '.join(LOAD_FORMATS)}"
            )
        arch = ModelArch.from_pretrained(path, parse_json_flag(self.hf_overrides, "--hf-overrides"))
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        dtype = resolve_dtype(self.dtype, arch, device)
        max_len = self.max_model_len
        if max_len is None:
            max_len = min(arch.max_position_embeddings, 1 << 20)
            if device == "cpu":  # prefill is quadratic: 32K tokens take ~20 s on 2 cores
                max_len = min(max_len, CPU_DEFAULT_MAX_MODEL_LEN)
        name = self.served_model_name or (
            DEFAULT_MODEL if self.model in (None, "", DEFAULT_MODEL) else self.model
        )
        tok = self.tokenizer or path
        model_cfg = ModelConfig(
            model=path,
            tokenizer=tok,
            served_model_name=name,
            arch=arch,
            dtype=dtype,
            quantization=self.quantization,
            load_format=self.load_format,
            max_model_len=max_len,
            skip_tokenizer_init=self.skip_tokenizer_init,
            seed=self.seed,
            max_logprobs=self.max_logprobs,
        )
        kv_bytes = self.kv_cache_memory_bytes
        if kv_bytes is None and device == "cpu":
            kv_bytes = CPU_DEFAULT_KV_BYTES
        cache = CacheConfig(
            block_size=self.block_size,
            cache_dtype=self.kv_cache_dtype,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_bytes,
            enable_prefix_caching=self.enable_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
        )
        parallel = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            prefill_context_parallel_size=self.prefill_context_parallel_size,
            decode_context_parallel_size=self.decode_context_parallel_size,
            dcp_comm_backend=self.dcp_comm_backend,
            cp_kv_cache_interleave_size=self.cp_kv_cache_interleave_size,
            enable_expert_parallel=self.enable_expert_parallel,
        )
        mnbt = self.max_num_batched_tokens or (
            default_max_num_batched_tokens(device) if self.enable_chunked_prefill else max_len
        )
        sched = SchedulerConfig(
            max_num_batched_tokens=mnbt,
            max_num_seqs=self.max_num_seqs,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            async_scheduling=self.async_scheduling,
            stream_interval=self.stream_interval,
        )
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if self.async_scheduling:
            self._check_async_scheduling()
        if self.kv_offloading_size is not None and self.kv_offloading_size < 0:
            raise ValueError("--kv-offloading-size must be >= 0 (GiB)")
        return VllmConfig(
            model_config=model_cfg,
            cache_config=cache,
            parallel_config=parallel,
            scheduler_config=sched,
            attention_config=AttentionConfig.from_json(self.attention_config),
            device_config=DeviceConfig(device=device),
            speculative_config=SpeculativeConfig.from_json(self.speculative_config),
            kv_transfer_config=KVTransferConfig.from_json(self.kv_transfer_config),
            offload_config=OffloadConfig(
                kv_offloading_size_gib=self.kv_offloading_size,
                kv_offloading_backend=self.kv_offloading_backend,
            ),
            compilation_config=CompilationConfig.from_json(
                self.compilation_config,
                # graphs are a CUDA feature: a CPU run is eager unless the flag is given, and
                # then runs the graphs' static-buffer decode path uncaptured (tests use it)
                enforce_eager=self.enforce_eager
                or (device != "cuda" and self.compilation_config is None),
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=mnbt,
            ),
        )


def _bool_flag(p, name: str, default: bool, help: str) -> None:
    p.add_argument(name, action=argparse.BooleanOptionalAction, default=default, help=help)


def add_engine_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = EngineArgs()
    g = p.add_argument_group("model")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    g.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="serve without a tokenizer: token-id prompts only",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="model name in the API (default: the model argument)",
    )
    g.add_argument(
        "--dtype",
        default=d.dtype,
        help="auto (checkpoint dtype on CUDA, float32 on CPU), bfloat16, float32",
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="fp8: hold linears and routed experts as e4m3 with 128x128 block scales, "
        "quantising a bf16/fp32 checkpoint as it loads (FP8 checkpoints are detected from "
        "config.json's quantization_config)",
    )
    g.add_argument(
        "--load-format",
        default=d.load_format,
        help="auto or safetensors: the checkpoint's weights; dummy: random weights of the "
        "config's shapes, nothing read (for timing an architecture without its weights)",
    )
    g.add_argument(
        "--hf-overrides",
        default=None,
        help="JSON merged over the model's config.json, e.g. '{\"num_hidden_layers\": 4}' "
        "(per-layer lists are cut to a smaller depth)",
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt + output, in tokens"
    )
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs)
    g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        default=False,
        help="run every step eagerly: no CUDA graphs",
    )
    g.add_argument(
        "--compilation-config",
        "-cc",
        default=None,
        help="CUDA graphs: full graphs of decode steps and piecewise graphs of the other forwards, "
        'e.g. \'{"cudagraph_mode": "FULL_AND_PIECEWISE", "cudagraph_capture_sizes": [1, 2, 4, 8], '
        '"piecewise_capture_sizes": [512, 1024, 2048]}\' (default on CUDA; CPU runs are eager)',
    )
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    g.add_argument(
        "--prefill-context-parallel-size",
        "-pcp",
        type=int,
        default=1,
        help="split each prompt's queries across N ranks by token (load-balanced V pattern)",
    )
    g.add_argument(
        "--decode-context-parallel-size",
        "-dcp",
        type=int,
        default=1,
        help="split the KV cache across N ranks by token, round-robin (reuses PCP/TP ranks)",
    )
    g.add_argument("--dcp-comm-backend", default=d.dcp_comm_backend, choices=["ag_rs", "a2a"])
    g.add_argument(
        "--cp-kv-cache-interleave-size", type=int, default=1, help="tokens per DCP round-robin unit"
    )
    g.add_argument(
        "--enable-expert-parallel",
        "-ep",
        action="store_true",
        help="split MoE experts across ranks",
    )
    g = p.add_argument_group("KV cache")
    g.add_argument("--block-size", type=int, default=d.block_size, help="must be 64")
    g.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=["auto", "fp8_ds_mla", "fp8", "fp8_e4m3"],
    )
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help=f"KV cache bytes per rank (CPU default: {CPU_DEFAULT_KV_BYTES >> 20} MiB)",
    )
    _bool_flag(p, "--enable-prefix-caching", True, "reuse cached KV of shared prompt prefixes")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        help="GiB of host memory for a tier of evicted prefix-cache KV blocks (the replica's "
        "total, split over its ranks)",
    )
    g.add_argument(
        "--kv-offloading-backend",
        choices=["native", "lmcache"],
        default="native",
        help="the host KV tier's implementation (native: this engine's own)",
    )
    g = p.add_argument_group("scheduler")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per step (default with chunked prefill: 8192 on a GPU of >= 70 GiB, "
        "else 2048, as upstream's vllm serve)",
    )
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=d.long_prefill_token_threshold,
        help="most prompt tokens one request computes per step (0: no cap; requests waiting "
        "for a seat always get room next to a running prefill)",
    )
    _bool_flag(p, "--enable-chunked-prefill", True, "split long prompts across steps")
    _bool_flag(
        p,
        "--async-scheduling",
        False,
        "schedule each step while the previous one runs (the host's scheduling and output "
        "processing overlap the GPU's step; a finished request is computed one step more)",
    )
    g.add_argument(
        "--stream-interval",
        type=int,
        default=d.stream_interval,
        help="tokens per streamed chunk: the first token is sent at once, then a chunk every "
        "N tokens and the rest at the end (1: every token; larger values cut the API server's "
        "writes per token at high concurrency)",
    )
    g = p.add_argument_group("features (JSON)")
    g.add_argument(
        "--attention-config",
        default=None,
        help='e.g. \'{"sparse_mla_force_mqa": true, "hisparse_config": {"host_pool_gib": 48}}\'',
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        help='e.g. \'{"method":"mtp","num_speculative_tokens":3}\'',
    )
    g.add_argument(
        "--kv-transfer-config",
        default=None,
        help='e.g. \'{"kv_connector":"NixlConnector","kv_role":"kv_both"}\'',
    )
    return p


def default_max_num_batched_tokens(device: str) -> int:
    """The step budget when --max-num-batched-tokens is not given (chunked prefill): upstream's
    for ``vllm serve``: 8192 on GPUs of at least 70 GiB (H100, H200), else 2048. On an H100,
    the GLM-5.3-shaped slice serving 2K-token prompts at concurrency 64 gives 7,601 output
    tokens/s at 8192 against 4,381 at 2048 (BENCHMARKS.md): fewer, larger prefill steps. The
    LLM class takes it too (upstream's takes 16384 there)."""
    if device == "cuda" and torch.cuda.is_available():
        if torch.cuda.get_device_properties(0).total_memory >= 70 * 2**30:
            return 8192
    return 2048


__all__ = ["EngineArgs", "add_engine_args", "DEFAULT_MODEL"]
