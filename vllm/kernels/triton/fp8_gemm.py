"""FP8 block-scaled linear in Triton: per-token-group activation quantisation and the w8a8
block-scaled GEMM (spec and references: :mod:`vllm.kernels.fp8_gemm`).

    quant_per_token_group(x, group)        == per_token_group_quant_fp8_ref(x, group)   (bit-exact)
    fp8_block_gemm(x, weight, scale, block) ≈ fp8_block_linear_ref(...)   (fp32 sum order only)

Naive path and its traffic: dequantising the weight to bf16 and calling F.linear reads N·K fp8
bytes, writes and reads back 2·N·K bf16 bytes, then runs a bf16 GEMM: 5x the weight traffic of
this path at decode sizes, and half the tensor-core rate at prefill sizes.

GEMM: one program per (BLOCK_M × BLOCK_N) output tile and K split; BLOCK_K = bk, so each K step
is one scale group: acc += dot(xq_tile, wq_tileᵀ) · sx[:, kb] · sw[n // bn, kb] (e4m3 × e4m3 on
the tensor cores, fp32 accumulate; the scale multiply per K block, as DeepSeek-V3 does). Tiles
come from a fixed table by M (:func:`gemm_config`), not autotuned, so the serving path compiles a
handful of variants at warm-up and never times configurations. Decode sizes (M <= 64) use 16- to
64-row tiles; a grid of fewer than two programs per SM (decode, narrow N) splits K until it covers
the GPU twice (each split writes fp32 partials, summed by one torch reduction in a fixed order:
deterministic, no atomics). Nothing
reads a device value on the host: CUDA-graph capturable.

Quantisation: one program per row and BLOCK_G groups; IEEE division for the scale and the
quotient (``div_rn``, as the reference's fp32 tensor-by-tensor ``/``), round to nearest even into
e4m3 (sm_90's cvt.rn.satfinite; inputs are clamped to ±448 first, so saturation never differs from
torch's cast). Scales are stored M-contiguous ([ng, M] storage, returned as the transposed view
[M, ng]): coalesced loads in the GEMM, and the layout cuBLAS's 1x128 block scaling wants, whose
rows the caller may pad (``row_multiple``). The CPU interpreter mis-rounds fp32 -> e4m3 and bf16
arithmetic, so there the encoder is the exact integer one and operands are fp32 after loading.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm.kernels.fp8_gemm import AMAX_FLOOR, FP8_DTYPE, FP8_MAX
from vllm.kernels.triton.utils import check_cuda_or_interpreter, e4m3_bits, interpreting, record

__all__ = ["quant_per_token_group", "fp8_block_gemm", "gemm_config"]

# decided once, when the kernels are defined (Triton binds to the interpreter at import)
_UPCAST = interpreting()


@triton.jit
def _group_quant_kernel(
    x_ptr,  # [M, K] bf16/fp16/fp32, strides (stride_xm, 1)
    q_ptr,  # uint8 view of e4m3 [M_pad, K], strides (stride_qm, 1)
    s_ptr,  # fp32 [M_pad, ng], strides (stride_sm, stride_sg)
    M,  # rows of x; rows M..M_pad-1 of q and s are written as an all-zero row's
    K,
    num_groups,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sg,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    SOFT_FP8: tl.constexpr,  # interpreter: exact integer e4m3 encoder
):
    row = tl.program_id(0).to(tl.int64)
    offs_g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BLOCK_G]
    cols = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [BLOCK_G, GROUP]
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask & (row < M), other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), FLOOR), QMAX)  # [BLOCK_G]
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    tl.store(q_ptr + row * stride_qm + cols, e4m3_bits(q, SOFT_FP8), mask=mask)
    tl.store(s_ptr + row * stride_sm + offs_g * stride_sg, scale, mask=offs_g < num_groups)


def quant_per_token_group(
    x: torch.Tensor, group: int = 128, row_multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq e4m3 [M_pad, K], scale fp32 [M_pad, ceil(K/group)] as an M-contiguous view)
    with M_pad = M rounded up to ``row_multiple``; the padding rows are an all-zero row's (xq 0,
    scale AMAX_FLOOR / 448), for callers whose GEMM needs aligned rows (cuBLAS's 1x128 scales).

    Spec: :func:`vllm.kernels.fp8_gemm.per_token_group_quant_fp8`; ``group`` a power of two."""
    check_cuda_or_interpreter(x)
    m, k = x.shape
    m_pad = -(-m // row_multiple) * row_multiple
    ng = triton.cdiv(k, group)
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty(m_pad, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(ng, m_pad, dtype=torch.float32, device=x.device).t()  # [M_pad, ng], (1, M_pad)
    if m_pad == 0 or k == 0:
        return q, s
    block_g = min(8, triton.next_power_of_2(ng))
    grid = (m_pad, triton.cdiv(ng, block_g))
    _group_quant_kernel[grid](
        x, q.view(torch.uint8), s, m, k, ng, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
        GROUP=group, BLOCK_G=block_g, FLOOR=AMAX_FLOOR, QMAX=FP8_MAX, SOFT_FP8=_UPCAST, num_warps=4,
    )  # fmt: skip
    return q, s


@triton.jit
def _block_gemm_kernel(
    a_ptr,  # e4m3 [M, K], strides (stride_am, 1)
    as_ptr,  # fp32 [M, ceil(K/BLOCK_K)], strides (stride_asm, stride_ask)
    w_ptr,  # e4m3 [N, K], strides (stride_wn, 1)
    ws_ptr,  # fp32 [ceil(N/group_n), ceil(K/BLOCK_K)], strides (stride_wsn, stride_wsk)
    out_ptr,  # [SPLIT, M, N] fp32 partials, or [M, N] in x.dtype when SPLIT = 1
    M,
    N,
    K,
    group_n,
    k_blocks_per_split,
    stride_am,
    stride_asm,
    stride_ask,
    stride_wn,
    stride_wsn,
    stride_wsk,
    stride_os,
    stride_om,
    UPCAST: tl.constexpr,  # interpreter: fp32 operands (its fp8/bf16 arithmetic is wrong)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # = the scale group along K
    GROUP_M: tl.constexpr,  # row tiles per L2 group (prefill: weight tiles reused from L2)
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    kb0 = pid_k * k_blocks_per_split
    kb1 = tl.minimum(kb0 + k_blocks_per_split, tl.cdiv(K, BLOCK_K))
    # [BLOCK_M, BLOCK_K] and [BLOCK_K, BLOCK_N] tiles, both K-contiguous (what fp8 wgmma takes)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + (kb0 * BLOCK_K + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + (kb0 * BLOCK_K + offs_k)[:, None]
    as_ptrs = as_ptr + offs_m * stride_asm + kb0 * stride_ask  # [BLOCK_M]
    ws_ptrs = ws_ptr + (offs_n // group_n) * stride_wsn + kb0 * stride_wsk  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in range(kb0, kb1):
        kmask = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        sa = tl.load(as_ptrs, mask=mmask, other=0.0)
        sw = tl.load(ws_ptrs, mask=nmask, other=0.0)
        if UPCAST:
            part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, w)
        acc += part * sa[:, None] * sw[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        as_ptrs += stride_ask
        ws_ptrs += stride_wsk
    o_ptrs = (
        out_ptr + pid_k * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    )
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: as an H200
    return torch.cuda.get_device_properties(device).multi_processor_count


# Tiles by M (untuned starting points after upstream vLLM's H200 block-FP8 tables; swept by
# benchmarks/kernels/bench_fp8_gemm.py --sweep): (max M, block_m, block_n, num_warps, num_stages)
TILES = [
    (16, 16, 64, 4, 4),
    (32, 32, 64, 4, 4),
    (64, 64, 64, 4, 4),
    (256, 64, 128, 4, 4),
    (1 << 62, 128, 128, 8, 3),
]
# grids smaller than this many programs per SM split K (at least 4 K blocks per split)
SPLIT_PROGRAMS_PER_SM = 2


def gemm_config(
    m: int, n: int, k: int, block_k: int, num_sms: int, tile: tuple | None = None
) -> dict:
    """The fixed config for an [M, K] x [N, K]ᵀ call: tile sizes from :data:`TILES` (or ``tile``
    = (block_m, block_n, num_warps, num_stages), the benchmark's sweep) and the K split that
    fills the GPU when the output has few tiles (decode sizes; narrow N such as kv_a's 576)."""
    block_m, block_n, warps, stages = tile or next(t[1:] for t in TILES if m <= t[0])
    nkb = triton.cdiv(k, block_k)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = max(1, min(nkb // 4, SPLIT_PROGRAMS_PER_SM * num_sms // tiles))
    per_split = triton.cdiv(nkb, split)
    return dict(
        block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages,
        split_k=triton.cdiv(nkb, per_split), k_blocks_per_split=per_split, group_m=8,
    )  # fmt: skip


def fp8_block_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    cfg: dict | None = None,
) -> torch.Tensor:
    """:func:`vllm.kernels.fp8_gemm.fp8_block_linear` on the GPU (spec there). ``cfg`` overrides
    :func:`gemm_config` (tests and the benchmark's sweep)."""
    check_cuda_or_interpreter(x, weight, weight_scale_inv)
    n, k = weight.shape
    bn, bk = block
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return torch.empty(*lead, n, dtype=x.dtype, device=x.device)
    if k == 0:
        return torch.zeros(*lead, n, dtype=x.dtype, device=x.device)
    xq, sx = quant_per_token_group(x2, bk)
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    cfg = cfg or gemm_config(m, n, k, bk, _num_sms(x.device))
    split = cfg["split_k"]
    if split == 1:
        dst = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        dst = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg["block_m"]) * triton.cdiv(n, cfg["block_n"]), split)
    compiled = _block_gemm_kernel[grid](
        xq, sx, weight, weight_scale_inv, dst, m, n, k, bn, cfg["k_blocks_per_split"],
        xq.stride(0), sx.stride(0), sx.stride(1), weight.stride(0),
        weight_scale_inv.stride(0), weight_scale_inv.stride(1),
        dst.stride(0) if split > 1 else 0, dst.stride(-2),
        UPCAST=_UPCAST, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=bk,
        GROUP_M=cfg["group_m"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    record("fp8_gemm", compiled)
    out = dst if split == 1 else dst.sum(0).to(x.dtype)
    return out.reshape(*lead, n)
