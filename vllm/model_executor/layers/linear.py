"""Linear layers: full-precision or FP8 block-quantised weights, with tensor-parallel sharding.

An FP8 layer holds its weight e4m3 [out, in] and `weight_scale_inv` fp32 [ceil(out/bn),
ceil(in/bk)] (W = weight · scale tile by tile: the checkpoint convention, despite the name) and
runs :func:`vllm.kernels.fp8_gemm.fp8_block_linear` (activations quantised per token-group of bk;
the dequantised weight is never built). `shard` says how tensor parallelism splits the weight:
"col" splits the output rows (optionally in units of `shard_unit` rows, i.e. whole heads), "row"
splits the input columns, None replicates.

The block of a TP shard. Checkpoints tile the full weight in 128 × 128 blocks. A shard that starts
on a block boundary, or lies inside one block, keeps 128 and the checkpoint's scales for the blocks
it covers. A shard that starts inside a block and crosses into the next (96 rows of 192 at TP2)
uses blocks of gcd(128, start) along that dimension, each inside one checkpoint block, with the
checkpoint's scales repeated: exact, no requantisation. GLM-5.3's shards at TP <= 32 are all of
the first two kinds.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vllm.kernels.fp8_gemm import FP8_DTYPE, fp8_block_linear


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dequant_block_fp8(
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """w e4m3 [..., N, K], scale_inv fp32 [..., ceil(N/bn), ceil(K/bk)] -> w·scale in ``dtype``."""
    n, k = w.shape[-2:]
    bn, bk = block
    s = scale_inv.float().repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]
    return (w.float() * s).to(dtype)


def quant_block_fp8(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`dequant_block_fp8` with scale = tile amax / 448, on w's device (writes FP8
    checkpoints; quantises bf16/fp32 checkpoints at load with ``--quantization fp8``)."""
    n, k = w.shape
    bn, bk = block
    gn, gk = cdiv(n, bn), cdiv(k, bk)
    pad = torch.zeros(gn * bn, gk * bk, dtype=torch.float32, device=w.device)
    pad[:n, :k] = w.float()
    tiles = pad.view(gn, bn, gk, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).clamp(-448, 448).view(gn * bn, gk * bk)[:n, :k]
    return q.to(FP8_DTYPE).contiguous(), scale


def shard_block(start: int, length: int, block: int) -> int:
    """Block size along one dimension for the shard [start, start + length) of a dimension that
    the checkpoint tiles in ``block``: ``block`` when the shard starts on a block boundary or lies
    inside one block, else gcd(block, start) (every local block then lies inside one of the
    checkpoint's)."""
    if start % block == 0 or start // block == (start + length - 1) // block:
        return block
    return math.gcd(block, start)


