"""Capacity and cost model for a sparse-MLA deployment (`vllm plan`), SPEC §3–§6 and §10.

Pure functions of a `ModelArch`, a `Hardware` description and a `Layout` (DP/TP/PCP/DCP sizes,
HiSparse on or off). Byte accounting goes through `kv_bytes_per_token` / `KVCacheLayout`, the
same functions the scheduler uses; nothing here allocates memory or touches a device.

Formulas (GLM-5.3 numbers in brackets; d = kv_lora_rank + rope = 576, r = kv_lora_rank = 512):

* KV per token = layers·mla_row + full_layers·indexer_key + mtp·(mla_row + indexer_key)
  [78·656 + 21·132 + 788 = 54,728 B]. Under DCP N a rank stores one token in N.
* Sparse-MLA FLOP/byte, per query on one GPU (the seed's footnote 1): each of the k selected rows
  costs `2·(d + r)` FLOPs per head (QK over d, PV over r) [2176], and the GPU reads the row plus
  its 4-byte int32 index [660 B] once for all its heads, and each head's bf16 query (d) and output
  (r) once [2·(576 + 512) = 2176 B]:
      flop/B = k·h·2(d+r) / (k·(row + 4) + h·2(d+r))
  [h=8: 35.7 MFLOP / 1.37 MB = 26.0; h=64: 285 MFLOP / 1.49 MB = 191.3].
* Indexer/sparse-MLA crossover, per GPU, for a causal prefill from scratch of L tokens: query t
  scores t+1 keys at `2·index_heads·index_dim` FLOPs each [8192] on every "full" layer [21], and
  attends to min(t+1, k) rows at `2·(d+r)·h` FLOPs on every layer [78]. Under TP the indexer is
  replicated (each GPU runs all index heads for all queries) while MLA heads are split (h = H/TP);
  under PCP both are split by token, so the token split cancels and only h matters. The crossover
  is the L where Σ_t (t+1)·c_I = Σ_t min(t+1, k)·c_M, i.e. (c_I/2)·L² = c_M·(k·L − k²/2); its
  large-L limit is L ≈ 2·k·c_M/c_I (mean context L/2) [c_M/c_I = 78·2176·h / (21·8192):
  h=8 → 31,271 (32,329 in the limit), h=64 → 257,606 (258,633); the seed says ~32K and ~256K].
* All-gathers, bytes each rank receives per layer (ring/NVSwitch: (N−1)/N of the total):
  PCP: the prefill chunk's new rows (mla_row, + indexer_key on full layers); DCP prefill: the
  temporary full copy of the context (same row sizes); DCP decode (`ag_rs`): bf16 absorbed queries
  (d) and partial outputs (r) per head, the fp32 LSE of every other rank, and on full layers the
  (fp32 score, int32 position) top-k candidates of every other rank. Time = bytes / link bandwidth
  (bandwidth term only; small decode messages are latency-bound in practice).
* Weights per GPU (`vllm.model_executor.weight_bytes`, the function the worker checks at start-up):
  the model's parameters under the layout's TP and EP, FP8 (e4m3 + one fp32 scale per 128×128
  tile for linears and routed experts) or bf16 [FP8, EP8, attention replicated: routed experts
  725 GB / 8 = 90.6 GB + 22.0 GB of the rest = 112.6 GB = 104.9 GiB]. It fits when
  usable HBM × gpu_memory_utilization − weights − the worker's 4 GiB reserve leaves room for KV
  [139 GiB × 0.9 − 104.9 − 4 = 16.2 GiB].
* HiSparse (SPEC §6): the host pool holds each request's MLA rows (its shard under DCP); the GPU
  keeps the indexer keys of the whole context plus a hot buffer of (n_spec + 2)·k rows per MLA
  layer ((2·k) without MTP), not divided by DCP (conservative).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, replace

import torch

from vllm.config.arch import GLM_5_3, ModelArch
from vllm.config.quantization import resolve_quantization
from vllm.kv_cache_interface import BLOCK_SIZE, KVCacheLayout, cdiv, kv_bytes_per_token
from vllm.model_executor.weight_bytes import WeightBytes, weight_bytes_per_rank

GiB = 1 << 30
GB = 1e9
INDEX_BYTES = 4  # int32 position of a selected row, read with it by the sparse kernel
LSE_BYTES = 4  # fp32 log-sum-exp per head
CANDIDATE_BYTES = 8  # fp32 score + int32 global position, per DCP top-k candidate
ACT_BYTES = 2  # bf16 queries / outputs on the wire and in HBM
BUILTIN_MODELS = {"glm-5.3": GLM_5_3, "glm5.3": GLM_5_3, "glm_5_3": GLM_5_3}
# the seed's decode (DP8 + EP8) and prefill (PCP8 × DCP8 × EP8) deployments, and TP8 / PCP8
DEFAULT_LAYOUTS = ("DP8xEP8", "TP8", "PCP8xEP8", "PCP8xDCP8xEP8")
ACTIVATION_RESERVE_GIB = 4.0  # the worker's fixed reserve (VLLM_CUDA_ACTIVATION_RESERVE_GIB)


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links. Defaults: H200 SXM (SPEC §10; "measured" = one H200, torch 2.11)."""

    name: str = "H200 SXM"
    hbm_gb: float = 141.0
    hbm_gib_usable: float = 139.0  # what one H200 leaves a process after the CUDA context
    kv_gib_per_gpu: float = 15.0  # HBM left for KV once GLM-5.3 weights are loaded (seed)
    host_gib_per_gpu: float = 256.0  # assumed 2 TiB host memory per 8-GPU node
    hbm_tbs: float = 4.21  # measured device-to-device copy; datasheet 4.8
    hbm_tbs_datasheet: float = 4.8
    bf16_tflops: float = 779.0  # measured 8192^3 matmul
    bf16_tflops_datasheet: float = 989.0
    fp8_tflops: float = 1357.0  # measured torch._scaled_mm
    nvlink_gbs: float = 450.0  # each way
    pcie_gbs: float = 55.0  # pinned host<->device, measured 55.3

    @property
    def ridge_flop_per_byte(self) -> float:
        """BF16 ridge point on the datasheet (989 / 4.8 = 206), the seed's reference."""
        return self.bf16_tflops_datasheet / self.hbm_tbs_datasheet

    @property
    def ridge_flop_per_byte_measured(self) -> float:
        return self.bf16_tflops / self.hbm_tbs


