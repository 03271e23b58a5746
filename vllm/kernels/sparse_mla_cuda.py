"""FP8 sparse-MLA decode in CUDA C++ for Hopper: build, load and launch
``vllm/kernels/cuda/sparse_mla_fp8_sm90.cu`` (its header comment is the design).

Same function as :func:`vllm.kernels.sparse_mla_fwd.sparse_mla_fwd` on fp8_ds_mla rows at GLM-5.3's
dims (kv_lora 512, rope 64, <= 64 heads): the default for FP8 decode calls of more than 32 heads on
sm_90, and selected for every FP8 decode call with ``kernel="cuda"`` or
``VLLM_SPARSE_MLA_KERNEL=cuda``. Numerics differ from the Triton/Gluon kernels in two places,
both with 11-bit (f16) instead of 8-bit (bf16) operand rounding:
- QK runs in f16: e4m3 -> f16 is exact; the tile scale is normalised by the row's largest scale
  and the query by a power of two, both undone in fp32.
- PV runs in f16 (``PV_F16``): V = e4m3 times the tile scale over the row's largest power of two,
  rounded to f16 (within 2^-10 of the exact product); P carries that power of two against a
  CTA-wide stabiliser. A block whose scales f16 cannot hold (a tile scale under 2^-11 of its
  row's largest, or a row's largest ~2^10 below the largest seen so far; larger rows move the
  stabiliser) takes the exact bf16 PV: values rounded like the reference (fp32 e4m3 · scale ->
  bf16).

The kernel is compiled at first use by ``nvcc`` (``$VLLM_NVCC``, else ``$CUDA_HOME/bin/nvcc``,
else ``nvcc`` on ``PATH``) for sm_90a into ``$VLLM_CACHE_ROOT/cuda`` (default ``~/.cache/vllm``),
keyed by the source's hash, and launched through the CUDA driver API on torch's current stream,
so CUDA-graph capture records it like any other kernel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from vllm.utils import logger

SRC = Path(__file__).with_name("cuda") / "sparse_mla_fp8_sm90.cu"
KERNEL_NAME = "sparse_mla_fp8_sm90"
NVCC_FLAGS = ["-cubin", "-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a"]
THREADS = 384
BLOCK_N = 64
ROW_BYTES = 656
D_V = 512


def _smem_bytes() -> int:
    """The kernel's dynamic shared memory, mirrored from the .cu's constexpr layout."""
    pbuf = 3
    qt, pt = 9 * 8192, pbuf * 8192
    stages = 3 * BLOCK_N * ROW_BYTES
    ids, red, alpha, ell, misc = 3 * BLOCK_N * 4, 2 * 4 * 64 * 4, pbuf * 64 * 4, 64 * 4, 64
    m, flags, bars, sig, ex, ctl, qf = 64 * 4, 16, 12 * 8, pbuf * 4 * 64 * 2, 48, 16, 64 * 4
    return (
        qt + pt + stages + ids + red + alpha + ell + misc + m + flags + bars + sig + ex + ctl + qf
        + 1024
    )  # fmt: skip


SMEM_ALLOC = _smem_bytes()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def nvcc_path() -> str | None:
    for cand in (
        os.environ.get("VLLM_NVCC"),
        os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"),
        shutil.which("nvcc"),
    ):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def compile_cubin(extra_flags: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """Build (or fetch from the cache) the sm_90a cubin; returns (cubin bytes, ptxas report)."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("the CUDA sparse-MLA kernel needs nvcc (set VLLM_NVCC or CUDA_HOME)")
    flags = NVCC_FLAGS + ["-Xptxas", "-v"] + list(extra_flags)
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    sources = b"".join(f.read_bytes() for f in sorted(SRC.parent.glob("*.cu*")))  # .cu + .cuh
    key = hashlib.sha256(sources + " ".join(flags).encode() + version.encode())
    root = Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm")) / "cuda"
    cubin = root / f"{KERNEL_NAME}-{key.hexdigest()[:16]}.cubin"
    report = cubin.with_suffix(".log")
    if cubin.is_file() and report.is_file():
        return cubin.read_bytes(), report.read_text()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        out = Path(tmp) / "k.cubin"
        res = subprocess.run(
            [nvcc, *flags, "-o", str(out), str(SRC)], capture_output=True, text=True
        )
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed on {SRC.name}:\n{res.stderr[-4000:]}")
        log = res.stdout + res.stderr
        os.replace(out, cubin)
        report.write_text(log)
    return cubin.read_bytes(), log


def ptxas_resources(log: str) -> dict[str, int]:
    """Registers, stack frame and spill bytes from ``-Xptxas -v``, and whether ptxas serialised
    the wgmmas (warning C7514/C7515: each wgmma then waits for the previous one)."""
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else -1  # noqa: E731
    return {
        "registers": num(r"Used (\d+) registers"),
        "stack_frame": num(r"(\d+) bytes stack frame"),
        "spill_stores": num(r"(\d+) bytes spill stores"),
        "spill_loads": num(r"(\d+) bytes spill loads"),
        "wgmma_serialized": int("wgmma.mma_async instructions are serialized" in log),
    }


