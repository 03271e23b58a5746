"""The warp-specialised Gluon sparse-MLA kernel, built for sm_90a on the CPU (no GPU needed).

Gluon does not run under the Triton interpreter, so CI cannot execute this kernel; what it can do
is compile the build the launcher launches (the GPU parity tests in ``test_sparse_mla.py`` check
the results on an H200) and hold it to its budgets: shared memory within the 227 KB a block may
have, the partitions' registers within the register file, and spills no worse than the bytes of
the build as measured. The compile runs in a child process (``tools/aot_sm90.py
--json``): this session's Triton is bound to the interpreter (TRITON_INTERPRET=1, set by this
directory's conftest on CPU machines).
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

# (script flags, spill-bytes ceiling: the measured build's spill stores)
CONFIGS = [
    pytest.param([], 164, id="production"),
    # the launcher's fallback for top-k slices over IDX_CAP and queries cp.async cannot copy
    pytest.param(["--ids-from-global", "--sync-query"], 176, id="fallback"),
]


def _build(flags):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, str(ROOT / "tools/aot_sm90.py"), "--json",
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
