"""FP8 block-scaled weights end to end on CPU: they stay e4m3 in memory (one rank, TP2, TP2×EP2,
DP2+EP2 over gloo), the model computes what its dequantised weights compute within FP8 error,
`--quantization fp8` quantises a full-precision checkpoint to the same weights, the weights-per-rank
arithmetic equals the model's parameters, and bad FP8 checkpoints fail naming the tensor.

Bounds (tiny checkpoint, seed 5, bf16 values; prompts of 90 and 100 tokens):
* One FP8 layer, on the inputs it sees in a forward pass (no error carried between layers):
  e4m3 has 3 mantissa bits, so rounding a normal value costs at most 2^-4 of it, a subnormal one
  at most half the subnormal step, 2^-10 of its group's scale (amax / 448). The weights are e4m3
  already (their error is in the dequantised reference too); activations are rounded per token
  and 128 columns, so |y − x·W_deqᵀ| <= (2^-4·|x| + 2^-10·s_x)·|W_deq|ᵀ element by element, plus
  fp32 rounding. Against the reference that rounds x the same way: fp32 summation order only.
* Whole model against the dequantised model with the same activation rounding (plain torch): only
  fp32 summation order differs, but a last-bit difference that lands on an e4m3 rounding boundary
  moves that activation by one FP8 step, and this random toy amplifies it (top-32 sparse attention
  and top-2 of 8 experts flip). Bound: mean relative logit error < 0.1, greedy agreement >= 90 %.
  Observed here max 7.6e-3 / 1.8e-2, mean 8.5e-5 / 5.1e-4, 100 % agreement; over seeds 0-9 (fp32
  values) the worst mean was 0.038, the worst agreement 94 %.
* Whole model against the dequantised model without activation rounding: each matmul carries
  ~2^-4/√3 ≈ 3.6 % RMS relative noise from its inputs, amplified as above, so no per-element
  bound holds. Bound: mean relative error < 0.2, greedy agreement >= 70 %. Observed 0.116 / 0.143
  and 83 % / 79 % (seeds 0-9: 0.093-0.142, 76-88 %).
* Two ranks: DP2+EP2 keeps whole experts and rounds activations as one rank does: identical
  logits here (bound 1e-3). TP2 and TP2×EP2 split o_proj's and down_proj's 128 input columns into
  64 per rank, so those activations are rounded in 64-column groups: the no-rounding bound
  applies (observed 0.074 / 92 % and 0.078 / 87 %). GLM-5.3's TP shards at TP <= 16 are
  multiples of 128 columns, where the groups, and so the rounding, are the single rank's.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from vllm.attention.layer import SparseMLAAttention
from vllm.config import ParallelConfig
from vllm.config.arch import GLM_5_3, ModelArch
from vllm.config.quantization import resolve_quantization
from vllm.distributed.parallel_state import GroupCoordinator, ParallelContext
from vllm.engine.arg_utils import EngineArgs
from vllm.kernels.fp8_gemm import FP8_DTYPE, per_token_group_quant_fp8_ref
from vllm.model_executor.layers.linear import Linear, dequant_block_fp8
from vllm.model_executor.model_loader import CheckpointError, build_model, load_model
from vllm.model_executor.models import glm_moe_dsa
from vllm.model_executor.models.glm_moe_dsa import Experts, GlmMoeDsaForCausalLM
from vllm.model_executor.simple_forward import prompt_logits
from vllm.model_executor.tiny import TINY_CONFIG, tiny_state_dict, write_checkpoint
from vllm.model_executor.weight_bytes import KINDS, check_weights_fit, weight_bytes_per_rank

PROMPTS = [list(range(7, 97)), list(range(300, 400))]
FULL_PRECISION = ("lm_head", "indexer.weights_proj")  # Linears that are never FP8


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """bf16, FP8 (as upstream stores it, from the same bf16 values) and the FP8 one dequantised
    back to fp32."""
    root = tmp_path_factory.mktemp("fp8w")
    sd = {n: t.bfloat16().float() for n, t in tiny_state_dict(TINY_CONFIG, seed=5).items()}
    paths = {k: str(root / k) for k in ("bf16", "fp8", "deq")}
    write_checkpoint(paths["bf16"], TINY_CONFIG, sd, dtype=torch.bfloat16, tokenizer=False)
    write_checkpoint(paths["fp8"], TINY_CONFIG, sd, dtype=torch.float32, tokenizer=False, fp8=True)
    raw = load_file(os.path.join(paths["fp8"], "model.safetensors"))
    deq = {
        n: dequant_block_fp8(t, raw[n[: -len("weight")] + "weight_scale_inv"], (128, 128))
        if t.dtype == FP8_DTYPE
        else t.float()
        for n, t in raw.items()
        if not n.endswith("weight_scale_inv")
    }
    write_checkpoint(paths["deq"], TINY_CONFIG, deq, dtype=torch.float32, tokenizer=False)
    return paths


@pytest.fixture(scope="module")
def fp8_model(ckpts):
    return build_model(ckpts["fp8"])


def _assert_fp8_layout(model) -> int:
    """Every linear but lm_head / weights_proj and every routed expert is e4m3 with fp32 scales;
    nothing else is FP8. Returns the FP8 bytes."""
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            fp8 = not name.endswith(FULL_PRECISION)
            assert m.is_fp8 == fp8 and (m.weight_scale_inv is not None) == fp8, name
            n += m.weight.numel() if fp8 else 0
        elif isinstance(m, Experts):
            for w, s in (
                (m.w13_weight, m.w13_weight_scale_inv),
                (m.w2_weight, m.w2_weight_scale_inv),
            ):
                assert w.dtype == FP8_DTYPE and s.dtype == torch.float32, name
                assert w.element_size() == 1
                n += w.numel()
    others = [
        p.dtype for n_, p in model.named_parameters() if "scale" not in n_ and p.dtype != FP8_DTYPE
    ]
    assert set(others) <= {torch.float32, torch.bfloat16}
    return n


def test_fp8_checkpoint_stays_e4m3(fp8_model):
    fp8_bytes = _assert_fp8_layout(fp8_model)
    got = measured_bytes(fp8_model)
    # everything but the embeddings, lm_head, norms, router and weights_proj (~6 % here) is e4m3
    assert fp8_bytes > 0.9 * (got["routed experts"] + got["shared experts"] + got["dense MLP"])


# ---- numerics -------------------------------------------------------------------------------
def _fake_quant(x: torch.Tensor) -> torch.Tensor:
    """x rounded as fp8_block_linear rounds its activations (per token, 128 columns)."""
    k = x.shape[-1]
    q, s = per_token_group_quant_fp8_ref(x.reshape(-1, k), 128)
    return (q.float() * s.repeat_interleave(128, -1)[:, :k]).to(x.dtype).reshape(x.shape)


def _experts_fake_quant(x, w13, w2, ids, weights, offset=0, **_):
    """Routed experts over dequantised weights, inputs and SiLU·up rounded as the FP8 path does."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    local, inter = ids - offset, w13.shape[1] // 2
    for e in torch.unique(local[(local >= 0) & (local < w13.shape[0])]).tolist():
        tok, slot = torch.where(local == e)
        xq = _fake_quant(x[tok])
        h = nn.functional.silu(xq @ w13[e, :inter].t()) * (xq @ w13[e, inter:].t())
        y = _fake_quant(h) @ w2[e].t()
        out.index_add_(0, tok, y.float() * weights[tok, slot].unsqueeze(-1))
    return out.to(x.dtype)


