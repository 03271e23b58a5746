"""The SASS instructions where a kernel's warps were sampled most (Nsight Compute source page).

Usage: ncu -i REPORT.ncu-rep --page source --csv --print-source sass > src.csv
       python3 tools/ncu_top_stalls.py src.csv [N]
Prints the N instructions with the most warp-stall samples (all samples: issued or stalled), their
share of the kernel's samples, and the address, so a hot wait, barrier or load stands out."""

from __future__ import annotations

import csv
import sys


def main():
    path = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if "Source" in ln and "Address" in ln)
    rows = list(csv.DictReader(lines[start:]))
    cols = rows[0].keys()
    all_col = next(c for c in cols if "Warp Stall Sampling (All" in c)
    ni_col = next((c for c in cols if "Not-issued" in c or "Not Issued" in c), None)
    num = lambda r, c: float((r.get(c) or "0").replace(",", "") or 0)  # noqa: E731
    total = sum(num(r, all_col) for r in rows) or 1.0
    top = sorted(rows, key=lambda r: -num(r, all_col))[:n]
    print(f"total samples {total:.0f}; top {n} instructions:")
    for r in top:
        ni = f" (not issued {num(r, ni_col):.0f})" if ni_col else ""
        print(
            f"{100 * num(r, all_col) / total:5.1f}%{ni}  {r.get('Address', '')}  {r['Source'][:90]}"
        )


if __name__ == "__main__":
    main()
