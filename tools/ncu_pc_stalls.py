"""Per-SASS-instruction warp-stall samples by reason, from an Nsight Compute report.

Usage (on the GPU machine, after ``ncu --section SourceCounters --export REP ...``):
    python3 tools/ncu_pc_stalls.py REP.ncu-rep > pcs.tsv

Writes one row per sampled instruction: its offset from the kernel's first sampled address's
function start (the smallest address any source metric names), the total samples, the samples
of each stall reason (``reason=count``, largest first) and the SASS text. The source page's CSV
has only the totals; this is where an epilogue's ``no_instruction`` (cold instruction cache) or a
prologue's ``long_scoreboard`` shows. Uses Nsight Compute's Python report interface
(``extras/python/ncu_report.py`` next to the ``ncu`` binary)."""

from __future__ import annotations

import glob
import os
import shutil
import sys
from collections import defaultdict


def _import_ncu_report():
    ncu = shutil.which("ncu")
    roots = [os.path.dirname(os.path.realpath(ncu))] if ncu else []
    roots += sorted(glob.glob("/opt/nvidia/nsight-compute/*"), reverse=True)
    for r in roots:
        p = os.path.join(r, "extras", "python")
        if os.path.isfile(os.path.join(p, "ncu_report.py")):
            sys.path.insert(0, p)
            break
    import ncu_report  # noqa: PLC0415

    return ncu_report


def main():
    ncu_report = _import_ncu_report()
    ctx = ncu_report.load_report(sys.argv[1])
    act = ctx.range_by_idx(0).action_by_idx(0)
    prefix = "smsp__pcsamp_warps_issue_stalled_"
    by_pc: dict[int, dict[str, float]] = defaultdict(dict)
    for name in act.metric_names():
        if not name.startswith(prefix) or name.endswith("_not_issued"):
            continue
        m = act.metric_by_name(name)
        if not m.has_correlation_ids():
            continue
        ids = m.correlation_ids()
        for i in range(m.num_instances()):
            v = m.as_double(i)
            if v:
                by_pc[ids.as_uint64(i)][name[len(prefix) :]] = v
    if not by_pc:
        names = [n for n in act.metric_names() if "pcsamp" in n]
        raise SystemExit(f"no per-PC stall samples in the report; pcsamp metrics: {names[:40]}")
    base = min(by_pc)
    print(f"# base address {base:#x} (offsets below are from it); {len(by_pc)} instructions")
    for pc in sorted(by_pc):
        r = by_pc[pc]
        total = sum(r.values())
        try:
            sass = act.sass_by_pc(pc)
        except Exception:  # noqa: BLE001
            sass = "?"
        reasons = " ".join(f"{k}={v:.0f}" for k, v in sorted(r.items(), key=lambda kv: -kv[1]))
        print(f"{pc - base:#07x}\t{total:.0f}\t{reasons}\t{sass}")


if __name__ == "__main__":
    main()
