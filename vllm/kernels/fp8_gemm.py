"""FP8 block-scaled linear (w8a8, DeepSeek-V3 / upstream vLLM's block FP8 scheme).

    y[m, n] = Σ_kb  sx[m, kb] · sw[n // bn, kb] · Σ_{k in block kb} xq[m, k] · wq[n, k]   (fp32)

The weight is e4m3 [N, K] with one fp32 scale per (bn × bk) tile (``weight_scale_inv`` in
checkpoints: despite the name it multiplies, W = wq · scale). Activations are quantised on the fly
per token and per group of bk along K (:func:`per_token_group_quant_fp8`), so each K block is an
e4m3 × e4m3 product accumulated in fp32 and scaled by one activation scale per row and one weight
scale per output column. The dequantised [N, K] weight is never materialised (neither here nor in
the kernels). N and K need not be multiples of the block: the last tile is partial, its scale
covers the rows/columns that exist.

CUDA tensors: ``vllm/kernels/triton/fp8_gemm.py`` (per-token-group quant kernel + block-scaled
GEMM, configs by M from a fixed table, no host sync, CUDA-graph capturable) up to
``TRITON_MAX_M`` rows; at decode sizes the GEMM sums its split-K partials itself in a fixed order.
Above, cuBLASLt's DeepSeek-style block scaling through ``torch._scaled_mm`` on sm_90
(:func:`fp8_block_linear_cublas`, same quantiser): 1.6-1.9x Triton's speed from M = 256 on an
H200 (69-89 % of the fp8 peak at M >= 4096 but for the narrow kv_a, Triton 38-47 %), slower at
decode sizes (``docs/design/fp8.md``). Elsewhere the references below (a loop over K blocks,
memory O(M·N)).
"""

from __future__ import annotations

import contextlib

import torch

from vllm.kernels import kernel_module

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# amax floor of a quantisation group (upstream vLLM's eps): an all-zero group gets scale
# 1e-10 / 448 and quantises to zeros instead of dividing by zero
AMAX_FLOOR = 1e-10
# rows up to which CUDA calls take the Triton kernel, cuBLAS's block-scaled GEMM above: cold
# (weights rotated past the L2, x quantised by its producer), H100, 2026-12-07, at M = 64 the
# Triton 64 x 64 tile with 3 stages against cuBLAS: o_proj 48.6 / 51.0 µs, mlp down 39.6 / 41.0,
# stacked gate/up 59.5 / 65.2, q_b 16.4 / 19.0 (bench_fp8_gemm.py --sweep; docs/design/fp8.md);
# q_a + kv_a with 4 stages 14.4 / 21.0 (2026-12-06). cuBLAS is 1.6x faster from M = 256
TRITON_MAX_M = 64
# cuBLASLt wants the 1x128 activation scales' leading dimension (M, they are M-contiguous) 16-byte
# aligned, i.e. M % 4 == 0 (M = 1 was refused: CUBLAS_STATUS_NOT_SUPPORTED); the quantiser pads
# the rows to a multiple of 16, which costs nothing (cuBLAS's row tiles are >= 64) and also meets
# the fp8 operands' 16-element rule should it cover M
CUBLAS_ROW_MULTIPLE = 16

# which set of split-K arrival counters the Triton GEMM's launches use (``own_split_counters``)
_counter_set = 0


def split_counter_set() -> int:
    return _counter_set


@contextlib.contextmanager
def own_split_counters():
    """FP8 GEMMs queued inside this block reduce their K splits with a counter buffer of their
    own. One buffer serves launches that run one after another (each tile's last split zeroes its
    counter); GEMMs queued on a side stream may run at the same time as the main stream's (the
    MoE's shared expert beside the routed experts) and take this one."""
    global _counter_set
    prev, _counter_set = _counter_set, 1
    try:
        yield
    finally:
        _counter_set = prev