@contextlib.contextmanager
def _activation_quant(model):
    """The dequantised model with the FP8 model's activation quantisation, in plain torch: the
    linears that are FP8 in the FP8 model and the routed experts round their inputs first."""
    saved = {}
    for n, m in model.named_modules():
        if isinstance(m, Linear) and not n.endswith(FULL_PRECISION):
            saved[n] = m.forward
            m.forward = lambda x, x_quant=None, m=m: nn.functional.linear(_fake_quant(x), m.weight)
    # q_a and kv_a, gate and up through their own (patched) Linears, not the stacked GEMMs (same
    # weights)
    stacked = {
        (m, attr): getattr(m, attr)
        for m in model.modules()
        for attr in ("fused_qkv_a", "gate_up")
        if hasattr(m, attr)
    }
    for m, attr in stacked:
        setattr(m, attr, None)
    fused = glm_moe_dsa.fused_experts
    glm_moe_dsa.fused_experts = _experts_fake_quant
    try:
        yield
    finally:
        glm_moe_dsa.fused_experts = fused
        for (m, attr), f in stacked.items():
            setattr(m, attr, f)
        modules = dict(model.named_modules())
        for n, f in saved.items():
            modules[n].forward = f


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def _agree(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def test_logits_within_fp8_error_of_dequantised_model(ckpts, fp8_model):
    ref = build_model(ckpts["deq"])
    for ids in PROMPTS:
        got = prompt_logits(fp8_model, ids)
        plain = prompt_logits(ref, ids)
        with _activation_quant(ref):
            quantised = prompt_logits(ref, ids)
        assert _rel(got, quantised).mean() < 0.1 and _agree(got, quantised) >= 0.9
        assert _rel(got, plain).mean() < 0.2 and _agree(got, plain) >= 0.7


def test_each_fp8_layer_within_e4m3_bound(fp8_model):
    """On the inputs each FP8 linear and expert layer sees in a forward pass: against the
    dequantised weights |y − x·W_deqᵀ| <= (2^-4·|x| + 2^-10·s_x)·|W_deq|ᵀ element by element;
    against the same with x rounded as the FP8 path rounds it, fp32 summation order only
    (the experts' SiLU·up is requantised, so 1e-3 of the output's norm)."""
    inputs: dict[str, tuple] = {}
    hooks = [
        m.register_forward_pre_hook(lambda m, a, n=n: inputs.setdefault(n, a))
        for n, m in fp8_model.named_modules()
        if (isinstance(m, Linear) and m.is_fp8) or isinstance(m, Experts)
    ]
    prompt_logits(fp8_model, PROMPTS[0])
    for h in hooks:
        h.remove()
    modules = dict(fp8_model.named_modules())
    assert len(inputs) > 20
    for n, args in inputs.items():
        m = modules[n]
        if isinstance(m, Experts):
            x, weights, ids = args[:3]  # (x_quant: None on CPU)
            w13, w2 = dense_experts(m, "w13_weight"), dense_experts(m, "w2_weight")
            ref = _experts_fake_quant(x, w13, w2, ids, weights, m.expert_start)
            assert (m.run_local(x, weights, ids) - ref).norm() <= 1e-3 * ref.norm(), n
            continue
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        w = m.dense_weight(torch.float32)
        _, s = per_token_group_quant_fp8_ref(x, m.block[1])
        s_cols = s.repeat_interleave(m.block[1], -1)[:, : x.shape[1]]
        y = m(x)
        bound = (2**-4 * x.abs() + 2**-10 * s_cols) @ w.abs().t()
        fp32 = 1e-5 * (x.abs() @ w.abs().t()) + 1e-6
        assert ((y - x @ w.t()).abs() <= bound + fp32).all(), n
        assert ((y - _fake_quant(x) @ w.t()).abs() <= fp32).all(), n


def dense_experts(m: Experts, pname: str) -> torch.Tensor:
    """A routed-experts parameter dequantised (w13 per half: gate's scale rows, then up's)."""
    if pname == "w2_weight":
        return dequant_block_fp8(m.w2_weight, m.w2_weight_scale_inv, m.block)
    g = m.w13_weight_scale_inv.shape[1] // 2
    w, s = m.w13_weight, m.w13_weight_scale_inv
    halves = [(w[:, : m.inter], s[:, :g]), (w[:, m.inter :], s[:, g:])]
    return torch.cat([dequant_block_fp8(h, hs, m.block) for h, hs in halves], dim=1)


def test_quantization_flag_on_bf16_checkpoint(ckpts, fp8_model):
    """--quantization fp8 on a bf16 checkpoint: the same e4m3 weights and scales as the FP8
    checkpoint of the same values (the same 128×128 amax/448 rounding), hence the same logits."""
    q = build_model(ckpts["bf16"], quantization="fp8")
    _assert_fp8_layout(q)
    ref = dict(fp8_model.named_parameters())
    for n, p in q.named_parameters():
        assert p.dtype == ref[n].dtype and torch.equal(p.float(), ref[n].float()), n
    assert torch.equal(prompt_logits(q, PROMPTS[0]), prompt_logits(fp8_model, PROMPTS[0]))


def test_quantization_flag_validated(ckpts):
    cfg = EngineArgs(model=ckpts["bf16"], quantization="fp8").create_engine_config()
    assert cfg.model_config.quantization == "fp8"
    EngineArgs(model=ckpts["fp8"], quantization="fp8").create_engine_config()  # accepted
    EngineArgs(model=ckpts["fp8"]).create_engine_config()  # detected, no flag needed
    with pytest.raises(ValueError, match="--quantization 'awq' is not supported"):
        EngineArgs(model=ckpts["bf16"], quantization="awq").create_engine_config()


# ---- bad checkpoints ----------------------------------------------------------------------
def _broken(tmp_path, ckpts, edit_tensors=None, edit_config=None) -> str:
    path = str(tmp_path / "broken")
    os.makedirs(path)
    t = load_file(os.path.join(ckpts["fp8"], "model.safetensors"))
    if edit_tensors:
        edit_tensors(t)
    save_file(t, os.path.join(path, "model.safetensors"))
    with open(os.path.join(ckpts["fp8"], "config.json")) as f:
        cfg = json.load(f)
    if edit_config:
        edit_config(cfg)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


E1 = "model.layers.1.mlp.experts.3.down_proj."
QB = "model.layers.2.self_attn.q_b_proj."


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop(E1 + "weight_scale_inv"), f"FP8 tensor {E1}weight has no"),
        (
            lambda t: t.__setitem__(QB + "weight_scale_inv", torch.ones(1, 1)),
            rf"tensor {QB}weight_scale_inv has shape \(1, 1\), expected \(2, 1\)",
        ),
        (
            lambda t: t.__setitem__(QB + "weight", t[QB + "weight"][:100]),
            rf"tensor {QB}weight has shape \(100, 64\), expected \(192, 64\)",
        ),
        (
            lambda t: t.__setitem__(E1 + "weight", t[E1 + "weight"][:, :16].contiguous()),
            rf"tensor {E1}weight has shape \(64, 16\), expected \(64, 32\)",
        ),
    ],
)
def test_bad_fp8_tensor_named(tmp_path, ckpts, edit, message):
    with pytest.raises(CheckpointError, match=message.replace(".", r"\.")):
        build_model(_broken(tmp_path, ckpts, edit_tensors=edit))


