"""Load an HF `glm_moe_dsa` safetensors checkpoint (single file or sharded) into our model.

Tensors stream one at a time from the files into parameters that already live on the target
device, each cut to this rank's TP/EP shard on the way; the model is never held twice. FP8
weights stay FP8 on every device: a checkpoint's e4m3 tensor and its `weight_scale_inv` (one fp32
per 128 × 128 tile) are sharded together (`Linear.shard_full_scale`; experts below), and with
`--quantization fp8` a bf16/fp32 tensor is quantised on the target device as it arrives. Every
problem names the tensor: missing, unexpected, wrong shape, missing or misshapen scale.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open

from vllm.config.quantization import FP8_WEIGHT_BLOCK, resolve_quantization
from vllm.model_executor.layers.linear import (
    FP8_DTYPE,
    Linear,
    cdiv,
    dequant_block_fp8,
    quant_block_fp8,
    shard_block,
    shard_scale,
)
from vllm.model_executor.models.glm_moe_dsa import Experts, GlmMoeDsaForCausalLM


class CheckpointError(ValueError):
    pass


def checkpoint_files(path: str) -> dict[str, str]:
    """tensor name -> file path."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = {n: os.path.join(path, fn) for n, fn in weight_map.items()}
        for fp in set(files.values()):
            if not os.path.isfile(fp):
                raise CheckpointError(
                    f"shard {os.path.basename(fp)} listed in model.safetensors.index.json is missing"
                )
        return files
    if os.path.isfile(single):
        with safe_open(single, "pt") as f:
            return {n: single for n in f.keys()}
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path!r}")