def per_token_group_quant_fp8(
    x: torch.Tensor, group: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32) -> (xq e4m3 [M, K], scale fp32 [M, ceil(K/group)]).

    Per row m and group g = columns [g·group, (g+1)·group) ∩ [0, K):
    scale[m, g] = max(amax |x[m, group]|, AMAX_FLOOR) / 448 and xq = x / scale (both IEEE fp32
    divisions, correctly rounded: the exact bits on every device; then round to nearest even into
    e4m3; |x / scale| <= 448 by construction, clamped anyway).
    xq · scale ≈ x with a relative error of at most 2^-4 per element (3 mantissa bits)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    fast = kernel_module("triton.fp8_gemm", x)
    if fast is not None:
        return fast.quant_per_token_group(x, group)
    return per_token_group_quant_fp8_ref(x, group)


def per_token_group_quant_fp8_ref(
    x: torch.Tensor, group: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of :func:`per_token_group_quant_fp8` (plain torch, fp32)."""
    m, k = x.shape
    ng = -(-k // group)
    pad = torch.zeros(m, ng * group, dtype=torch.float32, device=x.device)
    pad[:, :k] = x.float()
    tiles = pad.view(m, ng, group)
    amax = tiles.abs().amax(-1).clamp_min(AMAX_FLOOR)  # [M, ng]
    # IEEE fp32 amax / 448, as the kernels' div_rn. Divided by a tensor: CUDA torch turns
    # `t / 448.0` into t * fp32(1/448), one ulp off the quotient in ~60 % of groups, and bf16
    # inputs, 0.1 % of whose x / scale sit exactly on an e4m3 tie, then round the other way
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (tiles / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(m, ng * group)[:, :k]
    return q.to(FP8_DTYPE), scale


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block) -> None:
    n, k = weight.shape
    bn, bk = block
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"weight must be {FP8_DTYPE}, got {weight.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"x [..., {x.shape[-1]}] does not fit weight [{n}, {k}]")
    if scale.dtype != torch.float32:
        raise ValueError(f"weight_scale_inv must be float32, got {scale.dtype}")
    if tuple(scale.shape) != (-(-n // bn), -(-k // bk)):
        raise ValueError(
            f"weight_scale_inv {tuple(scale.shape)} != ceil(N/bn), ceil(K/bk) for weight "
            f"[{n}, {k}] and block {tuple(block)}"
        )


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    x_quant: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """y = x · Wᵀ with W = weight · scale block-wise (module docstring for the exact sum).

    x [..., K] bf16/fp16/fp32; weight e4m3 [N, K]; weight_scale_inv fp32 [ceil(N/bn), ceil(K/bk)]
    with block = (bn, bk). Activations are quantised per token per group of bk along K.
    Returns [..., N] in x.dtype (accumulated in fp32, rounded once at the end). ``x_quant``: x's
    quantisation done by its producer (:func:`takes_x_quant` says when the GEMM uses it; else x
    is quantised here, the same bytes)."""
    _check(x, weight, weight_scale_inv, block)
    bk = block[1]
    fast = kernel_module("triton.fp8_gemm", x, bk >= 16 and bk & (bk - 1) == 0)
    if fast is None:
        return fp8_block_linear_ref(x, weight, weight_scale_inv, block)
    m = x.numel() // max(1, x.shape[-1])
    if m > TRITON_MAX_M and cublas_supports(x, weight, block):
        return fp8_block_linear_cublas(x, weight, weight_scale_inv)
    return fast.fp8_block_gemm(x, weight, weight_scale_inv, block, x_quant=x_quant)


def takes_x_quant(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether :func:`fp8_block_linear` on CUDA runs the Triton GEMM for this call, which reads a
    producer's quantisation of x (``x_quant``) instead of quantising x itself."""
    m = x.numel() // max(1, x.shape[-1])
    return x.is_cuda and (m <= TRITON_MAX_M or not cublas_supports(x, weight, block))


def cublas_supports(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether :func:`fp8_block_linear_cublas` takes this call: an sm_90 GPU, block (128, 128),
    N and K multiples of 16, ceil(K/128) a multiple of 4 (the weight scales' leading dimension,
    16-byte aligned as cuBLASLt wants; GLM-5.3's K of 2048-16384 all qualify), a bf16/fp16 x
    (torch 2.11's checks in ``_scaled_mm``)."""
    n, k = weight.shape
    return (
        x.is_cuda
        and torch.cuda.get_device_capability(x.device) == (9, 0)
        and tuple(block) == (128, 128)
        and n % 16 == 0
        and k % 16 == 0
        and -(-k // 128) % 4 == 0
        and x.dtype in (torch.bfloat16, torch.float16)
    )


def fp8_block_linear_cublas(
    x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor
) -> torch.Tensor:
    """:func:`fp8_block_linear` by cuBLASLt's block scaling (``torch._scaled_mm`` with 1x128
    activation scales and 128x128 weight scales; :func:`cublas_supports` says when). Activations
    are quantised by the Triton kernel, whose M-contiguous scales are the layout cuBLAS wants, into
    rows padded to :data:`CUBLAS_ROW_MULTIPLE` (zero rows; their outputs are dropped); the weight
    scales go as their transposed view (scale_b [ceil(K/128), ceil(N/128)])."""
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return torch.empty(*lead, n, dtype=x.dtype, device=x.device)
    quant = kernel_module("triton.fp8_gemm", x).quant_per_token_group
    xq, sx = quant(x2, 128, CUBLAS_ROW_MULTIPLE)  # [M_pad, K], [M_pad, K/128] stride (1, M_pad)
    y = torch._scaled_mm(
        xq, weight.t(), scale_a=sx, scale_b=weight_scale_inv.t(), out_dtype=x.dtype
    )  # use_fast_accum stays False: cuBLAS refuses it with block scaling
    return y[:m].reshape(*lead, n)  # the first M rows of a contiguous [M_pad, N]: a view


def fp8_block_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """The reference of :func:`fp8_block_linear`: quantise x per token-group of bk, then for each
    K block add (xq_blk · wq_blkᵀ in fp32) · sx[:, kb] · sw[n // bn, kb]. Memory O(M·N + N·bk)."""
    _check(x, weight, weight_scale_inv, block)
    n, k = weight.shape
    bn, bk = block
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    xq, sx = per_token_group_quant_fp8_ref(x2, bk)
    sw = weight_scale_inv.float().repeat_interleave(bn, 0)[:n]  # [N, ceil(K/bk)]
    out = torch.zeros(x2.shape[0], n, dtype=torch.float32, device=x.device)
    for kb in range(sw.shape[1]):
        k0, k1 = kb * bk, min(k, (kb + 1) * bk)
        part = xq[:, k0:k1].float() @ weight[:, k0:k1].float().t()  # [M, N]
        out += part * sx[:, kb : kb + 1] * sw[:, kb][None, :]
    return out.to(x.dtype).reshape(*lead, n)


def fp8_block_linear_cost(
    m: int,
    n: int,
    k: int,
    block: tuple[int, int] = (128, 128),
    x_bytes: int = 2,
    quant_pass: bool = True,
) -> tuple[int, int]:
    """(flops, bytes) of one call: 2·M·N·K; the e4m3 weight and its scales read once, x read, y
    written in x's dtype, and with ``quant_pass`` (a separate quantisation kernel: cuBLAS, and
    the Triton path above its fused rows) xq and its scales written and read back. Without it,
    the bytes any implementation moves."""
    bn, bk = block
    ng = -(-k // bk)
    weight = n * k + -(-n // bn) * ng * 4
    acts = m * k * x_bytes + m * n * x_bytes
    if quant_pass:
        acts += 2 * (m * k + m * ng * 4)
    return 2 * m * n * k, weight + acts