def test_bad_block_size_named(tmp_path, ckpts):
    def edit(cfg):
        cfg["quantization_config"]["weight_block_size"] = [64, 64]

    with pytest.raises(ValueError, match=r"weight_block_size \[64, 64\] is not supported"):
        build_model(_broken(tmp_path, ckpts, edit_config=edit))


# ---- weight bytes ---------------------------------------------------------------------------
def _fake_pc(tp: int, rank: int, ep: int | None) -> ParallelContext:
    def g(name, size, r):
        return GroupCoordinator(name, list(range(size)), r)

    ep_group = g("ep", ep, rank % ep) if ep else None
    return ParallelContext(
        tp=g("tp", tp, rank % tp), pcp=g("pcp", 1, 0), dcp=g("dcp", 1, 0), ep=ep_group
    )


def _kind(name: str) -> str:
    if ".mlp.experts." in name:
        return "routed experts"
    if ".self_attn." in name:
        return "attention"
    if ".shared_experts." in name:
        return "shared experts"
    if name.startswith(("model.embed_tokens", "lm_head")):
        return "embeddings/lm_head"
    if ".mlp." in name and ".mlp.gate." not in name:
        return "dense MLP"
    return "other"


def measured_bytes(model) -> dict[str, int]:
    """A model's weights by kind: its parameters plus the absorbed W_UK/W_UV."""
    got = dict.fromkeys(KINDS, 0)
    for n, p in model.named_parameters():
        got[_kind(n)] += p.numel() * p.element_size()
    for m in model.modules():
        if isinstance(m, SparseMLAAttention):
            got["attention"] += sum(t.numel() * t.element_size() for t in (m.w_uk, m.w_uv))
    return got


