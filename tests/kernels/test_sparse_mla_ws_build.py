"""The warp-specialised Gluon sparse-MLA kernel, built for sm_90a on the CPU (no GPU needed).

Gluon does not run under the Triton interpreter, so CI cannot execute this kernel; what it can do
is compile each shipped configuration the way the launcher resolves it (the GPU parity tests in
``test_sparse_mla.py`` check the results on an H200) and hold the build to its budgets: shared
memory within the 227 KB a block may have, the partitions' registers within the register file,
and spills no worse than the bytes measured when the configuration was tuned.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton.experimental.gluon")

from benchmarks.kernels.aot_sm90 import SMEM_LIMIT, _bin, compile_config, report  # noqa: E402
from vllm.kernels import sparse_mla_ws as ws  # noqa: E402

if not os.path.exists(_bin("ptxas")):
    pytest.skip("Triton's bundled ptxas is missing", allow_module_level=True)

# (rows, tuning, spill-bytes ceiling: the tuned build's stores rounded up, see BENCHMARKS.md)
CONFIGS = [
    pytest.param(False, {}, 256, id="bf16-default-seesaw"),
    pytest.param(True, {}, 64, id="fp8-default-split-staged"),
    pytest.param(True, {"fp8_staged": False}, 256, id="fp8-register-producer"),
]


@pytest.mark.parametrize("is_fp8,tuning,max_spill", CONFIGS)
def test_builds_within_budgets(is_fp8, tuning, max_spill):
    _, meta, _ = ws.launch_config(is_fp8, 656 if is_fp8 else 1152, **tuning)
    rep = report(compile_config(is_fp8, **tuning))
    assert rep["smem"] <= SMEM_LIMIT
    assert rep["registers"] <= meta["maxnreg"]
    producer, consumer = meta["PRODUCER_REGS"], meta["CONSUMER_REGS"]
    assert 32 * (ws.PRODUCER_WARPS * producer + 8 * consumer) <= 65536
    assert {producer, consumer} <= set(rep["setmaxnreg"])  # the partitions get what was asked
    assert rep["spill_stores"] <= max_spill


def test_launch_config_rejects_unknown_schedule():
    with pytest.raises(ValueError, match="schedule"):
        ws.launch_config(False, 1152, schedule="pingpong")
