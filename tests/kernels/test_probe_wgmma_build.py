"""The wgmma probe's builds for sm_90a (benchmarks/kernels/probe_wgmma_rate.py; no GPU needed).

Each probe row times one build of probe_wgmma_rate.cu. A row only measures what it says if ptxas
kept its wgmmas pipelined (no C7512 / C7514 serialisation) and nothing went to the stack, so
every row's build is held to that here, where CI has nvcc.
"""

from __future__ import annotations

import pytest

from benchmarks.kernels import probe_wgmma_rate as probe
from vllm.kernels import sparse_mla_cuda


@pytest.mark.parametrize("name,defines", probe.CASES, ids=[c[0] for c in probe.CASES])
def test_probe_row_builds_pipelined(name, defines, tmp_path):
    if sparse_mla_cuda.nvcc_path() is None:
        pytest.skip("no nvcc on this machine")
    cubin, log = probe.build({"NWG": 2, **defines}, str(tmp_path))
    assert cubin[:4] == b"\x7fELF", name
    res = sparse_mla_cuda.ptxas_resources(log)
    clean = res["wgmma_serialized"] == 0 and res["spill_stores"] == 0 and res["spill_loads"] == 0
    if name in probe.EXPECT_SERIALIZED:
        # a design finding: this row's registers cannot hold its pipeline (see EXPECT_SERIALIZED)
        assert not clean, f"{name} now builds clean: the finding it records no longer holds\n{log}"
        return
    assert res["wgmma_serialized"] == 0, log
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0, log


@pytest.mark.parametrize("l16", [0, 1])
@pytest.mark.parametrize("regs", [120, 168])
def test_four_consumer_block_loop_register_need(l16, regs, tmp_path):
    """The four-consumer block loop (mode 9, NWG 4) does not build clean in 120 registers a
    thread (the most a CTA of a producer warp and four consumer warpgroups, 544 threads, could
    give each; 640 threads leave 112), whether the row sums take 16 registers or 2; it does in
    168 (ptxas 13.0 first builds it clean at 160 with 2). Four warpgroups of 160 need 80K
    registers, more than an SM's 64K."""
    if sparse_mla_cuda.nvcc_path() is None:
        pytest.skip("no nvcc on this machine")
    _, log = probe.build({"MODE": 9, "NWG": 4, "L16": l16, "CONS_REGS": regs}, str(tmp_path))
    res = sparse_mla_cuda.ptxas_resources(log)
    clean = res["wgmma_serialized"] == 0 and res["spill_stores"] == 0 and res["spill_loads"] == 0
    assert clean == (regs == 168), log


def test_probe_rejects_a_removed_mode(tmp_path):
    """MODE 5 (m64n128k16) left the probe: its build fails by name instead of timing MODE 0."""
    if sparse_mla_cuda.nvcc_path() is None:
        pytest.skip("no nvcc on this machine")
    with pytest.raises(RuntimeError, match="MODE"):
        probe.build({"MODE": 5}, str(tmp_path))
