"""Where a consumer warpgroup of the CUDA FP8 sparse-MLA decode kernel spends its cycles (GPU).

Builds the kernel with DIAG_TRACE=1 (plus the build knobs given as 'NAME=V,...' arguments, one
variant each), runs the benchmark's inputs (16 requests x 128K tokens, random top-k 2048) at
``--tokens`` queries with one token per CTA, and prints per-step medians of the clock64 stamps
that thread 0 of each consumer warpgroup wrote (sparse_mla_fp8_seesaw.cuh): per own block,
wait for the stage, QK, the P^T buffer wait, the score scaling, the wait for the other
warpgroup's P^T, PV of the other's block, the softmax's steps, PV of its own block; per piece,
the query prologue and the epilogue's steps. Cycles are SM cycles; the kernel's CUDA-event time is
printed beside them."""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.kernels.bench_sparse_mla_decode import CTX, make_inputs
from vllm.kernels import sparse_mla_cuda
from vllm.kernels.sparse_mla_decode import sparse_mla_decode

# (name, from stamp, to stamp) of an own-block iteration (sparse_mla_fp8_seesaw.cuh's stamps)
STEPS = [
    ("wait stage", 0, 1), ("QK", 1, 2), ("pempty", 2, 12), ("scale", 12, 13),
    ("wait P^T(other)", 13, 3), ("PV other", 3, 4), ("sm:check", 4, 7), ("sm:bar.red", 7, 8),
    ("sm:exp", 8, 9), ("sm:store P^T", 9, 10), ("sm:fence", 10, 11), ("sm:arrive+bar", 11, 5),
    ("PV own", 5, 6),
]  # fmt: skip
# the piece's stamps: entry 0, query loaded 3, first barrier 4, query stored 1, epilogue
# barriers 5 and 6, before the output stores 7, end 2; inside the query load (QSTAGED): the
# thread's loads landed and staged 8, the staging barrier 9, its quarter read back and its
# largest value found 10
PIECE = [("query load", 0, 3), ("bar", 3, 4), ("query store", 4, 1), ("epi: l reduce", 5, 5),
         ("epi: lse", 5, 6), ("epi: inv", 6, 7), ("epi: store", 7, 2)]  # fmt: skip
QLOAD = [("loads + staging", 0, 8), ("staging bar", 8, 9), ("read back + amax", 9, 10),
         ("amax across threads", 10, 3)]  # fmt: skip


def med(x: torch.Tensor) -> float:
    return float(x.float().median()) if x.numel() else float("nan")


