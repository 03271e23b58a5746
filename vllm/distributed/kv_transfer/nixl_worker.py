"""The NixlConnector's worker half: one NIXL agent per rank (UCX backend), DRAM or VRAM.

Producer role: register this rank's caches, serve the handshake on the side channel (agent
metadata, per-layer cache addresses, compatibility hash), count the consumers' notifications and
release leases (confirmed by every consumer rank, or expired).

Consumer role: per request, handshake with every rank of the producer replica (in a thread pool;
the step never blocks), plan the reads with ``reshard.plan_reads`` (only rows this rank owns),
post one NIXL READ per producer rank covering every layer, poll, notify every producer rank, and
report the request. A failed handshake (producer gone, incompatible caches), a transfer error or
``kv_load_timeout_s`` fails the load: it is still reported finished, and its local blocks are
listed by :meth:`NixlWorker.take_load_errors`.

Short runs (mean below ``STAGE_BELOW_ROWS`` rows, e.g. DCP2 interleave 1 -> DCP1: single rows)
make a READ descriptor-bound. Where staging at least halves the runs, the read is *staged*: its
source-contiguous runs are READ into this rank's staging buffer (registered with NIXL, on the
caches' device), and once the READ is done the rows are scattered to their slots with one indexed
copy per cache tensor and region (``_scatter``; one kernel each on a GPU), before the load is
reported. The buffer is allocated at first use, grows to the largest chunk asked for and holds
at most ``STAGING_MAX_BYTES`` (256 MiB per rank, kept until shutdown); a bigger read goes
through it in chunks, one chunk of one load at a time.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.distributed.kv_transfer.base import KVConnectorContext, LayerKVCache
from vllm.distributed.kv_transfer.nixl_params import (
    NixlConnectorMetadata,
    NixlRecvReq,
    source_layout,
)
from vllm.distributed.kv_transfer.reshard import (
    KVShardLayout,
    RankReads,
    Region,
    SlotRuns,
    StagedRows,
    cache_byte_runs,
    indexer_regions,
    mla_regions,
    plan_reads,
    source_runs,
    staged_byte_runs,
    staged_rows,
)
from vllm.distributed.kv_transfer.side_channel import SideChannelServer, side_channel_request
from vllm.utils import logger

HANDSHAKE_TIMEOUT_S = 5.0
RECENT_LOADS = 1024  # per-request records kept (failures, bytes): the latest loads only
# A read is staged when its direct runs average fewer rows than this and staging at least halves
# its runs. bench_nixl_transfer.py, CPU, GLM-5.3 rows, 8K tokens DCP2 -> DCP1: interleave 16
# staged 0.97 GB/s against direct 0.72; interleave 32 direct 1.33 against staged 1.10.
STAGE_BELOW_ROWS = 32
STAGING_MAX_BYTES = 256 << 20  # per rank; 4,900 GLM-5.3 tokens (54,728 B each) per chunk
STAGING_ALIGN = 64  # bytes: every staged area starts on a cache line


@dataclass
class RemoteRank:
    """One producer rank after its handshake."""

    agent_name: str
    layers: list[list[int]]  # per layer [mla addr, mla bytes, indexer addr (0: none), bytes]
    mem_type: str
    device_id: int


@dataclass
class CacheKind:
    """The MLA caches, or the indexer caches, of every layer that has one: the same regions."""

    col: int  # column of the cache's address in ``layers`` (local and remote)
    regions: list[Region]
    ids: list[int]  # layers with this cache
    views: list[list[torch.Tensor]]  # [region][layer]: [pages, rows_per_page, row words]


@dataclass
class StagedChunk:
    """Rows that go through the staging buffer at once (from one or more producer ranks)."""

    parts: list[tuple[int, SlotRuns]]  # (producer rank, source runs; dst = row in the chunk)
    dst: np.ndarray  # [rows] destination slot of each chunk row
    bases: list[list[np.ndarray]] = field(default_factory=list)  # [kind][region]: per-layer area


@dataclass
class Load:
    req: NixlRecvReq
    src: KVShardLayout | None
    ports: list[tuple[str, int]]  # side channel of every producer rank
    deadline: float
    reads: list[RankReads] = field(default_factory=list)
    remotes: list[RemoteRank] = field(default_factory=list)
    handles: list = field(default_factory=list)  # direct READs
    chunks: list[StagedChunk] = field(default_factory=list)  # staged, not posted yet
    staged: StagedChunk | None = None  # in the staging buffer (READ posted)
    stage_handles: list = field(default_factory=list)
    posted: bool = False
    num_bytes: int = 0
    num_descs: int = 0
    num_staged_bytes: int = 0


class StagingBuffer:
    """This rank's registered memory for staged reads, on the caches' device: one chunk at a
    time, grown (re-registered) to the largest chunk asked for."""

    def __init__(self, agent, device: torch.device):
        self.agent, self.device = agent, device
        self.tensor: torch.Tensor | None = None
        self.reg = None
        self.owner: str | None = None  # request whose chunk is in the buffer
        self.event = None  # GPU: the last scatter; the buffer is refilled once it has run
        self.retired: list = []  # (tensor, registration) a READ may still write into

    @property
    def free(self) -> bool:
        return self.owner is None and (self.event is None or self.event.query())

    def acquire(self, owner: str, nbytes: int, max_bytes: int) -> int:
        """The buffer's address, at least ``nbytes`` long, for ``owner``'s chunk (grown to a
        power of two, at most ``max_bytes`` unless one chunk needs more)."""
        if self.tensor is None or self.tensor.numel() < nbytes:
            self._drop()
            size = max(nbytes, min(max_bytes, 1 << max(20, (nbytes - 1).bit_length())))
            self.tensor = torch.empty(size, dtype=torch.uint8, device=self.device)
            self.reg = self.agent.register_memory([self.tensor])
        self.owner = owner
        return self.tensor.data_ptr()

    def release(self, in_flight: bool) -> None:
        """The chunk is done (scattered or abandoned); a READ that could not be stopped keeps the
        memory it writes into alive until shutdown."""
        if in_flight and self.tensor is not None:
            self.retired.append((self.tensor, self.reg))
            self.tensor = self.reg = None
        self.owner = None

    def scattered(self) -> None:
        if self.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()
        self.owner = None

    def _drop(self) -> None:
        if self.reg is not None:
            self.agent.deregister_memory(self.reg)
        self.tensor = self.reg = None

    def close(self) -> None:
        self._drop()
        for _, reg in self.retired:
            try:
                self.agent.deregister_memory(reg)
            except Exception:
                pass
        self.retired = []


def word_view(t: torch.Tensor, region: Region) -> torch.Tensor:
    """``region``'s rows of cache ``t`` as [pages, rows_per_page, words], words the widest that
    divide every offset: torch's indexed copies move one element per thread, so byte elements
    run at a fraction of the memory's speed."""
    b = t.view(-1).view(torch.uint8)
    sizes = (region.row_bytes, region.page_bytes, region.base, b.numel(), b.data_ptr())
    w = next(w for w in (8, 4, 2, 1) if all(x % w == 0 for x in (*sizes, b.storage_offset())))
    v = b.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[w])
    rpp, rw = region.rows_per_page, region.row_bytes // w
    shape = (b.numel() // region.page_bytes, rpp, rw)
    return v.as_strided(
        shape, (region.page_bytes // w, rw, 1), v.storage_offset() + region.base // w
    )


def compat_info(ctx: KVConnectorContext, kv_caches: list[LayerKVCache]) -> dict:
    """What both engines must agree on for rows to be copied byte for byte."""
    lay = ctx.layout
    return {
        "model": ctx.model_name,
        "cache_dtype": lay.cache_dtype,
        "storage_dtype": str(lay.storage_dtype),
        "kv_lora_rank": lay.kv_lora_rank,
        "rope_dim": lay.rope_dim,
        "index_head_dim": lay.index_head_dim,
        "block_size": lay.block_size,
        "mla_bytes_per_token": lay.mla_bytes_per_token,
        "indexer_bytes_per_token": lay.indexer_bytes_per_token,
        "num_layers": len(kv_caches),
        "indexer_layers": [i for i, (_, idx) in enumerate(kv_caches) if idx is not None],
    }


def _keep_recent(*records: dict) -> None:
    """Forget the oldest entries of per-request records (a server runs for months)."""
    for r in records:
        while len(r) > RECENT_LOADS:
            del r[next(iter(r))]


def compat_hash(info: dict) -> str:
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()[:16]


class NixlWorker:
    def __init__(self, ctx: KVConnectorContext, engine_id: str):
        from nixl._api import nixl_agent, nixl_agent_config

        self.ctx, self.cfg, self.engine_id = ctx, ctx.config, engine_id
        name = f"{engine_id}-dp{ctx.dp_rank}-r{ctx.rank}-{uuid.uuid4().hex[:6]}"
        # no progress thread: it busy-polls a core per rank. Transfers progress when the engine
        # polls them (every step, and every few ms while any is in flight: engine/core.py).
        # kv_connector_extra_config {"nixl_progress_thread": true} turns it back on.
        prog = bool(self.cfg.kv_connector_extra_config.get("nixl_progress_thread", False))
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=prog, backends=["UCX"]))
        self.layers: list[list[int]] = []
        self.compat: dict = {}
        self.compat_hash = ""
        self.server: SideChannelServer | None = None
        self._reg = None
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-handshake")
        self._handshakes: dict[tuple[str, int], Future] = {}
        self._remotes: dict[tuple[str, int], RemoteRank] = {}
        self._agents: set[str] = set()  # remote agents whose metadata NIXL holds
        self._peers: dict[tuple[str, int], str] = {}  # side channel -> agent name (notifications)
        self._loads: dict[str, Load] = {}
        self._leases: dict[str, float] = {}  # producer request id -> deadline
        self._notified: dict[str, list] = {}  # request id -> [count, expected, first seen]
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._zombies: list = []  # handles that could not be released (in flight)
        self.failures: dict[str, str] = {}  # request id -> why its load failed
        self.recv_bytes: dict[str, int] = {}  # request id -> bytes read (and descriptors)
        self.recv_descs: dict[str, int] = {}
        self.recv_staged_bytes: dict[str, int] = {}  # of recv_bytes, those read through staging
        # None: stage reads by the rule above; True / False: always / never (tests, benchmark)
        self.force_staging: bool | None = None
        self.staging_max_bytes = STAGING_MAX_BYTES
        self._kinds: list[CacheKind] = []
        self._staging: StagingBuffer | None = None
        self._new_failures: dict[str, str] = {}  # since the last take_failures_and_stats
        self._stats: dict[str, float] = {}

    # ---- registration and handshake (producer) -------------------------------------------------
    def register_kv_caches(self, kv_caches: list[LayerKVCache]) -> None:
        tensors = [t for pair in kv_caches for t in pair if t is not None]
        if not all(t.is_contiguous() for t in tensors):
            raise ValueError("KV caches must be contiguous to be registered with NIXL")
        dev = tensors[0].device
        self.mem_type = "VRAM" if dev.type == "cuda" else "DRAM"
        self.device_id = dev.index or 0
        self._reg = self.agent.register_memory(tensors)
        self._kv_caches = kv_caches  # registered memory must outlive the registration
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        self.layers = [
            [
                m.data_ptr(),
                nbytes(m),
                0 if x is None else x.data_ptr(),
                0 if x is None else nbytes(x),
            ]
            for m, x in kv_caches
        ]
        lay = self.ctx.layout
        self._kinds = []
        for col, regions in ((0, mla_regions(lay)), (2, indexer_regions(lay))):
            ids = [i for i, layer in enumerate(self.layers) if layer[col]]
            views = [[word_view(kv_caches[i][col // 2], r) for i in ids] for r in regions]
            self._kinds.append(CacheKind(col, regions, ids, views))
        self._staging = StagingBuffer(self.agent, dev)
        self.compat = compat_info(self.ctx, kv_caches)
        self.compat_hash = compat_hash(self.compat)
        if self.cfg.is_kv_producer:
            payload = {
                "engine_id": self.engine_id,
                "agent_name": self.agent.name,
                "agent_metadata": self.agent.get_agent_metadata(),
                "compat": self.compat,
                "compat_hash": self.compat_hash,
                "layers": self.layers,
                "mem_type": self.mem_type,
                "device_id": self.device_id,
            }
            port = self.cfg.side_channel_port + self.ctx.dp_rank * self.ctx.shard.world_size
            self.server = SideChannelServer(
                self.cfg.kv_ip, port + self.ctx.rank, lambda req: payload
            )

    def _handshake(self, key: tuple[str, int]) -> None:
        if key not in self._remotes and key not in self._handshakes:
            timeout = min(HANDSHAKE_TIMEOUT_S, self.cfg.kv_load_timeout_s)
            msg = {"op": "handshake", "compat_hash": self.compat_hash}
            self._handshakes[key] = self._pool.submit(side_channel_request, *key, msg, timeout)

    def _remote(self, key: tuple[str, int]) -> RemoteRank | None:
        """The remote rank once its handshake is in; None while pending; raises if it failed."""
        if key in self._remotes:
            return self._remotes[key]
        fut = self._handshakes[key]
        if not fut.done():
            return None
        del self._handshakes[key]  # a failed handshake is retried by the next load
        reply = fut.result()
        name = reply["agent_name"]
        if name not in self._agents:  # a re-handshake after a failure may find the same agent
            self.agent.add_remote_agent(reply["agent_metadata"])
            self._agents.add(name)
        self._peers[key] = name  # notifications go there, compatible or not
        if reply["compat_hash"] != self.compat_hash:
            diff = {
                k: (reply["compat"].get(k), v)
                for k, v in self.compat.items()
                if reply["compat"].get(k) != v
            }
            raise RuntimeError(
                f"incompatible KV caches with engine {reply['engine_id']} at {key[0]}:{key[1]} "
                f"(theirs, ours): {diff}"
            )
        rr = RemoteRank(name, reply["layers"], reply["mem_type"], reply["device_id"])
        self._remotes[key] = rr
        return rr

    # ---- loads (consumer) ------------------------------------------------------------------------
    def start(self, meta: NixlConnectorMetadata) -> None:
        now = time.monotonic()
        for req_id, lease_s in meta.reqs_to_send.items():
            self._leases[req_id] = now + lease_s
        for req in meta.reqs_to_recv:
            self._begin(req, now)
        self._progress()

    def _begin(self, req: NixlRecvReq, now: float) -> None:
        p = req.params
        load = Load(req, None, [], now + self.cfg.kv_load_timeout_s)
        self._loads[req.req_id] = load
        try:
            load.src = source_layout(p)
            load.ports = [
                (p["remote_host"], p["remote_port"] + k) for k in range(load.src.world_size)
            ]
            if req.hi > req.lo:
                shard = self.ctx.shard
                dst_ids = [req.local_block_ids] * shard.dcp_size
                load.reads = plan_reads(
                    load.src, p["remote_block_ids"], shard, dst_ids, self.ctx.rank, req.lo, req.hi
                )
        except (ValueError, KeyError, TypeError, IndexError) as e:
            self._fail(load, f"bad kv_transfer_params: {e}")
            return
        for key in load.ports:
            self._handshake(key)

    def _progress(self) -> None:
        now = time.monotonic()
        for load in list(self._loads.values()):
            try:
                if not load.posted:
                    remotes = [self._remote(k) for k in load.ports]
                    if any(r is None for r in remotes):
                        if now > load.deadline:
                            raise TimeoutError("handshake timed out")
                        continue
                    self._post(load, remotes)
                if self._advance(load):
                    self._finish(load)
                elif now > load.deadline:
                    raise TimeoutError(f"transfer not done after {self.cfg.kv_load_timeout_s} s")
            except Exception as e:
                self._fail(load, f"{type(e).__name__}: {e}")

    def _advance(self, load: Load) -> bool:
        """Poll a posted load's READs, scatter a landed chunk, post the next one when the staging
        buffer is free; True once every row is in place."""
        direct = [self.agent.check_xfer_state(h) for h in load.handles]
        staged = [self.agent.check_xfer_state(h) for h in load.stage_handles]
        if "ERR" in direct or "ERR" in staged:
            raise RuntimeError("NIXL transfer failed")
        if load.staged is not None and all(s == "DONE" for s in staged):
            self._scatter(load.staged)
            self._release_handles(load.stage_handles)
            load.stage_handles, load.staged = [], None
            self._staging.scattered()
        if load.staged is None and load.chunks and self._staging.free:
            self._post_chunk(load, load.chunks.pop(0))
        return load.staged is None and not load.chunks and all(s == "DONE" for s in direct)

    def _stage(self, runs: SlotRuns) -> StagedRows | None:
        """The read's rows in source order if it goes through the staging buffer."""
        if len(runs) == 0 or self.force_staging is False:
            return None
        if self.force_staging is None and runs.num_rows >= STAGE_BELOW_ROWS * len(runs):
            return None
        rows = staged_rows(runs)
        if self.force_staging is None and 2 * len(source_runs(rows.src)) > len(runs):
            return None
        return rows

    def _post(self, load: Load, remotes: list[RemoteRank]) -> None:
        load.remotes = remotes
        staged = []
        for rr in load.reads:
            rows = self._stage(rr.runs)
            if rows is not None:
                staged.append((rr.src_rank, rows))
                continue
            remote = remotes[rr.src_rank]
            loc, rem, lens = [], [], []
            for kind in self._kinds:
                lb = np.array([self.layers[i][kind.col] for i in kind.ids], dtype=np.int64)
                rb = np.array([remote.layers[i][kind.col] for i in kind.ids], dtype=np.int64)
                br = cache_byte_runs(rr.runs, kind.regions)
                loc.append((lb[:, None] + br.dst).ravel())
                rem.append((rb[:, None] + br.src).ravel())
                lens.append(np.tile(br.length, len(kind.ids)))
            load.handles.append(self._read(load, remote, loc, rem, lens))
        load.chunks = self._chunks(staged)
        load.posted = True

    def _read(self, load: Load, remote: RemoteRank, loc, rem, lens):
        """Post one READ of byte ranges (lists of address / length arrays) from ``remote``."""
        n = np.concatenate(lens)
        local = np.stack([np.concatenate(loc), n, np.full_like(n, self.device_id)], 1)
        remote_d = np.stack([np.concatenate(rem), n, np.full_like(n, remote.device_id)], 1)
        handle = self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs(local.astype(np.uint64), self.mem_type),
            self.agent.get_xfer_descs(remote_d.astype(np.uint64), remote.mem_type),
            remote.agent_name,
        )
        if self.agent.transfer(handle) == "ERR":
            self._release_handles([handle])
            raise RuntimeError(f"NIXL READ from {remote.agent_name} failed to start")
        load.num_bytes += int(n.sum())
        load.num_descs += len(n)
        return handle

    # ---- staging -------------------------------------------------------------------------------
    def _areas(self, num_rows: int) -> tuple[list[list[np.ndarray]], int]:
        """Staging layout of a chunk: [kind][region] per-layer area offsets (each area
        ``num_rows`` packed rows of the region), and the bytes it takes."""
        off, bases = 0, []
        for kind in self._kinds:
            per = []
            for r in kind.regions:
                step = -(-num_rows * r.row_bytes // STAGING_ALIGN) * STAGING_ALIGN
                per.append(off + step * np.arange(len(kind.ids), dtype=np.int64))
                off += step * len(kind.ids)
            bases.append(per)
        return bases, off

    def _chunks(self, staged: list[tuple[int, StagedRows]]) -> list[StagedChunk]:
        """Pack the staged reads' rows into chunks that fit ``staging_max_bytes``."""
        row = sum(len(k.ids) * sum(r.row_bytes for r in k.regions) for k in self._kinds)
        areas = sum(len(k.ids) * len(k.regions) for k in self._kinds)
        cap = max(1, (self.staging_max_bytes - STAGING_ALIGN * areas) // row)
        chunks, parts, dsts, n = [], [], [], 0
        for rank, rows in staged:
            a = 0
            while a < len(rows):
                b = min(len(rows), a + cap - n)
                parts.append((rank, source_runs(rows.src[a:b], n)))
                dsts.append(rows.dst[a:b])
                n, a = n + b - a, b
                if n == cap:
                    chunks.append(StagedChunk(parts, np.concatenate(dsts)))
                    parts, dsts, n = [], [], 0
        if n:
            chunks.append(StagedChunk(parts, np.concatenate(dsts)))
        return chunks

    def _post_chunk(self, load: Load, chunk: StagedChunk) -> None:
        """READ a chunk's source runs into the staging buffer, one READ per producer rank."""
        chunk.bases, nbytes = self._areas(len(chunk.dst))
        addr = self._staging.acquire(load.req.req_id, nbytes, self.staging_max_bytes)
        load.staged = chunk
        for rank, runs in chunk.parts:
            remote = load.remotes[rank]
            loc, rem, lens = [], [], []
            for kind, kb in zip(self._kinds, chunk.bases, strict=True):
                rb = np.array([remote.layers[i][kind.col] for i in kind.ids], dtype=np.int64)
                for region, lb in zip(kind.regions, kb, strict=True):
                    br = staged_byte_runs(runs, region)
                    loc.append((addr + lb[:, None] + br.dst).ravel())
                    rem.append((rb[:, None] + br.src).ravel())
                    lens.append(np.tile(br.length, len(kind.ids)))
            before = load.num_bytes
            load.stage_handles.append(self._read(load, remote, loc, rem, lens))
            load.num_staged_bytes += load.num_bytes - before

    def _scatter(self, chunk: StagedChunk) -> None:
        """Staged row r to destination slot ``chunk.dst[r]``: one indexed copy per cache tensor
        and region, on the caches' device (8-byte words where the row allows)."""
        buf = self._staging.tensor
        n = len(chunk.dst)
        dst = torch.from_numpy(chunk.dst).to(buf.device)
        for kind, kb in zip(self._kinds, chunk.bases, strict=True):
            for region, lb, views in zip(kind.regions, kb, kind.views, strict=True):
                page, row = dst // region.rows_per_page, dst % region.rows_per_page
                size = n * region.row_bytes
                for off, view in zip(lb.tolist(), views, strict=True):
                    view[page, row] = buf[off : off + size].view(view.dtype).view(n, -1)

    def _finish(self, load: Load) -> None:
        self._release(load)
        self._notify(load)
        del self._loads[load.req.req_id]
        self.recv_bytes[load.req.req_id] = load.num_bytes
        self.recv_descs[load.req.req_id] = load.num_descs
        self.recv_staged_bytes[load.req.req_id] = load.num_staged_bytes
        _keep_recent(self.recv_bytes, self.recv_descs, self.recv_staged_bytes)
        self._count("kv_transfer_recv_bytes", load.num_bytes)
        self._count("kv_transfer_num_loads", 1)
        if load.req.hi > load.req.lo:
            self._done_recving.add(load.req.req_id)

    def _fail(self, load: Load, why: str) -> None:
        req = load.req
        logger.warning("KV load of request %s failed: %s", req.req_id, why)
        self.failures[req.req_id] = why
        _keep_recent(self.failures)
        self._new_failures[req.req_id] = why
        self._count("kv_transfer_num_failed_loads", 1)
        self._release(load)
        for key in load.ports:  # a remote that failed us may be gone: handshake again next time
            self._remotes.pop(key, None)
        self._notify(load)
        self._loads.pop(req.req_id, None)
        if req.hi > req.lo:
            span = self.ctx.shard.block_size * self.ctx.shard.dcp_size
            first, last = req.lo // span, -(-req.hi // span)
            self._load_errors.update(req.local_block_ids[first:last])
            self._done_recving.add(req.req_id)

    def _release(self, load: Load) -> None:
        self._release_handles(load.handles)
        staged_done = self._release_handles(load.stage_handles)
        if self._staging is not None and self._staging.owner == load.req.req_id:
            self._staging.release(in_flight=not staged_done)
        load.handles, load.stage_handles, load.staged, load.chunks = [], [], None, []

    def _release_handles(self, handles: list) -> bool:
        """Release transfer handles; False if one was still in flight (retried at shutdown)."""
        done = True
        for h in handles:
            try:
                self.agent.release_xfer_handle(h)
            except Exception:
                self._zombies.append(h)
                done = False
        return done

    def _notify(self, load: Load) -> None:
        """Tell every producer rank this consumer rank is done with the request (best effort:
        a producer that is gone frees its blocks when it restarts or its lease expires)."""
        msg = f"{load.req.params.get('remote_request_id')}:{self.ctx.shard.world_size}".encode()
        for key in load.ports:
            if key not in self._peers and key in self._handshakes:
                try:
                    self._remote(key)
                except Exception:
                    pass
            name = self._peers.get(key)
            if name is not None:
                try:
                    self.agent.send_notif(name, msg)
                except Exception as e:
                    logger.warning("KV notification to %s failed: %s", name, e)

    # ---- leases (producer) ----------------------------------------------------------------------
    def _poll_leases(self) -> None:
        now = time.monotonic()
        if self.cfg.is_kv_producer:
            for msgs in self.agent.get_new_notifs().values():
                for m in msgs:
                    req, n = m.decode().rsplit(":", 1)
                    self._notified.setdefault(req, [0, int(n), now])[0] += 1
        for req, deadline in list(self._leases.items()):
            seen = self._notified.get(req)
            if seen is not None and seen[0] >= seen[1]:
                del self._notified[req]
            elif now > deadline:
                logger.warning("KV lease of request %s expired: freeing its blocks", req)
            else:
                continue
            del self._leases[req]
            self._done_sending.add(req)
        stale = now - self.cfg.kv_lease_timeout_s
        for req in [r for r, s in self._notified.items() if s[2] < stale]:
            del self._notified[req]

    def get_finished(self) -> tuple[set[str], set[str]]:
        self._progress()
        self._poll_leases()
        out = (self._done_sending, self._done_recving)
        self._done_sending, self._done_recving = set(), set()
        return out

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def _count(self, key: str, n: int) -> None:
        self._stats[key] = self._stats.get(key, 0) + n

    def take_failures_and_stats(self) -> tuple[dict[str, str], dict[str, float]]:
        out = (self._new_failures, self._stats)
        self._new_failures, self._stats = {}, {}
        return out

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        for load in list(self._loads.values()):
            self._release(load)
        for h in self._zombies:
            try:
                self.agent.release_xfer_handle(h)
            except Exception:
                pass
        self._zombies = []
        if self._staging is not None:
            self._staging.close()
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg = None
