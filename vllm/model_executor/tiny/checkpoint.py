"""Deterministic weights for the tiny GLM-5.3-architecture checkpoint, and a writer for any
`glm_moe_dsa` state dict in the HF layout (single file or sharded, bf16/fp32 or FP8 block-quantised).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors.torch import save_file

from vllm.config.arch import GLM_5_3, ModelArch
from vllm.model_executor.layers.linear import quant_block_fp8

ASSETS = os.path.join(os.path.dirname(__file__), "assets")

# Toy GLM-5.3: IndexShare F S F S (freq 2, offset 1), a dense first layer, 8 experts (top 2) plus a
# shared one, an MTP layer, index_topk 32 so 100-token prompts are genuinely sparse.
TINY_CONFIG = dict(
    architectures=["GlmMoeDsaForCausalLM"],
    model_type="glm_moe_dsa",
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=32,
    index_topk_freq=2,
    index_skip_topk_offset=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 8e6},
    max_position_embeddings=1048576,
    rope_interleave=True,
    indexer_rope_interleave=True,
    num_nextn_predict_layers=1,
    hidden_act="silu",
    attention_bias=False,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=[0, 4, 6],
    pad_token_id=0,
    torch_dtype="bfloat16",
)

# A GLM-5.3-shaped slice for GPU checks and benchmarks: the real attention and indexer dimensions
# (64 heads, 576/512 MLA, indexer 32×128, top-k 2048, IndexShare 4/3), few layers and experts,
# hidden 1024. Overlay it on TINY_CONFIG (and override what a use needs, e.g. the vocabulary).
_REAL_ATTENTION = (
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "index_topk_freq",
    "index_skip_topk_offset",
)
GLM_SLICE = {
    **{k: GLM_5_3[k] for k in _REAL_ATTENTION},
    "num_key_value_heads": GLM_5_3["num_attention_heads"],
    "hidden_size": 1024,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "num_nextn_predict_layers": 0,
}

CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

TOKENIZER_CONFIG = dict(
    tokenizer_class="PreTrainedTokenizerFast",
    eos_token="<|endoftext|>",
    pad_token="<|endoftext|>",
    model_max_length=1048576,
    chat_template=CHAT_TEMPLATE,
    clean_up_tokenization_spaces=False,
)

# Linear weights an FP8 checkpoint stores as e4m3 + weight_scale_inv (norms, embeddings, lm_head,
# the router and the indexer's fp32 head weights stay in high precision).
_FP8_SUFFIXES = (
    "q_a_proj.weight",
    "q_b_proj.weight",
    "kv_a_proj_with_mqa.weight",
    "kv_b_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
    "wq_b.weight",
    "wk.weight",
    "eh_proj.weight",
)


def _layer_tensors(a: ModelArch, i: int, has_indexer: bool, g: torch.Generator) -> dict:
    def w(out_f, in_f, gain=1.0):
        return torch.randn(out_f, in_f, generator=g) * (gain / in_f**0.5)

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    p = f"model.layers.{i}."
    h, hq = a.num_attention_heads, a.qk_head_dim
    t = {
        p + "input_layernorm.weight": norm(a.hidden_size),
        p + "post_attention_layernorm.weight": norm(a.hidden_size),
        p + "self_attn.q_a_proj.weight": w(a.q_lora_rank, a.hidden_size),
        p + "self_attn.q_a_layernorm.weight": norm(a.q_lora_rank),
        p + "self_attn.q_b_proj.weight": w(h * hq, a.q_lora_rank),
        p + "self_attn.kv_a_proj_with_mqa.weight": w(
            a.kv_lora_rank + a.qk_rope_head_dim, a.hidden_size
        ),
        p + "self_attn.kv_a_layernorm.weight": norm(a.kv_lora_rank),
        p + "self_attn.kv_b_proj.weight": w(
            h * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank
        ),
        p + "self_attn.o_proj.weight": w(a.hidden_size, h * a.v_head_dim, 0.5),
    }
    if has_indexer:
        t.update(
            {
                p + "self_attn.indexer.wq_b.weight": w(
                    a.index_n_heads * a.index_head_dim, a.q_lora_rank
                ),
                p + "self_attn.indexer.wk.weight": w(a.index_head_dim, a.hidden_size),
                p + "self_attn.indexer.k_norm.weight": norm(a.index_head_dim),
                p + "self_attn.indexer.k_norm.bias": 0.1
                * torch.randn(a.index_head_dim, generator=g),
                p + "self_attn.indexer.weights_proj.weight": w(a.index_n_heads, a.hidden_size),
            }
        )
    if not a.is_moe_layer(i):
        t.update(
            {
                p + "mlp.gate_proj.weight": w(a.intermediate_size, a.hidden_size),
                p + "mlp.up_proj.weight": w(a.intermediate_size, a.hidden_size),
                p + "mlp.down_proj.weight": w(a.hidden_size, a.intermediate_size, 0.5),
            }
        )
        return t
    inter = a.moe_intermediate_size
    t[p + "mlp.gate.weight"] = w(a.n_routed_experts, a.hidden_size, 2.0)
    t[p + "mlp.gate.e_score_correction_bias"] = 0.05 * torch.randn(a.n_routed_experts, generator=g)
    for e in range(a.n_routed_experts):
        q = f"{p}mlp.experts.{e}."
        t[q + "gate_proj.weight"] = w(inter, a.hidden_size)
        t[q + "up_proj.weight"] = w(inter, a.hidden_size)
        t[q + "down_proj.weight"] = w(a.hidden_size, inter, 0.5)
    if a.n_shared_experts:
        si = inter * a.n_shared_experts
        t[p + "mlp.shared_experts.gate_proj.weight"] = w(si, a.hidden_size)
        t[p + "mlp.shared_experts.up_proj.weight"] = w(si, a.hidden_size)
        t[p + "mlp.shared_experts.down_proj.weight"] = w(a.hidden_size, si, 0.5)
    return t


def tiny_state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic fp32 weights for any glm_moe_dsa config (HF names, per-expert tensors)."""
    a = ModelArch.from_dict(config)
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.randn(a.vocab_size, a.hidden_size, generator=g)}
    for i in range(a.num_hidden_layers):
        sd.update(_layer_tensors(a, i, a.indexer_types[i] == "full", g))
    sd["model.norm.weight"] = 1.0 + 0.1 * torch.randn(a.hidden_size, generator=g)
    sd["lm_head.weight"] = torch.randn(a.vocab_size, a.hidden_size, generator=g) * (
        3.0 / a.hidden_size**0.5
    )
    for j in range(a.num_nextn_predict_layers):
        li = a.num_hidden_layers + j
        sd.update(_layer_tensors(a, li, True, g))
        p = f"model.layers.{li}."
        sd[p + "enorm.weight"] = 1.0 + 0.1 * torch.randn(a.hidden_size, generator=g)
        sd[p + "hnorm.weight"] = 1.0 + 0.1 * torch.randn(a.hidden_size, generator=g)
        sd[p + "eh_proj.weight"] = (
            torch.randn(a.hidden_size, 2 * a.hidden_size, generator=g) / (2 * a.hidden_size) ** 0.5
        )
        sd[p + "shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(a.hidden_size, generator=g)
    return sd


def align_mtp(sd: dict[str, torch.Tensor], config: dict, context_scale: float = 0.1) -> dict:
    """Make random weights draftable: an MTP layer that predicts the model's next token most of
    the time, so speculative decoding accepts drafts (random MTP weights accept almost none).

    Every residual branch of the main layers (attention and MLP/expert outputs) is scaled by
    ``context_scale``, so the next token depends mostly on the current one and partly on the
    context (which keeps the KV of every layer relevant: a wrong KV row still changes outputs).
    The MTP layer passes the next token's normalised embedding through (``eh_proj`` = [I | 0], its
    block's residual branches zero, its shared head's norm = the model's final norm), so it
    predicts what the model would predict from that token alone. Returns a new state dict."""
    a = ModelArch.from_dict(config)
    out = dict(sd)
    branches = ("o_proj.weight", "down_proj.weight")
    h = a.hidden_size
    for name, t in sd.items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m is None or not name.endswith(branches):
            continue
        main = int(m.group(1)) < a.num_hidden_layers
        out[name] = t * context_scale if main else torch.zeros_like(t)
    for j in range(a.num_nextn_predict_layers):
        p = f"model.layers.{a.num_hidden_layers + j}."
        out[p + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        out[p + "enorm.weight"] = torch.ones(h)
        out[p + "shared_head.norm.weight"] = sd["model.norm.weight"].clone()
    return out


def write_checkpoint(
    path: str,
    config: dict,
    state_dict: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype = torch.bfloat16,
    fp8: bool = False,
    max_shard_bytes: int | None = None,
    tokenizer: bool = True,
) -> None:
    """Write an HF checkpoint folder. fp8=True stores the linear weights as e4m3 with 128×128
    `weight_scale_inv`; max_shard_bytes splits into `model-0000k-of-0000n.safetensors` + index."""
    os.makedirs(path, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if fp8 and name.endswith(_FP8_SUFFIXES):
            q, s = quant_block_fp8(t)
            tensors[name], tensors[name[: -len("weight")] + "weight_scale_inv"] = q, s
        elif name.endswith(("e_score_correction_bias", "mlp.gate.weight", "weights_proj.weight")):
            tensors[name] = t.float().contiguous()
        else:
            tensors[name] = t.to(dtype).contiguous()
    cfg = dict(config)
    cfg["torch_dtype"] = {
        torch.bfloat16: "bfloat16",
        torch.float32: "float32",
        torch.float16: "float16",
    }[dtype]
    if fp8:
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    _write_safetensors(path, tensors, max_shard_bytes)
    if tokenizer:
        shutil.copy(os.path.join(ASSETS, "tokenizer.json"), os.path.join(path, "tokenizer.json"))
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump(TOKENIZER_CONFIG, f, indent=2)
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(
                {"eos_token_id": cfg.get("eos_token_id"), "pad_token_id": cfg.get("pad_token_id")},
                f,
            )


def _write_safetensors(
    path: str, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None
) -> None:
    meta = {"format": "pt"}
    if not max_shard_bytes:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata=meta)
        return
    shards: list[dict] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata=meta)
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def write_tiny_checkpoint(
    path: str, fp8: bool = False, seed: int = 0, mtp_aligned: bool = False
) -> str:
    """The built-in tiny checkpoint; ``mtp_aligned``: with :func:`align_mtp` applied."""
    sd = tiny_state_dict(TINY_CONFIG, seed)
    if mtp_aligned:
        sd = align_mtp(sd, TINY_CONFIG)
    write_checkpoint(path, TINY_CONFIG, sd, fp8=fp8)
    return path


def slice_config(**overrides) -> dict:
    """The full config.json of the GLM-5.3-shaped slice (TINY_CONFIG + GLM_SLICE + overrides)."""
    return {**TINY_CONFIG, **GLM_SLICE, **overrides}


def write_slice_checkpoint(path: str, fp8: bool = False, seed: int = 0, **overrides) -> str:
    """The GLM-5.3-shaped slice as an HF folder; fp8=True stores it as upstream's FP8 checkpoints
    are stored (e4m3 linears and experts, 128×128 `weight_scale_inv`, `quantization_config`)."""
    cfg = slice_config(**overrides)
    write_checkpoint(path, cfg, tiny_state_dict(cfg, seed), fp8=fp8)
    return path


def default_tiny_path(fp8: bool = False) -> str:
    root = os.environ.get(
        "VLLM_CACHE_ROOT", os.path.join(os.path.expanduser("~"), ".cache", "vllm")
    )
    return os.path.join(root, "tiny-glm-5.3-fp8" if fp8 else "tiny-glm-5.3")


def ensure_tiny_checkpoint(fp8: bool = False) -> str:
    """Path of the built-in tiny checkpoint, written on first use (atomically)."""
    path = default_tiny_path(fp8)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    tmp = f"{path}.tmp-{os.getpid()}"
    from vllm.utils import init_logging, logger

    init_logging()
    logger.info("writing the built-in tiny checkpoint to %s (first use)", path)
    write_tiny_checkpoint(tmp, fp8=fp8)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.rename(tmp, path)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return path