@pytest.mark.parametrize("quant", ["fp8", None])
@pytest.mark.parametrize(
    "config, tp, rank, ep",
    [
        (TINY_CONFIG, 1, 0, None),
        (TINY_CONFIG, 2, 1, None),  # q_b_proj's shard starts inside a 128-block
        (TINY_CONFIG, 2, 1, 2),
        (GLM_5_3, 1, 3, 8),  # EP rank 3 of the seed's EP8 deployments
        (GLM_5_3, 8, 3, None),
    ],
)
def test_weight_bytes_equal_model_parameters(config, tp, rank, ep, quant):
    arch = resolve_quantization(ModelArch.from_dict(config), quant)
    with torch.device("meta"):  # shapes only: GLM-5.3 itself, nothing allocated
        model = GlmMoeDsaForCausalLM(arch, _fake_pc(tp, rank, ep), torch.bfloat16)
        model.process_weights_after_loading()
    expect = weight_bytes_per_rank(
        arch, torch.bfloat16, tp_size=tp, tp_rank=rank, ep_size=ep, num_mtp=model.num_mtp
    )
    assert measured_bytes(model) == expect.by_kind


def test_expert_scales_stored_k_blocks_first():
    """After loading, the experts' block scales hold the same [E, N/128, K/128] values with the K
    blocks first in memory (what CUTLASS's grouped GEMM reads: no copy per call); the model's
    output does not change (the kernels read the scales through their strides)."""
    cfg = {**TINY_CONFIG, "hidden_size": 256, "moe_intermediate_size": 384}
    arch = resolve_quantization(ModelArch.from_dict(cfg), "fp8")
    m = Experts(arch, ParallelContext.single(), torch.float32)
    g = torch.Generator().manual_seed(0)
    for p in m.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 64).to(p.dtype)
    before = [m.w13_weight_scale_inv.clone(), m.w2_weight_scale_inv.clone()]
    x = torch.randn(6, 256, generator=g)
    ids = torch.stack([torch.randperm(m.num_local, generator=g)[:2] for _ in range(6)])
    w = torch.rand(6, 2, generator=g)
    want = m(x, w, ids)
    m.process_weights_after_loading()
    for s, old in zip((m.w13_weight_scale_inv, m.w2_weight_scale_inv), before, strict=True):
        assert s.shape == old.shape and torch.equal(s, old)
        assert s.transpose(1, 2).is_contiguous() and not s.is_contiguous()
    assert torch.equal(m(x, w, ids), want)


