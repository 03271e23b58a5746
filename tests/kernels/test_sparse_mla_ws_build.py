"""The warp-specialised Gluon sparse-MLA kernel, built for sm_90a on the CPU (no GPU needed).

Gluon does not run under the Triton interpreter, so CI cannot execute this kernel; what it can do
is compile each shipped configuration the way the launcher resolves it (the GPU parity tests in
``test_sparse_mla.py`` check the results on an H200) and hold the build to its budgets: shared
memory within the 227 KB a block may have, the partitions' registers within the register file,
and spills no worse than the bytes measured when the configuration was tuned. The compile runs
in a child process (``benchmarks/kernels/aot_sm90.py --json``): this session's Triton is bound
to the interpreter (TRITON_INTERPRET=1, set by this directory's conftest on CPU machines).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

# (script flags, spill-bytes ceiling: the tuned build's spill stores, rounded up)
CONFIGS = [
    pytest.param([], 256, id="bf16-default-seesaw"),
    pytest.param(["--fp8"], 64, id="fp8-default-split-staged"),
    pytest.param(
        ["--fp8", "--tune", "consumer_expand=0,wide_copy=0,scale_bytes=16"],
        64,
        id="fp8-producer-expands",
    ),
    pytest.param(["--fp8", "--schedule", "asym"], 64, id="fp8-asym"),
    pytest.param(["--fp8", "--tune", "one_wave=1"], 64, id="fp8-default-one-wave-asym"),
    pytest.param(
        ["--fp8", "--schedule", "asym", "--tune", "asym_order=expand_first"],
        64,
        id="fp8-asym-expand-first",
    ),
    pytest.param(
        ["--fp8", "--schedule", "asym", "--tune", "asym_halves=1"], 64, id="fp8-asym-halves"
    ),
    pytest.param(["--fp8", "--register-fp8"], 256, id="fp8-register-producer"),
    # the variants the GPU tests select, and the timeline builds of trace_sparse_mla_ws.py
    pytest.param(
        ["--fp8", "--tune", "idx_smem=0,q_async=0,early_release=0"], 64, id="fp8-old-order"
    ),
    pytest.param(["--tune", "idx_smem=0,q_async=0"], 256, id="bf16-ids-from-global"),
    pytest.param(["--fp8", "--producer-regs", "56", "--tune", "trace=1"], 64, id="fp8-traced"),
    pytest.param(["--tune", "trace=1"], 256, id="bf16-traced"),
]


def _build(flags):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/kernels/aot_sm90.py"), "--json",
                        *flags], capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    if r.returncode != 0 and "gluon" in r.stderr and "No module named" in r.stderr:
        pytest.skip("this Triton has no Gluon")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("flags,max_spill", CONFIGS)
def test_builds_within_budgets(flags, max_spill):
    rep = _build(flags)
    meta = rep["meta"]
    assert rep["smem"] <= rep["limit"]
    assert rep["registers"] <= meta["maxnreg"]
    producer, consumer = meta["PRODUCER_REGS"], meta["CONSUMER_REGS"]
    assert 32 * (meta["PRODUCER_WARPS"] * producer + 8 * consumer) <= 65536
    assert {producer, consumer} <= set(rep["setmaxnreg"])  # the partitions get what was asked
    assert rep["spill_stores"] <= max_spill


def test_launch_config_rejects_unknown_schedule():
    pytest.importorskip("triton.experimental.gluon")
    from vllm.kernels import sparse_mla_ws as ws

    with pytest.raises(ValueError, match="schedule"):
        ws.launch_config(False, 1152, schedule="pingpong")
    with pytest.raises(ValueError, match="asym"):  # FP8 rows only
        ws.launch_config(False, 1152, schedule="asym")
    with pytest.raises(ValueError, match="consumer_expand"):  # the seesaw has no expansion step
        ws.launch_config(True, 656, schedule="seesaw", consumer_expand=True)
    with pytest.raises(ValueError, match="asym_order"):
        ws.launch_config(True, 656, schedule="asym", asym_order="late")
    with pytest.raises(ValueError, match="asym_order"):  # the split schedule has no such choice
        ws.launch_config(True, 656, schedule="split", asym_order="pv_first")
    with pytest.raises(ValueError, match="scale_bytes"):
        ws.launch_config(True, 656, scale_bytes=8)


def test_launch_config_one_wave_default():
    """fp8_ds_mla rows take the asym schedule (PV before expansion) when the launch fits the SMs
    at one program each, the split schedule otherwise; bf16 rows and register FP8 rows keep
    theirs; an explicit schedule wins."""
    pytest.importorskip("triton.experimental.gluon")
    from vllm.kernels import sparse_mla_ws as ws

    kernel, meta, _ = ws.launch_config(True, 656, one_wave=True)
    assert kernel is ws._sparse_mla_asym_kernel and meta["ASYM_PV_FIRST"]
    assert ws.launch_config(True, 656)[0] is ws._sparse_mla_ws_kernel
    assert (
        ws.launch_config(True, 656, one_wave=True, schedule="split")[0] is ws._sparse_mla_ws_kernel
    )
    assert (
        ws.launch_config(True, 656, one_wave=True, fp8_staged=False)[0] is ws._sparse_mla_ws_kernel
    )
    assert ws.launch_config(False, 1152, one_wave=True)[0] is ws._sparse_mla_seesaw_kernel
