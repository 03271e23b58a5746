"""Linear layers with optional FP8 block-quantised weights and tensor-parallel sharding.

A checkpoint's FP8 weight (e4m3, with a `weight_scale_inv` of one fp32 per 128×128 tile) is
dequantised at load on CPU; on CUDA it is kept in FP8 and dequantised tile-wise in the matmul path.
`shard` says how tensor parallelism splits the weight: "col" splits the output rows (optionally in
units of `shard_unit` rows, i.e. whole heads), "row" splits the input columns, None replicates.
"""

from __future__ import annotations

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn


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
    """Inverse of :func:`dequant_block_fp8` with scale = tile amax / 448 (writes FP8 checkpoints)."""
    n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    pad = torch.zeros(gn * bn, gk * bk, dtype=torch.float32)
    pad[:n, :k] = w.float()
    tiles = pad.view(gn, bn, gk, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).clamp(-448, 448).view(gn * bn, gk * bk)[:n, :k]
    return q.to(FP8_DTYPE).contiguous(), scale


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


class Linear(nn.Module):
    """y = x Wᵀ; W [out, in] of this rank's shard."""

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
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        self.weight_scale_inv: nn.Parameter | None = None
        self.block = (128, 128)

    def shard_full(self, t: torch.Tensor) -> torch.Tensor:
        """Cut this rank's part out of a full (unsharded) checkpoint tensor."""
        if self.shard == "col":
            return shard_rows(t, self.tp_rank, self.tp_size, self.shard_unit)
        if self.shard == "row":
            return shard_cols(t, self.tp_rank, self.tp_size, self.shard_unit)
        return t

    def set_fp8(
        self, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
    ) -> None:
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale_inv.float(), requires_grad=False)
        self.block = block

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == FP8_DTYPE

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.is_fp8:
            return dequant_block_fp8(self.weight, self.weight_scale_inv, self.block, dtype)
        return self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.dense_weight(x.dtype) if self.is_fp8 else self.weight
        return nn.functional.linear(x, w.to(x.dtype) if w.dtype != x.dtype else w)