H200 = Hardware()


# ---- inputs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """One deployment of `dp` replicas of `tp·pcp` GPUs each; DCP reuses a replica's TP/PCP ranks;
    EP (--enable-expert-parallel) splits the routed experts over every GPU, so ep is 1 or dp·tp·pcp."""

    dp: int = 1
    tp: int = 1
    pcp: int = 1
    dcp: int = 1
    ep: int = 1
    hisparse: bool = False

    @property
    def num_gpus(self) -> int:
        return self.dp * self.tp * self.pcp

    @property
    def name(self) -> str:
        parts = [f"{a.upper()}{n}" for a, n in self._axes() if n > 1] or ["TP1"]
        return "x".join(parts) + ("+HS" if self.hisparse else "")

    def _axes(self) -> tuple[tuple[str, int], ...]:
        return (
            ("dp", self.dp),
            ("tp", self.tp),
            ("pcp", self.pcp),
            ("dcp", self.dcp),
            ("ep", self.ep),
        )

    def check_ep(self) -> None:
        if self.ep not in (1, self.num_gpus):
            raise ValueError(
                f"EP{self.ep} must span every GPU of the layout (DP·TP·PCP = {self.num_gpus}): "
                "--enable-expert-parallel splits the experts over all of them"
            )

    def validate(self, arch: ModelArch) -> None:
        for axis, n in self._axes():
            if n < 1:
                raise ValueError(f"{axis.upper()} size must be >= 1, got {n}")
        if arch.num_attention_heads % self.tp:
            raise ValueError(
                f"TP{self.tp} does not divide the model's {arch.num_attention_heads} heads"
            )
        group = self.tp * self.pcp
        if group % self.dcp:
            raise ValueError(
                f"DCP{self.dcp} reuses the TP/PCP ranks of one replica, so it must divide "
                f"TP·PCP = {group} (e.g. PCP8xDCP8)"
            )
        self.check_ep()
        if self.ep > 1 and arch.n_routed_experts % self.ep:
            raise ValueError(f"EP{self.ep} does not divide the {arch.n_routed_experts} experts")


_AXIS_RE = re.compile(r"^(dp|tp|pcp|dcp|ep)(\d+)$")


def parse_layout(text: str) -> Layout:
    """'DP8', 'TP8', 'PCP8', 'PCP8xDCP8', 'DP8xEP8' (also '×' or '*'), optional '+HS' suffix."""
    s = text.strip().lower().replace("×", "x").replace("*", "x").replace(" ", "")
    hisparse = False
    for suffix in ("+hisparse", "+hs"):
        if s.endswith(suffix):
            s, hisparse = s[: -len(suffix)], True
            break
    sizes: dict[str, int] = {}
    for part in s.split("x") if s else []:
        m = _AXIS_RE.match(part)
        if m is None:
            raise ValueError(
                f"bad layout {text!r}: expected terms like DP8, TP8, PCP8, DCP8, EP8 joined by 'x', "
                f"optionally ending in '+HS' (e.g. PCP8xDCP8+HS), got term {part!r}"
            )
        if m.group(1) in sizes:
            raise ValueError(f"bad layout {text!r}: {m.group(1).upper()} given twice")
        sizes[m.group(1)] = int(m.group(2))
    if not sizes:
        raise ValueError(f"bad layout {text!r}: empty")
    layout = Layout(hisparse=hisparse, **sizes)
    try:
        layout.check_ep()
    except ValueError as e:
        raise ValueError(f"bad layout {text!r}: {e}") from None
    return layout


_SUFFIX = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_tokens(text: str | int) -> int:
    """Token counts with binary suffixes: '128K' = 131,072, '1M' = 1,048,576; plain ints too."""
    s = str(text).strip().lower().replace(",", "").replace("_", "")
    mult = _SUFFIX.get(s[-1:], 1)
    num = s[:-1] if mult > 1 else s
    try:
        value = float(num) * mult
    except ValueError:
        raise ValueError(f"bad token count {text!r}: use e.g. 131072, 128K or 1M") from None
    if value <= 0 or value != int(value):
        raise ValueError(f"bad token count {text!r}: must be a positive whole number")
    return int(value)


def load_arch(model: str) -> tuple[str, ModelArch]:
    """A built-in name ('glm-5.3') or a folder holding config.json -> (display name, ModelArch)."""
    builtin = BUILTIN_MODELS.get(model.strip().lower())
    if builtin is not None:
        return "glm-5.3 (built-in)", ModelArch.from_dict(builtin)
    if not os.path.isdir(model):
        raise FileNotFoundError(
            f"model folder {model!r} not found: give a folder holding config.json, or 'glm-5.3'"
        )
    return model, ModelArch.from_pretrained(model)


@dataclass(frozen=True)
class PlanInputs:
    context_tokens: int = 131072
    prefill_chunk_tokens: int = 2048
    decode_batch: int = 64  # requests per decode step per replica
    cache_dtype: str = "fp8_ds_mla"
    mtp: bool = True
    num_speculative_tokens: int = 3
    host_pool_gib: float = 48.0  # HiSparse pinned pool per GPU
    link_gbs: float = H200.nvlink_gbs
    gpu_memory_utilization: float = 0.9  # the engine's default


# ---- byte accounting ---------------------------------------------------------------------------
def _model_dtype(arch: ModelArch) -> torch.dtype:
    dt = getattr(torch, arch.torch_dtype, None)
    return dt if isinstance(dt, torch.dtype) else torch.bfloat16


def cache_layout(arch: ModelArch, cache_dtype: str) -> KVCacheLayout:
    return KVCacheLayout.from_arch(arch, cache_dtype, _model_dtype(arch))


def num_mtp_layers(arch: ModelArch, mtp: bool) -> int:
    return arch.num_nextn_predict_layers if mtp else 0


def token_bytes(arch: ModelArch, cache_dtype: str, mtp: bool) -> int:
    """KV bytes per token across the whole model (MTP layer included when on)."""
    return kv_bytes_per_token(arch, cache_dtype, _model_dtype(arch), num_mtp_layers(arch, mtp))


def request_kv_bytes(
    arch: ModelArch, num_tokens: int, cache_dtype: str, mtp: bool, dcp: int = 1
) -> int:
    """HBM one request of `num_tokens` holds on one rank: DCP ranks own ceil(L / 64N) blocks."""
    blocks = cdiv(num_tokens, BLOCK_SIZE * dcp)
    return blocks * BLOCK_SIZE * token_bytes(arch, cache_dtype, mtp)


# ---- weights -----------------------------------------------------------------------------------
def layout_weights(arch: ModelArch, layout: Layout, weights: str, mtp: bool) -> WeightBytes:
    """Weights one GPU of ``layout`` holds (rank 0 of its TP group), ``weights`` "fp8" (linears
    and routed experts e4m3 with 128×128 block scales, the rest bf16) or "bf16"."""
    held = replace(arch, quantization_config=None)
    if weights == "fp8":
        held = resolve_quantization(held, "fp8")
    return weight_bytes_per_rank(
        held,
        torch.bfloat16,
        tp_size=layout.tp,
        ep_size=layout.ep if layout.ep > 1 else None,
        num_mtp=num_mtp_layers(arch, mtp),
    )


def kv_room_gib(weights: WeightBytes, hw: Hardware, inputs: PlanInputs) -> float:
    """HBM one GPU has left for the KV cache (and activations beyond the reserve) after its
    weights: usable × gpu_memory_utilization − weights − the worker's fixed reserve."""
    usable = hw.hbm_gib_usable * inputs.gpu_memory_utilization
    return usable - weights.total / GiB - ACTIVATION_RESERVE_GIB


