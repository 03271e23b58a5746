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


@pytest.fixture
def interp():
    """``load(name)`` -> the module ``vllm.kernels.<name>``, running under the interpreter."""
    pytest.importorskip("triton")
    if not _INTERPRETER:
        pytest.skip("Triton runs compiled here (CUDA present, or imported before TRITON_INTERPRET)")
    _numpy_index_shim()
    return lambda name: importlib.import_module(f"vllm.kernels.{name}")
