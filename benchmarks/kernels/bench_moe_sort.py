"""The routed experts' pair layout (``sort_pairs_by_expert``): the one-program Triton form
against the torch form (~16 small kernels) in the same process, as graph replays (how decode and
verify steps run it). Bytes: ids read, the slots and block experts written (launch-bound: the
roofline column is small by nature).

    python benchmarks/kernels/bench_moe_sort.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.kernels.common import dump_json, parser, print_rows, row, time_ms_graph  # noqa: E402
from vllm.kernels.triton.moe_grouped import sort_pairs_by_expert  # noqa: E402

# (tokens, local experts, block_m): EP8 decode at B = 64 / 256 and a verify step of 64 x 4, one
# GPU's 256 experts at 512 tokens
CASES = [(64, 32, 16), (256, 32, 16), (256, 32, 64), (512, 256, 128)]
K, E_TOTAL = 8, 256


def main() -> None:
    args = parser(__doc__).parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for t, e_loc, bm in CASES:
        ids = torch.rand(t, E_TOTAL, device="cuda", generator=g).topk(K, dim=-1).indices
        nb = min(-(-t * K // bm) + e_loc, t * K)
        nbytes = ids.numel() * 8 + nb * bm * 4 + nb * 4

        def run(one, ids=ids, e_loc=e_loc, bm=bm):
            return sort_pairs_by_expert(ids, 0, e_loc, bm, one_program=one)

        ref = time_ms_graph(lambda: run(False))
        ms = time_ms_graph(lambda: run(True))
        shape = f"T={t} k={K} E_loc={e_loc} block_m={bm}"
        rows.append(row("moe_sort_pairs", shape, ms, 0, nbytes, "bf16", ref, "xref = torch form"))
    print_rows(rows)
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