def trace(t: int, spec: str, num_ctas: int | None = None, ctx: int = CTX) -> None:
    sparse_mla_cuda.DEFINES = {**sparse_mla_cuda.parse_defines(spec), "DIAG_TRACE": 1}
    sparse_mla_cuda.NUM_CTAS = num_ctas
    layout, cache, slots, q = make_inputs(t, "fp8_ds_mla", ctx=ctx)
    scale = 1 / math.sqrt(256)
    run = lambda: sparse_mla_decode(q, cache, slots, layout, scale, kernel="cuda")  # noqa: E731
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    run()
    ev[1].record()
    torch.cuda.synchronize()
    ms = ev[0].elapsed_time(ev[1])
    ctas = num_ctas or sparse_mla_cuda.default_ctas(t, 32, sparse_mla_cuda._num_sms(0))
    tr = sparse_mla_cuda.last_trace.view(torch.int64).flatten()
    tr = tr[: ctas * 2 * 20 * 16].view(ctas, 2, 20, 16).cpu()
    it = tr[:, :, :18]  # [cta, wg, iteration, stamp]
    piece = tr[:, :, 19]
    total = piece[:, :, 2] - piece[:, :, 0]
    print(f"== [{spec}] T={t}, {ctx // 1024}K-token requests: {ctas} CTAs (stamps of each CTA's last token), kernel {ms * 1e3:.1f} us (events, one call); "
          f"per CTA median {med(total):.0f} cycles")  # fmt: skip
    # steady state: each warpgroup's own-block iterations (stamp 1 written) from the third to the
    # last but one (a 32-block token: 16 iterations, 2..14; a 16-block piece at T=64: 2..6)
    own = it[..., 1] > 0
    k = torch.arange(it.shape[2])
    steady = own & (k >= 2) & (k < own.sum(dim=2, keepdim=True) - 1)
    ss = it[steady]  # [n, 16]
    nxt = it[:, :, 1:, 0][steady[:, :, :-1]]  # the next iteration's start
    period = nxt - it[:, :, :-1, 0][steady[:, :, :-1]]
    cells = [f"{n} {med(ss[..., b] - ss[..., a]):.0f}" for n, a, b in STEPS]
    cells.append(f"loop {med(nxt - it[:, :, :-1, 6][steady[:, :, :-1]]):.0f}")
    print(f"   per iteration (own block + the other's PV), period {med(period):.0f}:")
    print("     " + ", ".join(cells))
    last = it[..., :7].flatten(2).max(dim=2).values  # each warpgroup's last block stamp
    cells = [f"{n} {med(piece[..., b] - piece[..., a]):.0f}" for n, a, b in PIECE]
    cells[3] = f"epi: l reduce {med(piece[..., 5] - last):.0f}"
    print("   piece: " + ", ".join(cells))
    if (piece[..., 10] > 0).all():  # QSTAGED builds
        print("   query load: " + ", ".join(
            f"{n} {med(piece[..., b] - piece[..., a]):.0f}" for n, a, b in QLOAD))  # fmt: skip
    for wg in range(2):  # the spread of the per-token steps, per warpgroup
        q = torch.tensor([0.1, 0.5, 0.9])
        ql = (piece[:, wg, 3] - piece[:, wg, 0]).float().quantile(q).tolist()
        st = (piece[:, wg, 2] - piece[:, wg, 7]).float().quantile(q).tolist()
        print(f"   warpgroup {wg}: query load p10/50/90 {ql[0]:.0f}/{ql[1]:.0f}/{ql[2]:.0f}, "
              f"epi: store {st[0]:.0f}/{st[1]:.0f}/{st[2]:.0f}")  # fmt: skip
    role = piece[..., 14]
    for r, name, steps in (
        (2, "storing pieces", [("ticket", 7, 11), ("store partial", 11, 12), ("to end", 12, 2)]),
        (
            1,
            "merging pieces",
            [("ticket", 7, 11), ("wait", 11, 12), ("merge", 12, 13), ("store out", 13, 2)],
        ),
    ):
        sel = role == r
        if sel.any():
            p = piece[sel]
            print(f"   {name} ({int(sel.sum())} warpgroups): " + ", ".join(
                f"{n} {med(p[:, b] - p[:, a]):.0f}" for n, a, b in steps))  # fmt: skip
    gt = tr[:, :, 18, :2]  # %globaltimer (ns) at each warpgroup's piece start and end
    if (gt > 0).all():
        t0 = gt[..., 0].min()
        q = torch.tensor([0.0, 0.5, 0.9, 1.0])
        st = (gt[..., 0] - t0).float().flatten().quantile(q).tolist()
        en = (gt[..., 1] - t0).float().flatten().quantile(q).tolist()
        print(
            "   global clock (ns from the first start): start min/p50/p90/max "
            + "/".join(f"{x:.0f}" for x in st)
            + ", end "
            + "/".join(f"{x:.0f}" for x in en)
        )
        q4 = torch.tensor([0.1, 0.5, 0.9, 1.0])
        for r, name in (
            (2, "storing"),
            (1, "merging"),
        ):  # split tokens: where each role's time goes
            sel = role == r
            if sel.any():
                body = (piece[..., 7] - piece[..., 0])[sel].float().quantile(q4).tolist()
                epi = (piece[..., 2] - piece[..., 7])[sel].float().quantile(q4).tolist()
                end = (gt[..., 1] - t0)[sel].float().quantile(q4).tolist()
                print(f"   {name} pieces p10/50/90/max: start to epilogue "
                      + "/".join(f"{x:.0f}" for x in body) + " cycles, epilogue "
                      + "/".join(f"{x:.0f}" for x in epi) + " cycles, end "
                      + "/".join(f"{x:.0f}" for x in end) + " ns")  # fmt: skip
    rep = tr[:, :, 18, 2:5]  # DIAG_REPEAT builds: the query's first pass ends, its second starts,
    if (rep[..., :2] > 0).all():  # the first store pass ends (pieces that store the output)
        p1 = med(rep[..., 0] - piece[..., 0])
        p2 = med(piece[..., 8] - rep[..., 1])
        out = rep[..., 2] > 0
        first = (rep[..., 2] - torch.where(role == 1, piece[..., 13], piece[..., 7]))[out]
        print(f"   DIAG_REPEAT: query loads + staging, first pass {p1:.0f}, second {p2:.0f}; "
              f"output stores, first pass {med(first):.0f}, "
              f"second {med((piece[..., 2] - rep[..., 2])[out]):.0f}")  # fmt: skip
    print(f"   first iteration: wait stage {med(it[:, :, 0, 1] - it[:, :, 0, 0]):.0f}, "
          f"QK {med(it[:, :, 0, 2] - it[:, :, 0, 1]):.0f}; from the query to it "
          f"{med(it[:, :, 0, 0] - piece[..., 1]):.0f}")  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("variants", nargs="*", default=[""], help="build knobs 'NAME=V,...' per variant")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--ctas", type=int, default=None, help="grid size (default: the launcher's)")
    p.add_argument(
        "--ctx", type=int, default=CTX,
        help="tokens per request (16 requests; 2048: the whole cache fits in L2)",
    )  # fmt: skip
    args = p.parse_args()
    for spec in args.variants:
        trace(args.tokens, spec, args.ctas, args.ctx)
    sparse_mla_cuda.DEFINES, sparse_mla_cuda.NUM_CTAS = {}, None


if __name__ == "__main__":
    main()
