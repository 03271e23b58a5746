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
    assert res["wgmma_serialized"] == 0, log
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0, log


def test_probe_rejects_a_removed_mode(tmp_path):
    """MODE 5 (m64n128k16) left the probe: its build fails by name instead of timing MODE 0."""
    if sparse_mla_cuda.nvcc_path() is None:
        pytest.skip("no nvcc on this machine")
    with pytest.raises(RuntimeError, match="MODE"):
        probe.build({"MODE": 5}, str(tmp_path))