def test_weights_do_not_fit_message():
    arch = resolve_quantization(ModelArch.from_dict(GLM_5_3), None)  # bf16
    weights = weight_bytes_per_rank(arch, torch.bfloat16, ep_size=8)  # 203.6 GiB
    total, free = 140 * 2**30, 139 * 2**30
    with pytest.raises(ValueError) as e:
        check_weights_fit(weights, free, total, 0.9, "GPU 0 (glm-5.3)")
    msg = str(e.value)
    # min(140 · 0.9, 139) = 126.0 GiB available; 203.63 − 126.0 = 77.63 GiB short
    assert "the weights do not fit GPU 0 (glm-5.3)" in msg and "routed experts 168.75" in msg
    assert "126.00 GiB is available" in msg and "77.63 GiB short" in msg
    assert "--quantization fp8" in msg
    fp8 = weight_bytes_per_rank(resolve_quantization(arch, "fp8"), torch.bfloat16, ep_size=8)
    check_weights_fit(fp8, free, total, 0.9, "GPU 0")  # 104.9 GiB: fits
    # another process (a second engine sharing the GPU) holds 30 GiB: this engine's share at 0.8
    # is 112 GiB, 110 of them free, so it loads (counting the other's 30 GiB against this share
    # would leave 82); with only 60 GiB free, what is free is the limit
    check_weights_fit(fp8, 110 * 2**30, total, 0.8, "GPU 0")
    with pytest.raises(ValueError, match="60.00 GiB is available"):
        check_weights_fit(fp8, 60 * 2**30, total, 0.9, "GPU 0")


