"""Small helpers shared by the kernels: interpreter detection and exact soft conversions.

Triton's CPU interpreter (TRITON_INTERPRET=1) mis-rounds fp32 -> e4m3/bf16 conversions and bf16
arithmetic, so interpreter-tested paths load everything as fp32 and, where bytes must match the
reference exactly, use the integer encoders below (also exact on the GPU, where the hardware
conversions are used instead because they are cheaper).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (decided when kernels are defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if not interpreting():
    from triton.language.extra import libdevice
else:  # the interpreter has no libdevice; tl.exp is numpy's there
    libdevice = None


@triton.jit
def exp_f32(x, USE_LIBDEVICE: tl.constexpr):
    """exp(x) in fp32 by libdevice's correctly rounded ``expf`` (torch's CUDA sigmoid and SiLU
    use it; ``tl.exp`` is a faster approximation) where USE_LIBDEVICE, else ``tl.exp`` (the
    interpreter: numpy's)."""
    if USE_LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def log_f32(x, USE_LIBDEVICE: tl.constexpr):
    """log(x) in fp32 by libdevice's ``logf`` (torch's CUDA log) where USE_LIBDEVICE, else
    ``tl.log``."""
    if USE_LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def prev_pow2(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (int(n).bit_length() - 1)


def dot_dtype(device: torch.device):
    """Operand type of the bf16 tensor-core path: fp32 in the interpreter (its bf16 is wrong)."""
    return tl.float32 if device.type == "cpu" else tl.bfloat16


LAST_COMPILED: dict[str, object] = {}


def record(name: str, compiled) -> None:
    """Keep the last compiled kernel per op, for the benchmarks' resource report."""
    if compiled is not None:
        LAST_COMPILED[name] = compiled


def resource_report(name: str) -> str:
    """'regs R spills S smem B' of the op's last compiled kernel (the compiler's report)."""
    k = LAST_COMPILED.get(name)
    if k is None:
        return ""
    return f"regs {k.n_regs} spills {k.n_spills} smem {k.metadata.shared}"


def check_cuda_or_interpreter(*tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    if any(t.device != dev for t in tensors):
        raise ValueError("all tensors must be on one device")
    if dev.type != "cuda" and not interpreting():
        raise ValueError(f"Triton kernels need CUDA tensors or TRITON_INTERPRET=1, got {dev}")


@triton.jit
def e4m3_bits_soft(x):
    """fp32 (finite, |x| <= 448) -> e4m3fn bit pattern, round to nearest even, as uint8."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(x)
    abits = a.to(tl.int32, bitcast=True)
    # normal range (>= 2^-6): round the fp32 mantissa to 3 bits, carry runs into the exponent
    r = abits + 0x7FFFF + ((abits >> 20) & 1)
    code_normal = (r >> 20) - (120 << 3)  # rebias the exponent 127 -> 7
    # subnormal range: multiples of 2^-9, rounded to nearest even by the 2^23 trick
    code_sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a >= 0.015625, code_normal, code_sub)
    return (code | sign).to(tl.uint8)


@triton.jit
def e4m3_bits(x, SOFT: tl.constexpr):
    """fp32 (finite, |x| <= 448) -> e4m3fn bits (uint8), RNE; hardware cvt on the GPU."""
    if SOFT:
        return e4m3_bits_soft(x)
    else:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def bf16_bits(x):
    """fp32 (finite) -> bf16 bit pattern as int16, round to nearest even (exact everywhere)."""
    bits = x.to(tl.int32, bitcast=True)
    r = bits + 0x7FFF + ((bits >> 16) & 1)
    return (r >> 16).to(tl.int16)