_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class _Loader:
    def __init__(self, model: GlmMoeDsaForCausalLM, files: dict[str, str], device: torch.device):
        self.model, self.files, self.device = model, files, device
        self.arch = model.arch
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.loaded: set[str] = set()
        self.expert_parts: dict[str, set] = {}

    # -- reading -------------------------------------------------------------------------------
    def _get(self, name: str) -> torch.Tensor:
        fp = self.files[name]
        with safe_open(fp, "pt", device="cpu") as f:
            return f.get_tensor(name)

    def _read(
        self, name: str, expect: tuple[int, ...], fp8: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Checkpoint tensor ``name``, its shape checked against ``expect``, as (e4m3 weight,
        fp32 scale of 128 × 128 tiles) when the target is ``fp8``, else (full precision, None)."""
        t = self._get(name)
        if tuple(t.shape) != tuple(expect):
            raise CheckpointError(
                f"tensor {name} has shape {tuple(t.shape)}, expected {tuple(expect)}"
            )
        block = FP8_WEIGHT_BLOCK
        if t.dtype == FP8_DTYPE:
            scale = self._scale(name, t)
            if fp8:
                return t, scale
            return dequant_block_fp8(t, scale, block, torch.float32), None
        if fp8:  # --quantization fp8: this tensor only, on the target device
            return quant_block_fp8(t.to(self.device), block)
        return t, None

    def _scale(self, name: str, t: torch.Tensor) -> torch.Tensor:
        sname = name[: -len("weight")] + "weight_scale_inv"
        if sname not in self.files:
            raise CheckpointError(f"FP8 tensor {name} has no {sname}")
        scale = self._get(sname)
        n, k = t.shape[-2:]
        expect = (cdiv(n, FP8_WEIGHT_BLOCK[0]), cdiv(k, FP8_WEIGHT_BLOCK[1]))
        if tuple(scale.shape) != expect:
            raise CheckpointError(
                f"tensor {sname} has shape {tuple(scale.shape)}, expected {expect}: one scale per "
                f"128 × 128 block of {name} {tuple(t.shape)} (weight_block_size [128, 128])"
            )
        return scale.float()

    # -- name mapping ------------------------------------------------------------------------------
    def map_name(self, name: str) -> str | None:
        """Checkpoint name -> our parameter name; None for tensors we knowingly skip."""
        a, L = self.arch, self.arch.num_hidden_layers
        m = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
        if m and int(m.group(1)) >= L:
            j, rest = int(m.group(1)) - L, m.group(2)
            if j >= a.num_nextn_predict_layers:
                return "!unexpected"
            if j >= self.model.num_mtp:
                return None  # MTP weights present but not requested
            if rest in ("embed_tokens.weight", "shared_head.head.weight"):
                return None  # copies of the main embedding / lm_head, which MTP shares
            if rest.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head"):
                return f"model.mtp.{j}.{rest}"
            return f"model.mtp.{j}.block.{rest}"
        return name

    # -- loading -------------------------------------------------------------------------------
    def load(self, progress: bool = False) -> None:
        names = [n for n in self.files if not n.endswith("weight_scale_inv")]
        it = sorted(names, key=lambda n: (self.files[n], n))
        if progress:
            from tqdm import tqdm

            it = tqdm(it, desc="Loading safetensors", unit="tensor", leave=False)
        for name in it:
            target = self.map_name(name)
            if target is None:
                continue
            if target == "!unexpected":
                raise CheckpointError(
                    f"unexpected tensor {name} in checkpoint (no such layer in config.json)"
                )
            m = _EXPERT.match(target)
            if m:
                self._load_expert(name, m)
            else:
                self._load_param(name, target)
        self._check_complete()

    def _load_param(self, name: str, target: str) -> None:
        if target not in self.params or target.endswith("weight_scale_inv"):
            raise CheckpointError(
                f"unexpected tensor {name} in checkpoint (the model has no parameter {target})"
            )
        mod_name, _, pname = target.rpartition(".")
        module = self.modules[mod_name]
        param = self.params[target]
        if isinstance(module, Linear) and pname == "weight":
            t, scale = self._read(name, self._full_shape(module), module.is_fp8)
            param.data.copy_(module.shard_full(t).to(param.dtype))
            if scale is not None:
                module.weight_scale_inv.data.copy_(module.shard_full_scale(scale))
        else:
            t, _ = self._read(name, tuple(param.shape), fp8=False)
            param.data.copy_(t.to(param.dtype))
        self.loaded.add(target)

    def _full_shape(self, module: Linear) -> tuple[int, int]:
        o, i = module.out_features, module.in_features
        if module.shard == "col":
            o *= module.tp_size
        elif module.shard == "row":
            i *= module.tp_size
        return (o, i)

    def _load_expert(self, name: str, m: re.Match) -> None:
        prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
        experts = self.modules.get(prefix)
        if not isinstance(experts, Experts):
            raise CheckpointError(
                f"unexpected tensor {name} in checkpoint (layer has no routed experts)"
            )
        if not 0 <= e < self.arch.n_routed_experts:
            raise CheckpointError(
                f"unexpected tensor {name} in checkpoint (expert {e} >= n_routed_experts)"
            )
        local = e - experts.expert_start
        if not 0 <= local < experts.num_local:
            return  # another EP rank's expert
        inter_full, h = self.arch.moe_intermediate_size, self.arch.hidden_size
        down = kind == "down_proj"
        expect = (h, inter_full) if down else (inter_full, h)
        t, scale = self._read(name, expect, experts.block is not None)
        w, s = self._expert_shard(experts, t, scale, -1 if down else -2)
        if down:
            experts.w2_weight.data[local].copy_(w)
            if s is not None:
                experts.w2_weight_scale_inv.data[local].copy_(s)
        else:
            lo = 0 if kind == "gate_proj" else experts.inter
            experts.w13_weight.data[local, lo : lo + experts.inter].copy_(w)
            if s is not None:
                g = s.shape[0]  # ceil(I_local / 128) row blocks per half
                slo = 0 if kind == "gate_proj" else g
                experts.w13_weight_scale_inv.data[local, slo : slo + g].copy_(s)
        self.expert_parts.setdefault(prefix, set()).add((local, kind))

    def _expert_shard(
        self, experts: Experts, t: torch.Tensor, scale: torch.Tensor | None, dim: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's TP shard of one expert tensor along the intermediate ``dim`` (rows of
        gate/up, columns of down) and its scales."""
        n = experts.inter
        start = experts.tp_rank * n
        w = t.narrow(dim, start, n)
        if scale is None:
            return w, None
        b = FP8_WEIGHT_BLOCK[0]
        if shard_block(start, n, b) == b:
            return w, shard_scale(scale, dim, start, n, b)
        # the shard starts inside a block and crosses into the next: one scale per local 128-block
        # cannot express that (vllm.kernels.moe.experts_ref), so this shard is requantised
        full = dequant_block_fp8(t, scale, FP8_WEIGHT_BLOCK, torch.float32)
        return quant_block_fp8(full.narrow(dim, start, n), FP8_WEIGHT_BLOCK)

    def _check_complete(self) -> None:
        for n in self.params:
            mod_name, _, pname = n.rpartition(".")
            module = self.modules[mod_name]
            if isinstance(module, Experts):
                got = self.expert_parts.get(mod_name, set())
                for local in range(module.num_local):
                    for kind in ("gate_proj", "up_proj", "down_proj"):
                        if (local, kind) not in got and pname == "w13_weight":
                            e = module.expert_start + local
                            raise CheckpointError(
                                f"missing tensor {self._ckpt_name(mod_name)}.{e}.{kind}.weight in checkpoint"
                            )
                continue
            if pname == "weight_scale_inv":  # loaded with its weight
                continue
            if n not in self.loaded:
                raise CheckpointError(f"missing tensor {self._ckpt_name(n)} in checkpoint")

    def _ckpt_name(self, ours: str) -> str:
        m = re.match(r"model\.mtp\.(\d+)\.(block\.)?(.*)$", ours)
        if m:
            return f"model.layers.{self.arch.num_hidden_layers + int(m.group(1))}.{m.group(3)}"
        return ours


def load_model(
    path: str,
    model: GlmMoeDsaForCausalLM,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> GlmMoeDsaForCausalLM:
    _Loader(model, checkpoint_files(path), torch.device(device)).load(progress)
    model.process_weights_after_loading()
    return model


LOAD_FORMATS = ("auto", "safetensors", "dummy")


def build_model(
    path: str,
    *,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    pc=None,
    force_mqa: bool = False,
    load_mtp: bool = True,
    progress: bool = False,
    quantization: str | None = None,
    load_format: str = "auto",
    arch=None,
):
    """The model of checkpoint folder ``path`` on ``device``: FP8 weights (an FP8 checkpoint, or
    ``quantization="fp8"``) allocated e4m3 from the start, everything else in ``dtype``.
    ``arch``: the architecture if not ``path``'s config.json as is (``--hf-overrides``);
    ``load_format="dummy"``: random weights, no checkpoint read (:mod:`dummy_weights`)."""
    from vllm.config.arch import ModelArch

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    arch = resolve_quantization(arch or ModelArch.from_pretrained(path), quantization)
    with torch.device(device):
        model = GlmMoeDsaForCausalLM(arch, pc, dtype, force_mqa=force_mqa, load_mtp=load_mtp)
    if load_format == "dummy":
        from vllm.model_executor.dummy_weights import init_dummy_weights

        init_dummy_weights(model)
        model.process_weights_after_loading()
        return model
    return load_model(path, model, device, progress)