class _Driver:
    """The few CUDA driver calls we need, through ctypes (no extra Python package)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")

    def check(self, rc: int, what: str):
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {name.value.decode() if name.value else rc}")

    def load(
        self, cubin: bytes, name: str = KERNEL_NAME, smem: int | None = None
    ) -> ctypes.c_void_p:
        """Kernel ``name`` of ``cubin``, allowed ``smem`` bytes of dynamic shared memory (default:
        this kernel's SMEM_ALLOC)."""
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            raise RuntimeError("no current CUDA context (torch has not initialised this device)")
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
        self.check(
            self.lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()),
            "cuModuleGetFunction",
        )
        # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
        smem = SMEM_ALLOC if smem is None else smem
        self.check(self.lib.cuFuncSetAttribute(fn, 8, smem), "cuFuncSetAttribute")
        return fn

    def launch(self, fn, grid: tuple[int, int], stream: int, args: list, threads: int = THREADS,
               smem: int | None = None):  # fmt: skip
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        self.check(
            self.lib.cuLaunchKernel(
                fn, grid[0], grid[1], 1, threads, 1, 1, SMEM_ALLOC if smem is None else smem,
                ctypes.c_void_p(stream),
                params, None,
            ),
            "cuLaunchKernel",
        )  # fmt: skip


@functools.lru_cache(maxsize=1)
def _driver() -> _Driver:
    return _Driver()


def parse_defines(spec: str) -> dict[str, int]:
    """'NAME=V,NAME=V' (the .cu's -D knobs) -> {NAME: V}; '' -> {}."""
    try:
        return {k: int(v) for k, v in (kv.split("=") for kv in filter(None, spec.split(",")))}
    except ValueError:
        raise ValueError(f"build knobs must be 'NAME=int,...', got {spec!r}") from None


# build knobs of the .cu (see its header), for sweeps and tests of a variant
DEFINES: dict[str, int] = parse_defines(os.environ.get("VLLM_SPARSE_MLA_CUDA_DEFINES", ""))


@functools.lru_cache(maxsize=16)
def _function(device_index: int, defines: tuple[tuple[str, int], ...]):
    flags = tuple(f"-D{k}={v}" for k, v in defines)
    with torch.cuda.device(device_index):
        torch.cuda.current_stream()  # make torch's (primary) context current on this thread
        return _driver().load(compile_cubin(flags)[0])


def is_available(device: torch.device) -> str | None:
    """None if the kernel can run on ``device``, else why not."""
    if device.type != "cuda":
        return "needs a CUDA device"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "needs an sm_90 (Hopper) GPU"
    if nvcc_path() is None:
        return "needs nvcc to build it (VLLM_NVCC / CUDA_HOME)"
    return None


@functools.lru_cache(maxsize=16)
def _build_error(device_index: int, defines: tuple[tuple[str, int], ...]) -> str | None:
    try:
        _function(device_index, defines)
    except RuntimeError as e:  # nvcc failed, or the driver refused the cubin
        logger.warning("the CUDA sparse-MLA kernel is unavailable: %s", str(e)[:2000])
        return f"failed to build or load ({str(e)[:200]})"
    return None