# ---- compute model -----------------------------------------------------------------------------
def mla_flops_per_row_head(arch: ModelArch) -> int:
    """QK over kv_lora_rank + rope, PV over kv_lora_rank: 2·(576 + 512) = 2176 for GLM-5.3."""
    return 2 * (arch.mla_dim + arch.kv_lora_rank)


def indexer_flops_per_key(arch: ModelArch) -> int:
    """One query scoring one key: 2 · index_heads · index_dim = 8192 (head weighting ignored)."""
    return 2 * arch.index_n_heads * arch.index_head_dim


def sparse_mla_flop_per_byte(
    arch: ModelArch, heads: int, cache_dtype: str = "fp8_ds_mla", rows: int | None = None
) -> float:
    """FLOP per HBM byte of sparse-MLA attention for one query on one GPU (module docstring)."""
    rows = arch.index_topk if rows is None else rows
    per_head = mla_flops_per_row_head(arch)
    flops = rows * heads * per_head
    row_bytes = cache_layout(arch, cache_dtype).mla_bytes_per_token + INDEX_BYTES
    qo_bytes = heads * ACT_BYTES * (arch.mla_dim + arch.kv_lora_rank)
    return flops / (rows * row_bytes + qo_bytes)


def causal_prefill_flops(arch: ModelArch, num_tokens: int, heads: int) -> tuple[float, float]:
    """(indexer, sparse MLA) FLOPs one GPU spends on a from-scratch prefill of `num_tokens`,
    per query it owns, averaged over the causal prompt. Indexer replicated (TP) or split by token
    (PCP) alike: per owned query it scores every earlier key with all index heads."""
    n, k = num_tokens, arch.index_topk
    mean_keys = (n + 1) / 2
    mean_rows = (min(n, k) * (min(n, k) + 1) / 2 + max(n - k, 0) * k) / n
    idx = arch.num_full_layers * indexer_flops_per_key(arch) * mean_keys
    mla = arch.num_hidden_layers * mla_flops_per_row_head(arch) * heads * mean_rows
    return idx, mla