def shard_scale(scale: torch.Tensor, dim: int, start: int, length: int, block: int) -> torch.Tensor:
    """The checkpoint scales (tiles of ``block`` along ``dim``) of the shard [start, start +
    length), in units of :func:`shard_block`."""
    local = shard_block(start, length, block)
    if local == block:
        first = start // block
        return scale.narrow(dim, first, (start + length - 1) // block - first + 1)
    return scale.repeat_interleave(block // local, dim).narrow(
        dim, start // local, cdiv(length, local)
    )


def shard_rows(t: torch.Tensor, rank: int, size: int, unit: int = 1) -> torch.Tensor:
    n = t.shape[-2] if t.dim() > 1 else t.shape[0]
    if n % (unit * size):
        raise ValueError(
            f"cannot split {n} rows into {size} tensor-parallel shards of whole units of {unit}"
        )
    per = n // size
    return t.narrow(-2 if t.dim() > 1 else 0, rank * per, per)


def shard_cols(t: torch.Tensor, rank: int, size: int, unit: int = 1) -> torch.Tensor:
    n = t.shape[-1]
    if n % (unit * size):
        raise ValueError(
            f"cannot split {n} columns into {size} tensor-parallel shards of whole units of {unit}"
        )
    per = n // size
    return t.narrow(-1, rank * per, per)


def weight_block(arch) -> tuple[int, int] | None:
    """The e4m3 block the model holds its linears and routed experts in (None: full precision).
    ``arch`` is the model's ModelArch as the engine holds it (``vllm.config.quantization``)."""
    return arch.fp8_block_size if arch.is_fp8_checkpoint else None


class Linear(nn.Module):
    """y = x Wᵀ; W [out, in] of this rank's shard, e4m3 with block scales when ``quant_block``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        shard: str | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        shard_unit: int = 1,
        dtype: torch.dtype | None = None,
        quant_block: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.shard, self.tp_rank, self.tp_size, self.shard_unit = (
            shard,
            tp_rank,
            tp_size,
            shard_unit,
        )
        if shard == "col":
            out_features //= tp_size
        elif shard == "row":
            in_features //= tp_size
        self.in_features, self.out_features = in_features, out_features
        self.weight_scale_inv: nn.Parameter | None = None
        self.block = quant_block or (128, 128)
        if quant_block is None:
            self.weight = nn.Parameter(
                torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
            )
            return
        row0, col0 = self.shard_start
        self.checkpoint_block = quant_block
        self.block = (
            shard_block(row0, out_features, quant_block[0]),
            shard_block(col0, in_features, quant_block[1]),
        )
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False
        )
        self.weight_scale_inv = nn.Parameter(
            torch.empty(
                cdiv(out_features, self.block[0]),
                cdiv(in_features, self.block[1]),
                dtype=torch.float32,
            ),
            requires_grad=False,
        )

    @property
    def shard_start(self) -> tuple[int, int]:
        """(first row, first column) of this rank's shard in the full weight."""
        if self.shard == "col":
            return self.tp_rank * self.out_features, 0
        if self.shard == "row":
            return 0, self.tp_rank * self.in_features
        return 0, 0

    def shard_full(self, t: torch.Tensor) -> torch.Tensor:
        """Cut this rank's part out of a full (unsharded) checkpoint tensor."""
        if self.shard == "col":
            return shard_rows(t, self.tp_rank, self.tp_size, self.shard_unit)
        if self.shard == "row":
            return shard_cols(t, self.tp_rank, self.tp_size, self.shard_unit)
        return t

    def shard_full_scale(self, scale: torch.Tensor) -> torch.Tensor:
        """This rank's `weight_scale_inv` from the full checkpoint's (tiles of checkpoint_block)."""
        row0, col0 = self.shard_start
        bn, bk = self.checkpoint_block
        s = shard_scale(scale, 0, row0, self.out_features, bn)
        return shard_scale(s, 1, col0, self.in_features, bk)

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == FP8_DTYPE

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.is_fp8:
            return dequant_block_fp8(self.weight, self.weight_scale_inv, self.block, dtype)
        return self.weight.to(dtype)

    def forward(
        self, x: torch.Tensor, x_quant: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """``x_quant``: x already quantised by its producer (FP8 weights; see
        :func:`vllm.kernels.fp8_gemm.fp8_block_linear`)."""
        return linear_forward(x, self.weight, self.weight_scale_inv, self.block, x_quant)


def fuse_linears(parts: list[Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Stack the weights (and FP8 scales) of Linears that project the same input along the output
    rows, for one GEMM (and under FP8 one activation quantisation) instead of several; the parts'
    parameters become views of the stacked tensors, so the model's parameters keep their names
    and bytes (the loader copies each part's shard into its view). Returns (weight,
    weight_scale_inv or None) for :func:`linear_forward` with the parts' block, or None where they
    cannot be stacked: different inputs, dtypes, devices or TP shards (column shards of one rank
    stack: each is this rank's rows of its own weight), or FP8 scale tiles that would straddle two
    parts (every part but the last must end on a block row)."""
    first = parts[0]
    same = all(
        p.in_features == first.in_features
        and p.weight.dtype == first.weight.dtype
        and p.weight.device == first.weight.device
        and p.shard in (None, "col")
        and (p.shard, p.tp_rank, p.tp_size) == (first.shard, first.tp_rank, first.tp_size)
        and p.block == first.block
        for p in parts
    )
    if not same or (first.is_fp8 and any(p.out_features % first.block[0] for p in parts[:-1])):
        return None
    weight = torch.cat([p.weight.data for p in parts])
    scale = torch.cat([p.weight_scale_inv.data for p in parts]) if first.is_fp8 else None
    row = srow = 0
    for p in parts:
        p.weight.data = weight[row : row + p.out_features]
        row += p.out_features
        if scale is not None:
            n = p.weight_scale_inv.shape[0]
            p.weight_scale_inv.data = scale[srow : srow + n]
            srow += n
    return weight, scale


def linear_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    block: tuple[int, int],
    x_quant: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x Wᵀ for a weight in the model dtype (``scale`` None) or e4m3 with block scales
    (``x_quant``: x already quantised by its producer, see ``fp8_block_linear``)."""
    if scale is not None:
        return fp8_block_linear(x, weight, scale, block, x_quant)
    return nn.functional.linear(x, weight.to(x.dtype) if weight.dtype != x.dtype else weight)
