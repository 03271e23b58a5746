"""NIXL READ of one GLM-5.3-shaped request's KV between two processes, through the NixlConnector.

A prefill process (``--src-dcp`` ranks, each its own NIXL agent) holds a ``--tokens`` request in
fp8_ds_mla caches of every layer: 78 MLA layers + the MTP layer (656 B/token each) and the 22
indexer caches (21 "full" layers + MTP, 132 B/token): 54,728 B/token. The decode process
(``--dst-dcp`` ranks) pulls it with the connector (handshake excluded: a warm-up pull first),
timed from metadata to ``finished_recving`` on every rank. Next to it, the copy ceiling of the
same device measured in the same run (``torch`` copy of 1 GiB). ``--layers-scale`` divides the
layer counts to fit small machines; the per-token bytes printed are what moved.

``--paths`` pulls the request once per path, in the same run: ``direct`` (one descriptor per run
contiguous on both sides), ``staged`` (source-contiguous runs into the staging buffer, then one
indexed scatter per cache tensor and region), ``auto`` (the connector's rule). The decode caches
are zeroed before each path and their per-block fingerprints compared across paths
("verification: passed").

    python benchmarks/kv_transfer/bench_nixl_transfer.py                    # 128K tokens, DRAM
    python benchmarks/kv_transfer/bench_nixl_transfer.py --src-dcp 2 --dst-dcp 1 --interleave 64
    python benchmarks/kv_transfer/bench_nixl_transfer.py --src-dcp 2 --tokens 8192 \
        --paths direct,staged                                               # short runs
    python benchmarks/kv_transfer/bench_nixl_transfer.py --device cuda      # VRAM -> VRAM
    python benchmarks/kv_transfer/bench_nixl_transfer.py --src-device cuda --dst-device pinned
                                                          # VRAM -> a HiSparse host pool
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from vllm.config.kv_transfer import KVTransferConfig  # noqa: E402
from vllm.core.request import RequestStatus  # noqa: E402
from vllm.distributed.kv_transfer import (  # noqa: E402
    KVConnectorContext,
    KVConnectorOutput,
    KVConnectorRole,
    aggregate_outputs,
)
from vllm.distributed.kv_transfer.nixl_connector import NixlConnector  # noqa: E402
from vllm.distributed.kv_transfer.reshard import KVShardLayout  # noqa: E402
from vllm.kv_cache_interface import KVCacheLayout  # noqa: E402

GLM53 = KVCacheLayout("fp8_ds_mla", torch.bfloat16, 512, 64, 128)
FORCE = {"direct": False, "staged": True, "auto": None}  # NixlWorker.force_staging
NUM_MLA_LAYERS = 79  # 78 + MTP; 22 of them (21 full + MTP) with indexer keys


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.FINISHED_LENGTH
    kv_transfer_params: dict | None = None


def ctx(shard, role, rank, args) -> KVConnectorContext:
    cfg = KVTransferConfig.from_json(
        {
            "kv_connector": "NixlConnector",
            "kv_role": role,
            "engine_id": role,
            "side_channel_port": args.port,
            "kv_load_timeout_s": 600.0,
            "kv_connector_extra_config": {"nixl_progress_thread": args.progress_thread},
        }
    )
    return KVConnectorContext(cfg, GLM53, shard, rank=rank, model_name="glm-5.3")


def caches(args, num_blocks: int, rank: int, fill: bool, where: str):
    """Every layer's caches; indexer caches on IndexShare's full layers (0, 1, 2, 6, ..., 74) and
    the MTP layer (78), every ``--layers-scale``-th layer kept. ``where``: cpu, pinned (page-locked
    host memory, as HiSparse's host pool) or cuda."""
    if where == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
    else:
        dev = torch.device("cpu")
    full = {i for i in range(78) if max(i - 2, 0) % 4 == 0} | {78}

    def place(t):
        return t.pin_memory() if where == "pinned" else t

    out = []
    for li in range(0, NUM_MLA_LAYERS, args.layers_scale):
        mla = place(GLM53.allocate_mla(num_blocks, dev))
        idx = place(GLM53.allocate_indexer(num_blocks, dev)) if li in full else None
        if fill:
            for t in (mla, idx):
                if t is not None:
                    t.view(torch.int32).random_()
        out.append((mla, idx))
    return out


def step(workers, pending) -> KVConnectorOutput:
    outs = []
    for w in workers:
        s, r = w.get_finished([])
        outs.append(
            KVConnectorOutput(sorted(s), sorted(r), sorted(w.get_block_ids_with_load_errors()))
        )
    return aggregate_outputs(outs, pending)


def set_threads(args) -> None:
    """CPU: the cores shared by every rank of both engines, as the engine's workers share them
    (``worker.py``); with more threads than cores torch's parallel loops (the staged path's
    scatter) wait on descheduled threads."""
    if "cuda" not in (args.src_device, args.dst_device):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (args.src_dcp + args.dst_dcp)))


