"""The compiled ops of ``vllm._C`` (``csrc/``, built ahead of time by ``setup.py`` through
``CMakeLists.txt`` on a CUDA machine), as typed Python functions. This is the one module that
imports the extension; kernel wrappers (``vllm/kernels/``) call the functions here.

Where the extension is not built (CPU machines, an install without torch or nvcc in the build
environment) :func:`has_native_ops` is False and callers take their Triton or torch paths.
"""

from __future__ import annotations

import torch

from vllm.utils import logger

try:
    import vllm._C  # noqa: F401  (loading the library registers torch.ops._C.*)

    _C_ERROR: str | None = None
except ModuleNotFoundError:
    _C_ERROR = "vllm._C is not built: install on a CUDA machine with `pip install --no-build-isolation -e .`"
except ImportError as e:  # built, but it does not load (e.g. built against another torch)
    _C_ERROR = (
        f"vllm._C failed to load ({e}): rebuild it with `pip install --no-build-isolation -e .`"
    )
    logger.warning(_C_ERROR)


def has_native_ops() -> bool:
    """Whether ``vllm._C`` is loaded (its ops are in ``torch.ops._C``)."""
    return _C_ERROR is None


def native_ops_error() -> str | None:
    """None if ``vllm._C`` is loaded, else why not (not built, or failed to load)."""
    return _C_ERROR


def sparse_mla_fp8_decode(
    q: torch.Tensor,
    kv_rows: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    ws_o: torch.Tensor,
    ws_l: torch.Tensor,
    counters: torch.Tensor,
    scale_log2: float,
    num_ctas: int,
) -> None:
    """FP8 sparse-MLA decode on Hopper (``csrc/attention/sparse_mla_fp8_sm90.cu``), on the
    current stream: writes out [T, H, 512] and lse [T, H] for q [T, H<=64, 576] bf16 over
    kv_rows uint8 [rows, 656] at indices [T, K] int32, on a grid of ``num_ctas`` CTAs.
    ws_o [>= 2 num_ctas, 64, 512] / ws_l [>= 2 num_ctas, 64] fp32 hold the partials of tokens cut
    between CTAs; counters int32 [>= 2T] must be zero and are left zero. ``scale_log2`` is the
    softmax scale times log2(e). The checked contract and its defaults:
    :func:`vllm.kernels.sparse_mla_cuda.sparse_mla_fp8_cuda`."""
    torch.ops._C.sparse_mla_fp8_decode(
        q, kv_rows, indices, out, lse, ws_o, ws_l, counters, scale_log2, num_ctas
    )


def has_moe_grouped_fp8_gemm() -> bool:
    """Whether ``vllm._C`` was built with the CUTLASS grouped GEMM (CUTLASS's headers present at
    build time: ``pip install nvidia-cutlass`` before building)."""
    return has_native_ops() and hasattr(torch.ops._C, "moe_grouped_fp8_gemm")


def moe_grouped_fp8_gemm(
    a: torch.Tensor,
    sa: torch.Tensor,
    w: torch.Tensor,
    sw: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """FP8 grouped GEMM with block-wise scales on Hopper (``csrc/moe/moe_grouped_fp8_sm90.cu``),
    on the current stream: out bf16 [P, N] rows [offsets[e], offsets[e + 1]) = those rows of a
    e4m3 [P, K] (scales sa fp32 [K/128 · P], group-major: group e's [K/128, m_e] block at
    K/128 · offsets[e]) times w[e]ᵀ (e4m3 [E, N, K], scales sw fp32 [E, K/128, N/128]); offsets
    int32 [E + 1] on the device. Spec and reference:
    :func:`vllm.kernels.moe_cutlass.grouped_gemm_ref`."""
    torch.ops._C.moe_grouped_fp8_gemm(a, sa, w, sw, offsets, out)
