"""The model architecture, read from a checkpoint's `config.json` (HF `model_type: glm_moe_dsa`).

`ModelArch` is the single parsed view of the architecture that every component below the engine
reads: the model, the KV cache layout, the byte accounting, the planner. It accepts the field
spellings real checkpoints use (`rope_parameters` or `rope_theta`, `indexer_types` or
`index_topk_freq`/`index_skip_topk_offset` or `index_topk_pattern`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields

SUPPORTED_ARCHITECTURES = ("GlmMoeDsaForCausalLM",)
SUPPORTED_MODEL_TYPES = ("glm_moe_dsa",)


# config.json fields with one entry per layer (cut by --hf-overrides that shorten the model)
PER_LAYER_KEYS = ("mlp_layer_types", "indexer_types", "index_topk_pattern")


def indexer_types_from(num_layers: int, raw: dict) -> tuple[str, ...]:
    """Per-layer indexer mode: "full" runs the indexer, "shared" reuses the previous full layer's top-k.

    Priority: explicit `indexer_types`, then `index_topk_pattern` ("FSSF..."), then the
    `index_topk_freq` / `index_skip_topk_offset` schedule: layer i is full iff
    `max(i - offset + 1, 0) % freq == 0`. With neither given every layer is full.
    """
    if raw.get("indexer_types") is not None:
        types = tuple(raw["indexer_types"])
    elif raw.get("index_topk_pattern") is not None:
        pattern = raw["index_topk_pattern"]
        if isinstance(pattern, str):
            try:
                types = tuple({"F": "full", "S": "shared"}[c] for c in pattern)
            except KeyError as e:
                raise ValueError(
                    f"index_topk_pattern may hold only 'F' and 'S', got {pattern!r}"
                ) from e
        else:
            types = tuple(pattern)
    else:
        freq = max(int(raw.get("index_topk_freq", 1)), 1)
        offset = int(raw.get("index_skip_topk_offset", 2))
        types = tuple(
            "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)
        )
    if len(types) != num_layers:
        raise ValueError(f"indexer_types has {len(types)} entries for {num_layers} layers")
    bad = [t for t in types if t not in ("full", "shared")]
    if bad:
        raise ValueError(f"indexer_types entries must be 'full' or 'shared', got {bad[0]!r}")
    if types and types[0] != "full":
        raise ValueError(
            "indexer_types[0] must be 'full': a shared layer needs an earlier full layer"
        )
    return types


@dataclass(frozen=True)
class ModelArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_types: tuple[str, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_interleave: bool = True
    indexer_rope_interleave: bool = True
    num_nextn_predict_layers: int = 0
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    # {"quant_method": "fp8", "weight_block_size": [128, 128], ...} or None
    quantization_config: dict | None = field(default=None, hash=False, compare=False)

    # ---- derived ------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_dim(self) -> int:
        """Width of one latent KV row: c_kv plus the shared rope key (576 for GLM-5.3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    @property
    def num_full_layers(self) -> int:
        return len(self.full_layers)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    @property
    def is_fp8_checkpoint(self) -> bool:
        q = self.quantization_config
        return bool(q) and q.get("quant_method") == "fp8"

    @property
    def fp8_block_size(self) -> tuple[int, int]:
        q = self.quantization_config or {}
        bs = q.get("weight_block_size") or [128, 128]
        return int(bs[0]), int(bs[1])

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict) -> ModelArch:
        mt = raw.get("model_type")
        archs = raw.get("architectures") or []
        if mt not in SUPPORTED_MODEL_TYPES and not set(archs) & set(SUPPORTED_ARCHITECTURES):
            raise ValueError(
                f"unsupported model: model_type={mt!r} architectures={archs}; this engine serves "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (model_type glm_moe_dsa)"
            )
        num_layers = int(raw["num_hidden_layers"])
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope type {rope_type!r} is not supported (only 'default')")
        rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        if raw.get("q_lora_rank") is None:
            raise ValueError("q_lora_rank must be set: the indexer reads the q LoRA latent")
        eos = raw.get("eos_token_id")
        eos = () if eos is None else (tuple(eos) if isinstance(eos, list) else (int(eos),))
        mlp_types = raw.get("mlp_layer_types")
        first_dense = int(raw.get("first_k_dense_replace", 0))
        if mlp_types is not None:
            n_dense = sum(1 for t in mlp_types if t == "dense")
            if list(mlp_types) != ["dense"] * n_dense + ["sparse"] * (num_layers - n_dense):
                raise ValueError("mlp_layer_types must be dense layers first, then sparse")
            first_dense = n_dense
        kwargs = dict(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            moe_intermediate_size=int(raw["moe_intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=int(raw["num_attention_heads"]),
            q_lora_rank=int(raw["q_lora_rank"]),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            index_n_heads=int(raw.get("index_n_heads", 32)),
            index_head_dim=int(raw.get("index_head_dim", 128)),
            index_topk=int(raw.get("index_topk", 2048)),
            indexer_types=indexer_types_from(num_layers, raw),
            n_routed_experts=int(raw.get("n_routed_experts") or raw.get("num_local_experts")),
            num_experts_per_tok=int(raw["num_experts_per_tok"]),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=first_dense,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            indexer_rope_interleave=bool(raw.get("indexer_rope_interleave", True)),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
            hidden_act=raw.get("hidden_act", "silu"),
            attention_bias=bool(raw.get("attention_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            quantization_config=raw.get("quantization_config"),
        )
        arch = cls(**kwargs)
        arch.validate()
        return arch

    @classmethod
    def from_pretrained(cls, path: str, overrides: dict | None = None) -> ModelArch:
        """The folder's config.json, with ``overrides`` (``--hf-overrides``) merged on top. When
        they shorten ``num_hidden_layers``, per-layer lists (``mlp_layer_types``,
        ``indexer_types``) are cut to the new depth."""
        cfg = os.path.join(path, "config.json")
        if not os.path.isfile(cfg):
            raise FileNotFoundError(f"no config.json in model folder {path!r}")
        with open(cfg) as f:
            raw = json.load(f)
        if overrides:
            raw = {**raw, **overrides}
            n = int(raw["num_hidden_layers"])
            for key in PER_LAYER_KEYS:
                v = raw.get(key)
                if key not in overrides and isinstance(v, (list, str)) and len(v) > n:
                    raw[key] = raw[key][:n]
        return cls.from_dict(raw)

    def validate(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (only silu)")
        if self.attention_bias:
            raise ValueError("attention_bias=true is not supported")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError("qk_rope_head_dim must be even and no larger than index_head_dim")
        if self.index_head_dim & (self.index_head_dim - 1):
            raise ValueError("index_head_dim must be a power of two (Walsh-Hadamard rotation)")
        if self.n_routed_experts % self.n_group:
            raise ValueError("n_routed_experts must be divisible by n_group")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError("num_experts_per_tok exceeds n_routed_experts")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# The GLM-5.3 architecture (SPEC §2), used by the planner and the byte-accounting tests.
GLM_5_3 = dict(
    architectures=["GlmMoeDsaForCausalLM"],
    model_type="glm_moe_dsa",
    vocab_size=154880,
    hidden_size=6144,
    intermediate_size=12288,
    moe_intermediate_size=2048,
    num_hidden_layers=78,
    num_attention_heads=64,
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=2048,
    index_topk_freq=4,
    index_skip_topk_offset=3,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    first_k_dense_replace=3,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 8e6},
    max_position_embeddings=1048576,
    rope_interleave=True,
    indexer_rope_interleave=True,
    num_nextn_predict_layers=1,
    torch_dtype="bfloat16",
)