def producer(args, q_out, q_in):
    set_threads(args)
    shard = KVShardLayout(args.src_dcp, args.src_dcp, args.interleave)
    nb = shard.num_blocks(args.tokens)
    sched = NixlConnector(ctx(shard, "kv_producer", 0, args), KVConnectorRole.SCHEDULER)
    workers = [
        NixlConnector(ctx(shard, "kv_producer", k, args), KVConnectorRole.WORKER)
        for k in range(shard.world_size)
    ]
    for k, w in enumerate(workers):
        w.register_kv_caches(caches(args, nb, k, fill=True, where=args.src_device))
    params = []
    for it in range(len(args.paths) * (args.iters + 1)):  # one request per pull (same blocks)
        r = Req(
            f"p{it}", [0] * args.tokens, args.tokens, kv_transfer_params={"do_remote_decode": True}
        )
        params.append(sched.request_finished(r, list(range(nb)))[1])
    meta = sched.build_connector_meta(None)
    for w in workers:
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
    q_out.put(params)
    pending: dict = {}
    while q_in.empty():
        step(workers, pending)
        time.sleep(0.01)
    for w in workers:
        w.shutdown()


def copy_ceiling(args) -> float:
    """GB/s of a 1 GiB torch copy between the two sides' kinds of memory (device to device,
    DRAM to DRAM, or pinned host <-> device: the PCIe ceiling of host pool transfers)."""

    def buf(where):
        dev = torch.device("cuda" if where == "cuda" else "cpu")
        t = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
        return t.pin_memory() if where == "pinned" else t

    a, b = buf(args.src_device).random_(), buf(args.dst_device)
    dev = a.device if a.is_cuda else b.device
    best = float("inf")
    for _ in range(5):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return a.numel() / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--src-dcp", type=int, default=1)
    ap.add_argument("--dst-dcp", type=int, default=1)
    ap.add_argument("--interleave", type=int, default=1)
    ap.add_argument("--layers-scale", type=int, default=1, help="divide the layer counts by this")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--src-device",
        default=None,
        choices=["cpu", "pinned", "cuda"],
        help="the prefill side's caches (default: --device)",
    )
    ap.add_argument(
        "--dst-device",
        default=None,
        choices=["cpu", "pinned", "cuda"],
        help="the decode side's caches (default: --device); pinned = HiSparse's host pool",
    )
    ap.add_argument("--port", type=int, default=0, help="side channel base port (0: pick one)")
    ap.add_argument(
        "--paths", default="direct,staged", help="comma-separated: direct, staged, auto (see above)"
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--progress-thread",
        action="store_true",
        help="NIXL's UCX progress thread on (off in the engine)",
    )
    args = ap.parse_args()
    args.paths = args.paths.split(",")
    args.src_device = args.src_device or args.device
    args.dst_device = args.dst_device or args.device
    if not set(args.paths) <= set(FORCE):
        ap.error(f"--paths: choose from {sorted(FORCE)}")
    if args.port == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
    set_threads(args)
    ceiling = copy_ceiling(args)
    mpc = mp.get_context("spawn")
    q_out, q_in = mpc.Queue(), mpc.Queue()
    proc = mpc.Process(target=producer, args=(args, q_out, q_in), daemon=True)
    proc.start()
    try:
        rows, same = pull(args, q_out.get(timeout=1800))
    finally:
        q_in.put("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    report(args, rows, same, ceiling)
    if not same:
        sys.exit("paths landed different bytes")


def fingerprint(kv_caches) -> list[torch.Tensor]:
    """Per cache tensor and block, a position-weighted sum of its 8-byte words: a row that
    lands in the wrong slot changes it."""
    out = []
    for t in (t for pair in kv_caches for t in pair if t is not None):
        words = t.view(t.shape[0], -1).view(torch.int64)
        g = torch.Generator(device=t.device).manual_seed(0)
        w = torch.randint(1, 1 << 40, (words.shape[1],), generator=g, device=t.device)
        out.append((words * w).sum(1).cpu())
    return out


def pull(args, params) -> tuple[list[dict], bool]:
    """Every path's pulls; returns a row per path and whether all paths landed the same."""
    shard = KVShardLayout(args.dst_dcp, args.dst_dcp, args.interleave)
    nb = shard.num_blocks(args.tokens)
    sched = NixlConnector(ctx(shard, "kv_consumer", 0, args), KVConnectorRole.SCHEDULER)
    workers = [
        NixlConnector(ctx(shard, "kv_consumer", k, args), KVConnectorRole.WORKER)
        for k in range(shard.world_size)
    ]
    kv = [caches(args, nb, k, fill=False, where=args.dst_device) for k in range(shard.world_size)]
    for w, c in zip(workers, kv, strict=True):
        w.register_kv_caches(c)
    rows, prints, pending = [], [], {}
    n = args.iters + 1
    for k, path in enumerate(args.paths):
        for c in kv:
            for t in (t for pair in c for t in pair if t is not None):
                t.zero_()
        for w in workers:
            w.worker.force_staging = FORCE[path]
        times = []
        for it, p in enumerate(params[k * n : (k + 1) * n]):
            req = Req(f"d{path}{it}", [0] * args.tokens, kv_transfer_params=p)
            got, _ = sched.get_num_new_matched_tokens(req, 0)
            sched.update_state_after_alloc(req, list(range(nb)), got)
            meta = sched.build_connector_meta(None)
            t0 = time.perf_counter()
            for w in workers:
                w.bind_connector_metadata(meta)
                w.start_load_kv(None)
            while True:
                out = step(workers, pending)
                if out.finished_recving:
                    break
            dt = time.perf_counter() - t0
            assert not out.invalid_block_ids, [w.worker.failures for w in workers]
            if it > 0:  # the first pull includes the handshakes (and the staging buffer)
                times.append(dt)
        rec = {
            key: sum(getattr(w.worker, "recv_" + key)[req.request_id] for w in workers)
            for key in ("bytes", "staged_bytes", "descs")
        }
        rows.append({"path": path, **rec, "best_s": min(times)})
        prints.append([f for c in kv for f in fingerprint(c)])
    for w in workers:
        w.shutdown()
    same = all(
        all(torch.equal(a, b) for a, b in zip(prints[0], p, strict=True)) for p in prints[1:]
    )
    return rows, same


def report(args, rows, same, ceiling) -> None:
    recs = [
        {
            "tokens": args.tokens,
            "src_dcp": args.src_dcp,
            "dst_dcp": args.dst_dcp,
            "interleave": args.interleave,
            "device": f"{args.src_device}->{args.dst_device}",
            **r,
            "bytes_per_token": r["bytes"] / (args.tokens - 1),
            "nixl_gbps": r["bytes"] / r["best_s"] / 1e9,
            "copy_ceiling_gbps": ceiling,
            "same_as_first_path": same,
        }
        for r in rows
    ]
    if args.json:
        for rec in recs:
            print(json.dumps(rec))
        return
    print(f"memory: {args.src_device} -> {args.dst_device}")
    if len(rows) > 1:
        print(f"verification: {'passed' if same else 'FAILED'} (paths landed the same bytes)")
    print(
        f"{'layout':>16} {'path':>7} {'GiB':>7} {'B/token':>8} {'descs':>9} {'time s':>7} "
        f"{'GB/s':>6} {'copy GB/s':>9}"
    )
    lay = f"DCP{args.src_dcp}->DCP{args.dst_dcp} I{args.interleave}"
    for rec in recs:
        path = rec["path"] + ("*" if rec["staged_bytes"] else "")
        print(
            f"{lay:>16} {path:>7} {rec['bytes'] / 2**30:7.2f} {rec['bytes_per_token']:8.0f} "
            f"{rec['descs']:9d} {rec['best_s']:7.3f} {rec['nixl_gbps']:6.2f} {ceiling:9.2f}"
        )
    if any(r["staged_bytes"] for r in recs):
        print("* read through the staging buffer")


if __name__ == "__main__":
    main()