def indexer_crossover_tokens(arch: ModelArch, heads: int) -> int:
    """Smallest prompt length where the indexer's prefill FLOPs pass sparse MLA's on one GPU
    holding `heads` attention heads. Solves (c_I/2)·L² = c_M·(k·L − k²/2) for L > k."""
    c_i = arch.num_full_layers * indexer_flops_per_key(arch)
    c_m = arch.num_hidden_layers * mla_flops_per_row_head(arch) * heads
    k = arch.index_topk
    if c_i == 0:
        return 0  # no indexer: never crosses
    a = c_m * k / c_i
    if a <= k:  # already crossed within the dense (L <= k) region: c_I·L/2 vs c_M·L/2
        return 1 if c_i >= c_m else k
    return math.ceil(a + math.sqrt(a * a - a * k))


# ---- communication -----------------------------------------------------------------------------
def _ring(n: int) -> float:
    return (n - 1) / n


def layer_row_bytes(arch: ModelArch, cache_dtype: str) -> tuple[int, int]:
    """(full layer, shared layer) bytes per token moved by KV all-gathers: MLA row (+ indexer key)."""
    lay = cache_layout(arch, cache_dtype)
    return lay.mla_bytes_per_token + lay.indexer_bytes_per_token, lay.mla_bytes_per_token


