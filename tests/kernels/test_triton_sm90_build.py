"""The Triton kernels built for sm_90a on the CPU (no GPU needed).

CI runs these kernels under the Triton interpreter, which does not type-check them the way the
compiler does: a kernel can pass every interpreter test and fail to compile on the GPU (a
variable redefined with another type in one branch did, once). These tests compile, in child
processes (``tools/aot_triton_sm90.py``; this session's Triton is bound to the
interpreter):
- every kernel the interpreter tests launch, with the arguments they launched it with (logged
  by ``tests/kernels/conftest.py``) and the device-dependent constexprs at their CUDA values;
- the top-k's shipped configurations and the tuning variants its GPU tests use, through the
  launcher's own resolver (``topk_launch_config``), the defaults held to no spills.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

DEFAULTS = ["8192,32768,2048", "8192,131072,2048", "64,1048576,2048"]  # prefill / decode shapes
VARIANTS = [
    "300,5000,2048,sample_run=1",
    "300,40000,2048,sample_run=4,pivot_warps=1",
    "300,40000,2048,prefetch=true,collect_maxnreg=0",
    "300,40000,2048,chunk=1024,num_warps=4,select_warps=2,select_regs=1",
    "1024,32768,2048,cap=16384",
    "16,70000,100,z=-9.0",
    "7,1000,2048",
]


# the modules whose Triton kernels the interpreter tests must reach
KERNEL_MODULES = {"hisparse_resolve", "indexer_logits", "kv_write", "merge_attn", "moe_grouped",
                  "row_copy", "sparse_mla_fwd", "topk"}  # fmt: skip


def _env(interpret: bool):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRITON_INTERPRET", "VLLM_TRITON_LAUNCH_LOG")
    }
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _build(cases):
    r = subprocess.run([sys.executable, str(ROOT / "tools/aot_triton_sm90.py"),
                        "--json", *cases], capture_output=True, text=True, env=_env(False),
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the GPU tests compile the kernels")
def test_interpreted_kernels_build_for_sm90(tmp_path):
    log = tmp_path / "launches.jsonl"
    env = _env(True) | {"VLLM_TRITON_LAUNCH_LOG": str(log)}
    r = subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "tests/kernels"), "-q", "-x",
                        "-p", "no:cacheprovider", "-k", "interpreter and not build"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    r = subprocess.run([sys.executable, str(ROOT / "tools/aot_triton_sm90.py"),
                        "--from-log", str(log), "--json"], capture_output=True, text=True,
                       env=_env(False), timeout=1200)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    reps = json.loads(r.stdout.strip().splitlines()[-1])
    assert {key.split(".")[3] for key in reps} >= KERNEL_MODULES
    errors = {key: rep["error"] for key, rs in reps.items() for rep in rs if "error" in rep}
    assert not errors, errors


def test_topk_defaults_build_without_spills():
    reps = _build(DEFAULTS)
    for case, kernels in reps.items():
        assert set(kernels) == {"pivot", "collect", "select", "fallback"}
        for name, rep in kernels.items():
            # the 1M-candidate collect spills one word under its 64-register cap
            limit = 8 if (name == "collect" and case.startswith("64,1048576")) else 0
            assert rep["spill_stores"] <= limit, (case, name, rep)
            assert rep["smem"] <= 232448


def test_topk_tuning_variants_build():
    reps = _build(VARIANTS)
    assert sorted(reps) == sorted(VARIANTS)
    for kernels in reps.values():
        assert all(rep["registers"] > 0 for rep in kernels.values())
