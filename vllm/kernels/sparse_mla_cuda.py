"""FP8 sparse-MLA decode in CUDA C++ for Hopper: the Python wrapper of ``vllm._C``'s
``sparse_mla_fp8_decode`` (``csrc/attention/sparse_mla_fp8_sm90.cu``; its header comment is the
design), built ahead of time by ``setup.py``.

Same function as the Triton sparse-MLA kernel on fp8_ds_mla rows at GLM-5.3's dims (kv_lora 512,
rope 64, <= 64 heads). Numerics differ from the Triton/Gluon kernels in two places, both with
11-bit (f16) instead of 8-bit (bf16) operand rounding:
- QK runs in f16: e4m3 -> f16 is exact; the tile scale is normalised by the row's largest scale
  and the query by a power of two, both undone in fp32.
- PV runs in f16: V = e4m3 times the tile scale over the row's largest power of two, rounded to
  f16 (within 2^-10 of the exact product); P carries that power of two against a CTA-wide
  stabiliser. A block whose scales f16 cannot hold (a tile scale under 2^-11 of its row's
  largest, or a row's largest ~2^10 below the largest seen so far; larger rows move the
  stabiliser) takes the exact bf16 PV: values rounded like the reference (fp32 e4m3 · scale ->
  bf16).
With bf16 output, a token cut between CTAs is merged from bf16 partials (one more bf16 rounding
of a partial before the output's own).

The launch runs on torch's current stream, so CUDA-graph capture records it like any other
kernel; its workspaces come from torch's allocator (the graph's pool under capture).
"""

from __future__ import annotations

import functools

import torch

from vllm import _custom_ops as ops

BLOCK_N = 64  # rows per block of a token's top-k list
ROW_BYTES = 656
D_V = 512
LOG2E = 1.4426950408889634
MIN_BLOCKS_PER_CTA = 4  # fewer 64-row blocks per CTA only add split pieces to merge
MAX_PIECES = 8  # pieces of one token the kernel's merge takes (its shared-memory weights)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_available(device: torch.device) -> str | None:
    """None if the kernel can run on ``device``, else why not."""
    if device.type != "cuda":
        return "needs a CUDA device"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "needs an sm_90 (Hopper) GPU"
    return ops.native_ops_error()


_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def _counters(device: torch.device, stream: int, n: int) -> torch.Tensor:
    """Zeroed int32 [>= n] counters for a launch on ``stream`` (two per token). The kernel leaves
    them zero (the merging piece re-zeroes its token's), so one buffer serves every launch of a
    stream, which runs them in order."""
    key = (device.index, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_ctas(t: int, nb: int, num_sms: int) -> int:
    """The grid size: ``t`` CTAs (one token each, in hardware-scheduled waves) from
    ``t >= num_sms / 2`` up, else each token cut into ``num_sms // t`` equal pieces (at most
    ``MAX_PIECES``, at least ``MIN_BLOCKS_PER_CTA`` blocks each) so the SMs are used.
    Measured on an H200 in one process: 0.889 ms at 1024 tokens on 1024 CTAs against 0.902 on
    132 (every SM the same number of blocks, ~130 tokens cut), and 0.108 against 0.132 ms at 128
    tokens: each cut costs a second query prologue, a pipeline restart and a merge. 64 tokens on
    128 CTAs: 0.067 ms."""
    pieces = max(1, min(num_sms // max(t, 1), MAX_PIECES, nb // MIN_BLOCKS_PER_CTA))
    return t * pieces


def sparse_mla_fp8_cuda(
    q: torch.Tensor,
    kv_rows: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    out_dtype: torch.dtype,
    num_ctas: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H<=64, 576] (bf16; other dtypes are converted), kv_rows uint8 [rows, 656] fp8_ds_mla,
    indices [T, K] int32 row ids (−1 = none). Returns (out [1, T, H, 512] ``out_dtype`` (bf16 or
    fp32), lse [1, T, H] fp32 natural log; −inf and zeros for a token with no valid row), the
    leading 1 like the single slice of :func:`vllm.kernels.sparse_mla_ws.sparse_mla_ws`.

    ``num_ctas`` CTAs (default :func:`default_ctas`; at most as many as keep every token within
    ``MAX_PIECES`` CTAs) share the T · ⌈K/64⌉ blocks of 64 rows equally in contiguous ranges; a
    token cut between CTAs is merged inside the kernel."""
    t, h, d = q.shape
    if h > 64 or d != 576:
        raise ValueError(f"the CUDA sparse-MLA kernel takes [T, <=64, 576] queries, got {q.shape}")
    if kv_rows.dtype != torch.uint8 or kv_rows.dim() != 2 or kv_rows.shape[1] != ROW_BYTES:
        raise ValueError(f"kv_rows must be uint8 [rows, {ROW_BYTES}] fp8_ds_mla rows")
    if kv_rows.stride(1) != 1 or kv_rows.stride(0) != ROW_BYTES or kv_rows.data_ptr() % 16:
        raise ValueError("kv_rows must be contiguous 656-byte rows, 16-byte aligned")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be bf16 or fp32, got {out_dtype}")
    if q.dtype != torch.bfloat16:
        q = q.to(torch.bfloat16)
    if q.stride(2) != 1 or q.stride(1) % 8 or q.stride(0) % 8 or q.data_ptr() % 16:
        q = q.contiguous()
    if indices.dtype != torch.int32 or indices.stride(-1) != 1:
        indices = indices.to(torch.int32).contiguous()
    k = indices.shape[1]
    out = torch.empty(t, h, D_V, dtype=out_dtype, device=q.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=q.device)
    if t == 0:
        return out.unsqueeze(0), lse.unsqueeze(0)
    if not ops.has_native_ops():
        raise RuntimeError(f"the CUDA sparse-MLA kernel is unavailable: {ops.native_ops_error()}")
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    nb = max(1, _cdiv(k, BLOCK_N))  # K = 0: one block of -1 rows (zeros, -inf)
    work = t * nb
    if work >= 2**31:
        raise ValueError(f"T * ceil(K / 64) = {work} work items: the kernel counts them in int32")
    ctas = num_ctas or default_ctas(t, nb, _num_sms(dev))
    # every CTA's range at least ceil((nb - 1) / (MAX_PIECES - 1)) blocks: a token then spans at
    # most MAX_PIECES CTAs
    ctas = max(1, min(ctas, work // max(1, _cdiv(nb - 1, MAX_PIECES - 1))))
    ws_o = torch.empty(2 * ctas, 64, D_V, dtype=torch.float32, device=q.device)
    ws_l = torch.empty(2 * ctas, 64, dtype=torch.float32, device=q.device)
    stream = torch.cuda.current_stream(dev).cuda_stream
    counters = _counters(q.device, stream, 2 * t)  # [2t]: tickets, partials written
    ops.sparse_mla_fp8_decode(
        q, kv_rows, indices, out, lse, ws_o, ws_l, counters, sm_scale * LOG2E, ctas
    )
    return out.unsqueeze(0), lse.unsqueeze(0)


__all__ = ["sparse_mla_fp8_cuda", "is_available", "default_ctas"]