def pcp_allgather_bytes(
    arch: ModelArch, chunk_tokens: int, pcp: int, cache_dtype: str
) -> tuple[float, float]:
    """Bytes a PCP rank receives per (full, shared) layer: the chunk's new rows from the others."""
    full, shared = layer_row_bytes(arch, cache_dtype)
    f = chunk_tokens * _ring(pcp)
    return f * full, f * shared


def dcp_prefill_allgather_bytes(
    arch: ModelArch, context_tokens: int, dcp: int, cache_dtype: str
) -> tuple[float, float]:
    """Bytes a DCP rank receives per (full, shared) layer to build the temporary full context."""
    full, shared = layer_row_bytes(arch, cache_dtype)
    f = context_tokens * _ring(dcp)
    return f * full, f * shared


def dcp_decode_bytes(
    arch: ModelArch, num_queries: int, dcp: int, heads: int
) -> tuple[float, float]:
    """Bytes a DCP rank receives per (full, shared) layer for `num_queries` decode queries (ag_rs):
    all-gathered bf16 queries and reduce-scattered bf16 partial outputs for `heads` heads, every
    other rank's fp32 LSE, and on full layers every other rank's top-k (score, position) list."""
    qo = _ring(dcp) * heads * ACT_BYTES * (arch.mla_dim + arch.kv_lora_rank)
    lse = (dcp - 1) * heads * LSE_BYTES
    cand = (dcp - 1) * arch.index_topk * CANDIDATE_BYTES
    shared = num_queries * (qo + lse)
    return shared + num_queries * cand, shared


def per_model(arch: ModelArch, full: float, shared: float, mtp_layers: int) -> float:
    """Sum a (full layer, shared layer) figure over the model; MTP layers have an indexer."""
    n_full = arch.num_full_layers + mtp_layers
    return n_full * full + (arch.num_hidden_layers - arch.num_full_layers) * shared


# ---- the plan ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayoutPlan:
    layout: str
    num_gpus: int
    replicas: int
    heads_per_gpu: int
    hisparse: bool
    kv_bytes_per_token_per_gpu: float
    request_kv_gib_per_gpu: float  # at context_tokens
    weights_fp8_gib: float  # per GPU
    weights_fp8_by_kind_gib: dict[str, float]
    weights_bf16_gib: float
    kv_room_fp8_gib: float  # HBM left for KV after the weights (kv_room_gib)
    kv_room_bf16_gib: float
    fits_fp8: bool  # weights + reserve fit the usable HBM
    fits_bf16: bool
    max_context_tokens: int  # longest request that fits, capped at max_position_embeddings
    max_context_fit_tokens: int  # uncapped memory limit
    max_context_limited_by: str  # "hbm" | "host pool" | "max_position"
    concurrency: int  # requests of context_tokens the whole deployment holds
    flop_per_byte_prefill: float  # sparse MLA, all top-k rows, heads per GPU
    flop_per_byte_decode: float  # DCP: top-k / N rows per rank, heads after the query gather
    indexer_crossover_tokens: int
    pcp_allgather_mb_per_layer: float  # full layer, per prefill chunk
    pcp_allgather_ms_per_chunk: float  # whole model
    dcp_prefill_allgather_mb_per_layer: float  # full layer, context_tokens of context
    dcp_prefill_allgather_ms_per_chunk: float
    dcp_decode_mb_per_layer: float  # full layer, one decode step
    dcp_decode_ms_per_step: float