# ---- several ranks (gloo) -----------------------------------------------------------------
# (layout, whether it quantises activations exactly as one rank does)
LAYOUTS = {
    "tp2": (dict(tensor_parallel_size=2), False),
    "tp2-ep2": (dict(tensor_parallel_size=2, enable_expert_parallel=True), False),
    "dp2-ep2": (dict(data_parallel_size=2, enable_expert_parallel=True), True),
}


def _rank_main(rank: int, path: str, init: str, queue) -> None:
    """One of two gloo ranks: every layout in turn (one process group, each layout's groups)."""
    import torch.distributed as dist

    from vllm.distributed.groups import build_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, world_size=2, rank=rank)
    for name, (layout, _) in LAYOUTS.items():
        pc = build_groups(ParallelConfig(**layout), rank, torch.device("cpu"))
        model = build_model(path, pc=pc)
        fp8_bytes = _assert_fp8_layout(model)
        expect = weight_bytes_per_rank(
            model.arch,
            torch.float32,
            tp_size=pc.tp.world_size,
            tp_rank=pc.tp.rank_in_group,
            ep_size=pc.ep.world_size if pc.ep is not None else None,
            num_mtp=model.num_mtp,
        )
        logits = prompt_logits(model, PROMPTS[0])
        queue.put((name, rank, fp8_bytes, measured_bytes(model), expect.by_kind, logits))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(ckpts, tmp_path_factory) -> dict[str, list]:
    """{layout: [(rank, fp8 bytes, bytes by kind, weight_bytes_per_rank, logits)] per rank}."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tmp_path_factory.mktemp('gloo')}/store"
    procs = [ctx.Process(target=_rank_main, args=(r, ckpts["fp8"], init, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    out: dict[str, list] = {}
    try:
        for _ in range(2 * len(LAYOUTS)):
            name, *rest = queue.get(timeout=150)
            out.setdefault(name, []).append(tuple(rest))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp8_stays_e4m3_across_ranks(fp8_model, two_ranks, name):
    """Every rank holds e4m3 weights of its shard: its parameter bytes by kind equal
    weight_bytes_per_rank (routed experts: E_loc·3·I_loc·H bytes + scales). EP keeps whole experts
    and quantises activations as one rank does: logits within 1e-3 of the single rank's. TP splits
    o_proj's and down_proj's input columns, so their activations are quantised in 64-column groups
    instead of 128: the FP8-noise bound of the no-activation-quantisation comparison applies."""
    _, same_rounding = LAYOUTS[name]
    single = prompt_logits(fp8_model, PROMPTS[0])
    one_rank = measured_bytes(fp8_model)
    for _, fp8_bytes, got, expect, logits in sorted(two_ranks[name], key=lambda r: r[0]):
        assert got == expect and fp8_bytes > 0
        assert got["routed experts"] < 0.51 * one_rank["routed experts"]
        if same_rounding:
            assert _rel(logits, single).max() < 1e-3
        else:
            assert _rel(logits, single).mean() < 0.2
            assert (logits.argmax(-1) == single.argmax(-1)).float().mean() >= 0.7


# ---- H200 ---------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_slice_fp8_on_cuda(tmp_path):
    """The GLM-5.3-shaped slice (real attention and indexer dimensions, hidden 1024, 4 experts)
    from an FP8 checkpoint on CUDA: its weights take their FP8 bytes on the device
    (torch.cuda.memory_allocated, within the allocator's rounding: 2 % + 1 MiB), well under the
    bf16 bytes, and its bf16 logits stay within the FP8-noise bound of the dequantised slice's
    (mean relative error < 0.2, greedy agreement >= 70 %; on CPU in fp32 the same comparison gives
    0.066 / 0.067 and 92 % / 88 % for these two prompts)."""
    from dataclasses import replace

    from vllm.model_executor.tiny import slice_config, write_slice_checkpoint

    fp8 = write_slice_checkpoint(str(tmp_path / "fp8"), fp8=True, seed=3)
    raw = load_file(os.path.join(fp8, "model.safetensors"))
    deq = {
        n: dequant_block_fp8(t, raw[n[: -len("weight")] + "weight_scale_inv"], (128, 128))
        if t.dtype == FP8_DTYPE
        else t.float()
        for n, t in raw.items()
        if not n.endswith("weight_scale_inv")
    }
    write_checkpoint(str(tmp_path / "deq"), slice_config(), deq, tokenizer=False)
    arch = ModelArch.from_pretrained(fp8)
    expect = weight_bytes_per_rank(arch, torch.bfloat16).total
    bf16 = weight_bytes_per_rank(replace(arch, quantization_config=None), torch.bfloat16).total
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = build_model(fp8, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    assert _assert_fp8_layout(model) > 0
    assert expect <= held <= 1.02 * expect + 2**20, (held, expect)
    # measured on an H200: 0.64 of the bf16 model (the e4m3 linears and experts take half; the
    # fp32 absorbed W_UK/W_UV, the embedding, lm_head and norms do not shrink)
    assert held < 0.7 * bf16
    ref = build_model(str(tmp_path / "deq"), dtype=torch.bfloat16, device="cuda")
    for ids in (list(range(10, 74)), list(range(500, 600))):
        got = prompt_logits(model, ids, device="cuda").float().cpu()
        want = prompt_logits(ref, ids, device="cuda").float().cpu()
        assert _rel(got, want).mean() < 0.2 and _agree(got, want) >= 0.7


def test_tp_shard_starting_inside_a_block(tmp_path):
    """Intermediates of 192 at TP2: rank 1's rows/columns 96..191 start inside the checkpoint's
    first 128-block and end in the second. Linears keep e4m3 as stored, in 32-wide blocks with
    the checkpoint's scales repeated: dequantised, exactly the full weight's slice. Routed experts
    (whose kernel takes 128-blocks only) requantise the shard: within one more e4m3 rounding."""
    cfg = {**TINY_CONFIG, "intermediate_size": 192, "moe_intermediate_size": 192}
    path = str(tmp_path / "ckpt")
    write_checkpoint(path, cfg, tiny_state_dict(cfg, seed=1), tokenizer=False, fp8=True)
    full = build_model(path)
    arch = ModelArch.from_pretrained(path)
    with torch.device("cpu"):
        rank1 = GlmMoeDsaForCausalLM(arch, _fake_pc(2, 1, None), torch.float32)
    load_model(path, rank1)
    mlp, mlp1 = full.model.layers[0].mlp, rank1.model.layers[0].mlp
    assert mlp1.gate_proj.block == (32, 128) and mlp1.down_proj.block == (128, 32)
    for name in ("gate_proj", "up_proj"):
        want = getattr(mlp, name).dense_weight(torch.float32)[96:]
        assert torch.equal(getattr(mlp1, name).dense_weight(torch.float32), want)
    want = mlp.down_proj.dense_weight(torch.float32)[:, 96:]
    assert torch.equal(mlp1.down_proj.dense_weight(torch.float32), want)
    x = torch.randn(5, 96)  # activations in 32-column groups: finer, so within the 2^-4 bound
    err = (mlp1.down_proj(x) - x @ want.t()).abs()
    assert (err <= 2**-4 * (x.abs() @ want.abs().t()) + 1e-6).all()
    ex, ex1 = full.model.layers[1].mlp.experts, rank1.model.layers[1].mlp.experts
    w13, w13_1 = dense_experts(ex, "w13_weight"), dense_experts(ex1, "w13_weight")
    for half in (0, 1):  # gate rows, then up rows
        want = w13[:, half * 192 + 96 : (half + 1) * 192]
        got = w13_1[:, half * 96 : (half + 1) * 96]
        assert ((got - want).abs() <= want.abs() * 2**-4 + want.abs().max() * 2**-12).all()
    want, got = dense_experts(ex, "w2_weight")[:, :, 96:], dense_experts(ex1, "w2_weight")
    assert ((got - want).abs() <= want.abs() * 2**-4 + want.abs().max() * 2**-12).all()


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_norm_quantises_for_fp8_qkv_a_on_cuda(tmp_path, monkeypatch):
    """At decode sizes on CUDA the FP8 slice's input norm also quantises its output for the
    stacked q_a+kv_a GEMM, and the q_a norm for q_b while q_b runs the Triton GEMM (up to
    TRITON_MAX_M rows): every projection the layer makes equals, bit for bit, the path where the
    GEMMs quantise x themselves (the same e4m3 bytes and scales), and the path is taken; the same
    for the post-attention norm and the MLP's stacked gate/up GEMM (and, in an MoE layer, the
    routed experts, which read the same quantisation)."""
    from vllm.kernels import fp8_gemm, norm_rope
    from vllm.model_executor.models import glm_moe_dsa
    from vllm.model_executor.tiny import write_slice_checkpoint

    model = build_model(write_slice_checkpoint(str(tmp_path / "fp8"), fp8=True, seed=3),
                        dtype=torch.bfloat16, device="cuda")  # fmt: skip
    layer = model.model.layers[0]
    assert layer.self_attn.fused_qkv_a is not None and layer.self_attn.fused_qkv_a[1] is not None
    for m in (1, 16, 64):
        x = torch.randn(
            m, layer.input_layernorm.weight.shape[0], device="cuda", dtype=torch.bfloat16
        )
        pos = torch.arange(m, device="cuda")
        calls = []
        real = norm_rope.rms_norm_quant
        monkeypatch.setattr(
            glm_moe_dsa, "rms_norm_quant", lambda *a, c=calls, f=real: c.append(1) or f(*a)
        )
        fused = layer.pre_attention(x, pos)
        assert len(calls) == (2 if m <= fp8_gemm.TRITON_MAX_M else 1), (m, calls)
        monkeypatch.setattr(glm_moe_dsa, "takes_x_quant", lambda *a: False)
        plain = layer.pre_attention(x, pos)
        monkeypatch.undo()
        for name in ("q_nope", "q_pe", "kv_c", "k_pe"):
            assert torch.equal(getattr(fused, name), getattr(plain, name)), (m, name)
    # the post-attention norm for the MLP's stacked gate/up GEMM (a dense layer's MLP, an MoE
    # layer's shared expert): quantises where that GEMM reads a producer's quantisation
    for layer in (model.model.layers[0], model.model.layers[-1]):
        attn, gemm = layer.self_attn, layer.mlp.input_gemm()
        assert gemm is not None and gemm[1] is not None
        for m in (1, 16, 64):
            x = torch.randn(m, attn.o_proj.out_features, device="cuda", dtype=torch.bfloat16)
            out = torch.randn(m, attn.num_heads, attn.v, device="cuda", dtype=torch.bfloat16)
            calls = []
            # the attention output's add runs in this norm's pass (add_rms_norm_quant)
            real = norm_rope.add_rms_norm_quant
            monkeypatch.setattr(
                glm_moe_dsa,
                "add_rms_norm_quant",
                lambda *a, c=calls, f=real: c.append(1) or f(*a),
            )
            fused = layer.post_attention(x, out)
            want = fp8_gemm.takes_x_quant(x, gemm[0], gemm[2])
            assert len(calls) == int(want), (layer.is_moe, m, calls)
            monkeypatch.setattr(glm_moe_dsa, "takes_x_quant", lambda *a: False)
            plain = layer.post_attention(x, out)
            monkeypatch.undo()
            assert torch.equal(fused, plain), (layer.is_moe, m)
