"""Kernel-test fixtures: the Triton CPU interpreter for the default (CPU) run.

Triton binds ``@triton.jit`` functions — its own ``tl.max``/``tl.sum`` included — to the interpreter
or the compiler when ``triton.language`` is first imported, so TRITON_INTERPRET=1 must be set before
anything imports Triton. On a machine without CUDA this conftest sets it at collection (nothing
outside ``vllm/kernels`` imports Triton, and torch does not); the ``interp`` tests then run the real
kernels at tiny shapes. Where CUDA is present the kernels are compiled, the ``gpu`` tests cover
them and the interpreter tests skip.
"""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest
import torch

_TRITON_PREIMPORTED = "triton" in sys.modules
if not _TRITON_PREIMPORTED and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and not _TRITON_PREIMPORTED


def _numpy_index_shim() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with ``int(array([v]))``, which
    NumPy >= 2.4 rejects ("only 0-dimensional arrays can be converted"); that breaks every loop
    with a run-time bound. Re-patch ``tensor.__index__`` to read the single element instead."""
    try:
        int(np.array([1]))
        return
    except TypeError:
        pass
    from triton.runtime import interpreter

    if getattr(interpreter, "_vllm_index_shim", False):
        return
    orig = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._vllm_index_shim = True


def _launch_log_shim() -> None:
    """With VLLM_TRITON_LAUNCH_LOG=PATH, every kernel launch the interpreter runs is appended to
    PATH as one JSON line (the kernel, its arguments' types, the constexprs and the launch
    options), for ``tools/aot_triton_sm90.py --from-log`` to compile for sm_90a:
    the interpreter does not type-check a kernel the way the compiler does."""
    path = os.environ.get("VLLM_TRITON_LAUNCH_LOG")
    from triton.runtime import interpreter

    if not path or getattr(interpreter, "_vllm_launch_log", False):
        return
    import json

    orig = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        rec = _launch_record(self.fn, args, kwargs)
        if rec is not None:
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run
    interpreter._vllm_launch_log = True


_TORCH_TO_TRITON = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
    torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
    torch.float8_e4m3fn: "fp8e4nv",
}  # fmt: skip
_OPTIONS = ("num_warps", "num_stages", "maxnreg", "num_ctas")


def _launch_record(fn, args, kwargs):
    """{"module", "name", "sig": {arg: type}, "div16": [args], "consts": {arg: value},
    "options": {...}}, or None if an argument has a type this log does not describe."""
    import inspect

    params = inspect.signature(fn).parameters
    values = dict(zip(params, args, strict=False))  # trailing parameters may come as kwargs
    values |= {k: v for k, v in kwargs.items() if k not in _OPTIONS}
    sig, div16, consts = {}, [], {}
    for name, p in params.items():
        v = values.get(name, p.default)
        if "constexpr" in str(p.annotation):
            if hasattr(v, "primitive_bitwidth") or type(v).__name__ == "dtype":
                v = {"tl_dtype": str(v)}
            elif not isinstance(v, (int, float, bool, str, type(None))):
                return None
            consts[name] = v
            sig[name] = "constexpr"
        elif isinstance(v, torch.Tensor):
            if v.dtype not in _TORCH_TO_TRITON:
                return None
            sig[name] = "*" + _TORCH_TO_TRITON[v.dtype]
            if v.data_ptr() % 16 == 0:
                div16.append(name)
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0:
                div16.append(name)
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            return None
    options = {k: kwargs[k] for k in _OPTIONS if k in kwargs and kwargs[k] is not None}
    return dict(module=fn.__module__, name=fn.__name__, sig=sig, div16=div16, consts=consts,
                options=options)  # fmt: skip


@pytest.fixture
def interp():
    """``load(name)`` -> the Triton module ``vllm.kernels.triton.<name>``, run by the interpreter."""
    pytest.importorskip("triton")
    if not _INTERPRETER:
        pytest.skip("Triton runs compiled here (CUDA present, or imported before TRITON_INTERPRET)")
    _numpy_index_shim()
    _launch_log_shim()
    return lambda name: importlib.import_module(f"vllm.kernels.triton.{name}")
