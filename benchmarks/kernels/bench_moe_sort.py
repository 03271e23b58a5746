"""The grouped MoE's pair layout (``sort_pairs_by_expert``): the one-hot prefix-sum ranking, the
one-program Triton layout and the counting sort's four launches against the stable-sort ranking,
in CUDA-graph replays (as the decode and verify steps run it).

Shapes: decode and MTP3-verify batches (64 and 256 tokens, top-8) over 32 local experts (EP8's
share of GLM-5.3's 256) and 256 (EP1), and prefill chunks of 128-8,192 tokens over 256 experts
(the one program up to its 4,096 pairs). The bytes counted are
the ids read once and the two outputs written once: the op is launch-bound, so its roofline share
is small by nature; the column that matters is the speed-up over the sort form (``xref``).
"""

from __future__ import annotations

import functools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.kernels.common import (  # noqa: E402
    dump_json,
    parser,
    print_rows,
    row,
    time_ms_graph,
)
from vllm.kernels.triton.moe_grouped import (  # noqa: E402
    ONE_PROGRAM_MAX_PAIRS,
    sort_pairs_by_expert,
)

SHAPES = [
    (64, 32),
    (256, 32),
    (64, 256),
    (128, 256),
    (256, 256),
    (512, 256),
    (2048, 256),
    (8192, 256),
]
K, BLOCK_M = 8, 16


def main() -> None:
    args = parser(__doc__).parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for t, e_loc in SHAPES[:2] if args.quick else SHAPES:
        e_total = 256
        ids = torch.rand(t, e_total, device="cuda", generator=g).topk(K, dim=-1).indices
        p = t * K
        nbytes = ids.numel() * 8 + (p + e_loc) * BLOCK_M * 4
        shape = f"T={t} E_loc={e_loc} pairs={p}"
        layout = functools.partial(sort_pairs_by_expert, ids, 0, e_loc, BLOCK_M)
        sort = functools.partial(layout, form="sort")
        a = sort()
        same = lambda f: all(torch.equal(u, v) for u, v in zip(a, f(), strict=True))  # noqa: B023, E731
        sort_ms = time_ms_graph(sort)
        rows.append(row("moe_sort_argsort", shape, sort_ms, 0, nbytes, "bf16", sort_ms))
        forms = ["scan", "counting"] + (["one_program"] if p <= ONE_PROGRAM_MAX_PAIRS else [])
        for op, f in ((f"moe_sort_{form}", functools.partial(layout, form=form)) for form in forms):
            note = f"same layout: {same(f)}"
            rows.append(row(op, shape, time_ms_graph(f), 0, nbytes, "bf16", sort_ms, note))
    print_rows(rows)
    dump_json(rows, args.json)


if __name__ == "__main__":
    main()
