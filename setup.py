"""Builds vllm, and vllm._C (the CUDA ops under csrc/, via CMakeLists.txt) where it can.

vllm._C is built when the build environment has torch, a CUDA build of it (``torch.version.cuda``)
and nvcc (``$CUDA_HOME/bin/nvcc``, else on ``PATH``); elsewhere the package is pure Python and
``vllm._custom_ops.has_native_ops()`` is False. pip builds in an isolated environment without
torch, so on a CUDA machine with torch installed the command is

    pip install --no-build-isolation -e .

(it needs cmake; ninja when present). The package metadata is in pyproject.toml.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def nvcc_path() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def native_skip_reason() -> str | None:
    """None if vllm._C can be built in this environment, else why not."""
    try:
        import torch
    except ImportError:
        return "no torch in the build environment (pip install --no-build-isolation to use yours)"
    if not torch.version.cuda:
        return f"torch {torch.__version__} is not a CUDA build"
    if nvcc_path() is None:
        return "no nvcc (set CUDA_HOME or put nvcc on PATH)"
    return None


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class cmake_build_ext(build_ext):
    """Configures and builds CMakeLists.txt, which writes the module where setuptools expects
    it (for editable installs setuptools then copies it next to the sources)."""

    def build_extension(self, ext: Extension) -> None:
        if shutil.which("cmake") is None:
            raise RuntimeError("building vllm._C needs cmake (pip install cmake)")
        out = Path(self.get_ext_fullpath(ext.name)).resolve()
        build = Path(self.build_temp).resolve() / ext.name
        build.mkdir(parents=True, exist_ok=True)
        args = [
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_CUDA_COMPILER={nvcc_path()}",
            f"-DVLLM_EXT_OUTPUT_DIR={out.parent}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if shutil.which("ninja") and not (build / "CMakeCache.txt").exists():
            args += ["-G", "Ninja"]
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build), *args])
        jobs = str(self.parallel or os.cpu_count() or 1)
        subprocess.check_call(["cmake", "--build", str(build), "--target", "_C", "-j", jobs])
        if not out.is_file():
            raise RuntimeError(f"CMake did not produce {out}")


if __name__ == "__main__":
    skip = native_skip_reason()
    if skip:
        print(f"vllm._C is not built: {skip}; vllm is pure Python", file=sys.stderr)
    setup(
        ext_modules=[] if skip else [CMakeExtension("vllm._C")],
        cmdclass={"build_ext": cmake_build_ext},
    )