def build_error(device: torch.device) -> str | None:
    """Builds and loads the kernel for ``device`` (once: cached on disk and in the process), in
    both builds the launcher picks between (:func:`launch_defines`); None if that worked, else
    why not. The default dispatch uses the Gluon kernel then."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    for split in (True, False):
        err = _build_error(index, launch_defines(split))
        if err:
            return err
    return None


def splits_tokens(t: int, ctas: int) -> bool:
    """Whether a grid of ``ctas`` CTAs over ``t`` tokens cuts some token between CTAs: the G
    equal ranges of the W = t * nb (token, block) items are whole tokens exactly when G divides
    t (for G < t not dividing it, this answers True even where the cuts happen to align)."""
    return t % ctas != 0


def launch_defines(split: bool) -> tuple[tuple[str, int], ...]:
    """The build knobs of a launch: ``DEFINES``, plus ``PARTIAL_BF16=0`` where no token is cut
    between CTAs (``split`` False) and ``DEFINES`` does not set it. The merge code never runs
    there, and that build's register allocation (the source's default before PARTIAL_BF16)
    measured 0.5-1 % faster at T=128-1024; with split tokens (T=64), PARTIAL_BF16=1 measured
    1.5-2.5 % faster (BENCHMARKS.md, twenty-first session)."""
    d = dict(DEFINES)
    if not split:
        d.setdefault("PARTIAL_BF16", 0)
    return tuple(sorted(d.items()))


def clear_caches() -> None:
    """Forget the loaded modules and build results (after changing SRC or the sources)."""
    _function.cache_clear()
    _build_error.cache_clear()


NUM_CTAS: int | None = None  # the grid size (tests, sweeps); None: default_ctas
MIN_BLOCKS_PER_CTA = 4  # fewer 64-row blocks per CTA only add split pieces to merge
MAX_PIECES = 8  # pieces of one token the kernel's merge takes (its shared-memory weights)
CACHE_COUNTERS = True  # per-(device, stream) token counters, left zero by each launch
last_trace: torch.Tensor | None = None  # DIAG_TRACE builds: the last launch's clock64 stamps


_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def _counters(device: torch.device, stream: int, t: int) -> torch.Tensor:
    """Zeroed int32 [>= t] counters for a launch on ``stream`` (two per token). The kernel leaves
    them zero (the merging piece re-zeroes its token's), so one buffer serves every launch of a
    stream, which runs them in order; CACHE_COUNTERS = False: a fresh torch.zeros per call."""
    if not CACHE_COUNTERS:
        return torch.zeros(t, dtype=torch.int32, device=device)
    key = (device.index, stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < t:
        buf = _COUNTERS[key] = torch.zeros(max(t, 1024), dtype=torch.int32, device=device)
    return buf


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_ctas(t: int, nb: int, num_sms: int) -> int:
    """The grid size: ``t`` CTAs (one token each, in hardware-scheduled waves) from
    ``t >= num_sms / 2`` up, else each token cut into ``num_sms // t`` equal pieces (at most
    ``MAX_PIECES``, at least ``MIN_BLOCKS_PER_CTA`` blocks each) so the SMs are used.
    Measured on an H200 (BENCHMARKS.md, fourteenth session, same process): 0.889 ms at 1024
    tokens on 1024 CTAs against 0.902 on 132 (every SM the same number of blocks, ~130 tokens
    cut), and 0.108 against 0.132 ms at 128 tokens: each cut costs a second query prologue, a
    pipeline restart and a merge. 64 tokens on 128 CTAs: 0.067 ms."""
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

    ``num_ctas`` CTAs (default ``NUM_CTAS``, else :func:`default_ctas`) share the T · ⌈K/64⌉
    blocks of 64 rows equally in contiguous ranges; a token cut between CTAs is merged inside
    the kernel."""
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
    out = torch.empty(1, t, h, D_V, dtype=out_dtype, device=q.device)
    lse = torch.empty(1, t, h, dtype=torch.float32, device=q.device)
    if t == 0:
        return out, lse
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    nb = max(1, _cdiv(k, BLOCK_N))  # K = 0: one block of -1 rows (zeros, -inf)
    work = t * nb
    if work >= 2**31:
        raise ValueError(f"T * ceil(K / 64) = {work} work items: the kernel counts them in int32")
    ctas = num_ctas or NUM_CTAS or default_ctas(t, nb, _num_sms(dev))
    # every CTA's range at least ceil((nb - 1) / (MAX_PIECES - 1)) blocks: a token then spans at
    # most MAX_PIECES CTAs
    ctas = max(1, min(ctas, work // max(1, _cdiv(nb - 1, MAX_PIECES - 1))))
    if DEFINES.get("DIAG_TRACE"):  # the stamps land past ws_o's partial slots (one piece a CTA)
        global last_trace
        stamps = ctas * 2 * 20 * 16 * 2  # [G, 2 warpgroups, 20 slots, 16] int64, as fp32 words
        buf = torch.zeros(2 * ctas * 64 * D_V + stamps, dtype=torch.float32, device=q.device)
        ws_o = buf[: 2 * ctas * 64 * D_V].view(2 * ctas, 64, D_V)
        last_trace = buf[2 * ctas * 64 * D_V :]
    else:
        ws_o = torch.empty(2 * ctas, 64, D_V, dtype=torch.float32, device=q.device)
    ws_l = torch.empty(2 * ctas, 64, dtype=torch.float32, device=q.device)
    fn = _function(dev, launch_defines(splits_tokens(t, ctas)))
    stream = torch.cuda.current_stream(dev).cuda_stream
    counters = _counters(q.device, stream, 2 * t)  # [2t]: tickets, partials written
    c = ctypes
    args = [
        c.c_void_p(q.data_ptr()), c.c_void_p(kv_rows.data_ptr()), c.c_void_p(indices.data_ptr()),
        c.c_void_p(out.data_ptr()), c.c_void_p(lse.data_ptr()), c.c_void_p(ws_o.data_ptr()),
        c.c_void_p(ws_l.data_ptr()), c.c_void_p(counters.data_ptr()),
        c.c_float(sm_scale * 1.4426950408889634), c.c_int(h), c.c_int(k), c.c_int(nb), c.c_int(t),
        c.c_longlong(q.stride(0)), c.c_longlong(q.stride(1)), c.c_longlong(indices.stride(0)),
        c.c_longlong(out.stride(1)), c.c_longlong(out.stride(2)), c.c_longlong(lse.stride(1)),
        c.c_int(1 if out_dtype == torch.float32 else 0),
    ]  # fmt: skip
    with torch.cuda.device(dev):
        _driver().launch(fn, (ctas, 1), stream, args)
    return out, lse


__all__ = [
    "sparse_mla_fp8_cuda",
    "compile_cubin",
    "ptxas_resources",
    "is_available",
    "build_error",
]