def _hisparse_capacity(arch: ModelArch, inputs: PlanInputs, dcp: int) -> tuple[float, float, float]:
    """(host bytes per token per rank, GPU bytes per token per rank, fixed GPU bytes per request)."""
    lay = cache_layout(arch, inputs.cache_dtype)
    n_mtp = num_mtp_layers(arch, inputs.mtp)
    mla_layers = arch.num_hidden_layers + n_mtp
    host_per_token = mla_layers * lay.mla_bytes_per_token / dcp
    gpu_per_token = (arch.num_full_layers + n_mtp) * lay.indexer_bytes_per_token / dcp
    hot_rows = ((inputs.num_speculative_tokens if inputs.mtp else 0) + 2) * arch.index_topk
    return host_per_token, gpu_per_token, hot_rows * mla_layers * lay.mla_bytes_per_token


def _capacity(
    arch: ModelArch, layout: Layout, hw: Hardware, inputs: PlanInputs
) -> tuple[int, str, int]:
    """(max context that fits, what limits it, concurrency per replica at context_tokens)."""
    kv_bytes = hw.kv_gib_per_gpu * GiB
    L, dcp = inputs.context_tokens, layout.dcp
    if not layout.hisparse:
        blocks = int(kv_bytes // (BLOCK_SIZE * token_bytes(arch, inputs.cache_dtype, inputs.mtp)))
        per_req = cdiv(L, BLOCK_SIZE * dcp)
        return blocks * BLOCK_SIZE * dcp, "hbm", blocks // per_req
    host_tok, gpu_tok, hot = _hisparse_capacity(arch, inputs, dcp)
    pool = inputs.host_pool_gib * GiB
    fit_host = int(pool // host_tok)
    fit_gpu = int((kv_bytes - hot) // gpu_tok) if kv_bytes > hot else 0
    fit, by = (fit_host, "host pool") if fit_host <= fit_gpu else (fit_gpu, "hbm")
    conc = min(int(pool // (L * host_tok)), int(kv_bytes // (hot + L * gpu_tok)))
    return fit, by, conc


def plan_layout(arch: ModelArch, layout: Layout, hw: Hardware, inputs: PlanInputs) -> LayoutPlan:
    layout.validate(arch)
    heads = arch.num_attention_heads // layout.tp
    decode_heads = min(arch.num_attention_heads, heads * layout.dcp)
    fit, by, conc = _capacity(arch, layout, hw, inputs)
    cap = arch.max_position_embeddings
    n_mtp = num_mtp_layers(arch, inputs.mtp)
    link = inputs.link_gbs * GB
    L, chunk, dcp = inputs.context_tokens, inputs.prefill_chunk_tokens, layout.dcp
    pcp_f, pcp_s = pcp_allgather_bytes(arch, chunk, layout.pcp, inputs.cache_dtype)
    dpf_f, dpf_s = dcp_prefill_allgather_bytes(arch, L, dcp, inputs.cache_dtype)
    queries = inputs.decode_batch * (1 + (inputs.num_speculative_tokens if inputs.mtp else 0))
    dd_f, dd_s = dcp_decode_bytes(arch, queries, dcp, decode_heads)
    ms = lambda f, s: 1e3 * per_model(arch, f, s, n_mtp) / link
    w8 = layout_weights(arch, layout, "fp8", inputs.mtp)
    w16 = layout_weights(arch, layout, "bf16", inputs.mtp)
    room8, room16 = kv_room_gib(w8, hw, inputs), kv_room_gib(w16, hw, inputs)
    return LayoutPlan(
        layout=layout.name,
        num_gpus=layout.num_gpus,
        replicas=layout.dp,
        heads_per_gpu=heads,
        hisparse=layout.hisparse,
        kv_bytes_per_token_per_gpu=token_bytes(arch, inputs.cache_dtype, inputs.mtp) / dcp,
        request_kv_gib_per_gpu=request_kv_bytes(arch, L, inputs.cache_dtype, inputs.mtp, dcp) / GiB,
        weights_fp8_gib=w8.total / GiB,
        weights_fp8_by_kind_gib={k: v / GiB for k, v in w8.by_kind.items()},
        weights_bf16_gib=w16.total / GiB,
        kv_room_fp8_gib=room8,
        kv_room_bf16_gib=room16,
        fits_fp8=room8 > 0,
        fits_bf16=room16 > 0,
        max_context_tokens=min(fit, cap),
        max_context_fit_tokens=fit,
        max_context_limited_by=by if fit < cap else "max_position",
        concurrency=layout.dp * conc,
        flop_per_byte_prefill=sparse_mla_flop_per_byte(arch, heads, inputs.cache_dtype),
        flop_per_byte_decode=sparse_mla_flop_per_byte(
            arch, decode_heads, inputs.cache_dtype, rows=cdiv(arch.index_topk, dcp)
        ),
        indexer_crossover_tokens=indexer_crossover_tokens(arch, heads),
        pcp_allgather_mb_per_layer=pcp_f / 1e6,
        pcp_allgather_ms_per_chunk=ms(pcp_f, pcp_s),
        dcp_prefill_allgather_mb_per_layer=dpf_f / 1e6,
        dcp_prefill_allgather_ms_per_chunk=ms(dpf_f, dpf_s),
        dcp_decode_mb_per_layer=dd_f / 1e6 if dcp > 1 else 0.0,
        dcp_decode_ms_per_step=ms(dd_f, dd_s) if dcp > 1 else 0.0,
    )


def make_plan(
    arch: ModelArch,
    layouts: list[Layout],
    hw: Hardware = H200,
    inputs: PlanInputs | None = None,
    model_name: str = "",
) -> dict:
    """The whole report as plain data (what `vllm plan --json` prints)."""
    inputs = inputs or PlanInputs()
    if inputs.mtp and arch.num_nextn_predict_layers == 0:
        raise ValueError("--mtp: the model has no MTP layer (num_nextn_predict_layers = 0)")
    if inputs.context_tokens > arch.max_position_embeddings:
        raise ValueError(
            f"--context {inputs.context_tokens} exceeds the model's max_position_embeddings "
            f"{arch.max_position_embeddings}"
        )
    if any(lay.hisparse for lay in layouts) and inputs.host_pool_gib > hw.host_gib_per_gpu:
        raise ValueError(
            f"--host-pool-gib {inputs.host_pool_gib} exceeds the host memory per GPU "
            f"({hw.host_gib_per_gpu} GiB, --host-mem-gib)"
        )
    if not 0 < inputs.gpu_memory_utilization <= 1:
        raise ValueError(
            f"--gpu-memory-utilization must be in (0, 1], got {inputs.gpu_memory_utilization}"
        )
    lay = cache_layout(arch, inputs.cache_dtype)
    per_token = token_bytes(arch, inputs.cache_dtype, inputs.mtp)
    whole = {
        w: layout_weights(arch, Layout(), w, inputs.mtp).by_kind for w in ("fp8", "bf16")
    }  # the whole model: one GPU without TP or EP
    return {
        "model": model_name,
        "arch": {
            "num_layers": arch.num_hidden_layers,
            "num_full_indexer_layers": arch.num_full_layers,
            "num_mtp_layers": num_mtp_layers(arch, inputs.mtp),
            "num_attention_heads": arch.num_attention_heads,
            "index_topk": arch.index_topk,
            "max_position_embeddings": arch.max_position_embeddings,
        },
        "hardware": asdict(hw)
        | {
            "ridge_flop_per_byte": hw.ridge_flop_per_byte,
            "ridge_flop_per_byte_measured": hw.ridge_flop_per_byte_measured,
        },
        "inputs": asdict(inputs),
        "mla_row_bytes": lay.mla_bytes_per_token,
        "indexer_key_bytes": lay.indexer_bytes_per_token,
        "kv_bytes_per_token": per_token,
        "request_kv_gib": per_token * inputs.context_tokens / GiB,
        "weights_gb": {w: {k: v / GB for k, v in by.items()} for w, by in whole.items()},
        "layouts": [asdict(plan_layout(arch, x, hw, inputs)) for x in layouts],
    }
