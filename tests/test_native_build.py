"""vllm._C, the CUDA ops built ahead of time (``setup.py`` -> ``CMakeLists.txt`` -> ``csrc/``),
seen from a CPU machine: the package works without it, ``setup.py`` builds it only where it can
(torch importable, a CUDA build of it, nvcc), and the CMake project configures, skipping the
CUDA extension for a CPU-only torch. The build itself is checked on a CUDA machine
(``pip install --no-build-isolation -e .``, then ``tests/kernels/test_sparse_mla_cuda.py``)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm import _custom_ops as ops

ROOT = Path(__file__).resolve().parents[1]


def _setup_module():
    """setup.py as a module: its decision, without running setup()."""
    spec = importlib.util.spec_from_file_location("vllm_setup", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_package_imports_without_native_ops():
    built = importlib.util.find_spec("vllm._C") is not None
    assert ops.has_native_ops() == built
    if not built:
        assert "pip install --no-build-isolation -e ." in ops.native_ops_error()


def test_setup_builds_native_ops_only_where_it_can(monkeypatch, tmp_path):
    setup = _setup_module()
    cuda_home = tmp_path / "cuda"
    (cuda_home / "bin").mkdir(parents=True)
    nvcc = cuda_home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(cuda_home))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "not a CUDA build" in setup.native_skip_reason()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert setup.native_skip_reason() is None
    assert setup.nvcc_path() == str(nvcc)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    assert "no nvcc" in setup.native_skip_reason()
    monkeypatch.setitem(sys.modules, "torch", None)  # an isolated build environment
    assert "no torch" in setup.native_skip_reason()


def test_cmake_configures(tmp_path):
    """With this environment's torch: a CPU-only torch configures to nothing, saying so; a
    CUDA torch (with nvcc) configures the sm_90a extension."""
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake on this machine")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_ARCH_LIST"}
    res = subprocess.run(
        [cmake, "-S", str(ROOT), "-B", str(tmp_path), f"-DPython_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    if torch.version.cuda is None:
        assert "is not a CUDA build: skipping the CUDA extension" in log, log[-4000:]
        assert not (tmp_path / "CMakeFiles" / "_C.dir").exists()
    else:
        assert "CUDA extension for sm_90a" in log or "no CUDA compiler" in log, log[-4000:]
