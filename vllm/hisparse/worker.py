"""Worker side of HiSparse: device page tables, the host pool, page backups (``HiSparseWorker``,
the runner's KV cache and step hooks), and how the layers reach offloaded rows
(``HiSparseKVAccess``).

Per request slot: `block_table` (the runner's) maps pages to GPU MLA blocks or −1; here
`idx_table` maps pages to indexer blocks (always on GPU), `host_table` to host pages, and the hot
buffer is `hot_slots` (GPU slots of the leased rows) with, per IndexShare group, `hot_pos` (the
position each row holds) and `hot_lru` (last step it was used).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from vllm.attention.kv_access import (
    IndexerQuery,
    KVAccess,
    context_dtype,
    local_decode_topk,
    write_rows,
)
from vllm.attention.metadata import HiSparseMetadata, MLAMetadata
from vllm.core.messages import CachedRequestData, KVCachePlan, KVPageUpdate, NewRequestData
from vllm.hisparse.resolver import apply_copies, prefetch
from vllm.kernels.hisparse_resolve import hisparse_resolve
from vllm.kernels.kv_cache import read_indexer_cache, read_mla_cache
from vllm.kernels.sparse_mla import sparse_mla_decode
from vllm.kv_cache_interface import KVCacheLayout
from vllm.utils import logger
from vllm.worker.gpu.kv_cache import WorkerKVCache
from vllm.worker.gpu.step_hooks import StepHooks


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on `device` aliasing pinned host memory (zero-copy reads over PCIe); on CPU the
    tensor itself. Built with torch alone, through the CUDA array interface; the view keeps
    `host` alive."""
    if device.type != "cuda":
        return host
    assert host.is_pinned(), "zero-copy device views need pinned host memory"
    raw = torch.as_tensor(_DeviceAlias(host, _host_device_pointer(host.data_ptr())), device=device)
    return raw.view(host.dtype).view(host.shape)


class _DeviceAlias:
    """`host`'s bytes described to torch as device memory at `dptr` (__cuda_array_interface__)."""

    def __init__(self, host: torch.Tensor, dptr: int):
        self.host = host  # torch holds this object for the view's lifetime, and it holds host
        self.__cuda_array_interface__ = {
            "shape": (host.numel() * host.element_size(),),
            "typestr": "|u1",
            "data": (dptr, False),
            "strides": None,
            "version": 3,
        }


def words(rows: torch.Tensor) -> torch.Tensor:
    """The same bytes as 8-byte (or 4-byte) words where the row size allows: torch's gather and
    index_copy move one element per thread, so byte elements over PCIe (zero-copy host views)
    run at a fraction of the link's speed."""
    for dt, n in ((torch.int64, 8), (torch.int32, 4)):
        if rows.shape[-1] % n == 0 and rows.data_ptr() % n == 0 and rows.stride(-1) == 1:
            return rows.view(dt)
    return rows


def _host_device_pointer(ptr: int) -> int:
    """Device address of pinned host memory (cudaHostGetDevicePointer). With unified virtual
    addressing (every 64-bit CUDA platform) it is the host address itself."""
    try:
        from cuda.bindings import runtime as rt

        err, dptr = rt.cudaHostGetDevicePointer(ptr, 0)
        if int(err) == 0:
            return int(dptr)
    except Exception:  # noqa: BLE001 (no cuda-python: fall back to UVA identity)
        pass
    return ptr


class HiSparseWorker(WorkerKVCache, StepHooks):
    """This rank's HiSparse state: a device pool (resident pages and hot buffers), a pinned host
    pool holding every completed page, the per-request page tables, and the step's backups."""

    # The next step may be launched before this one is read (--async-scheduling): the page
    # tables follow the scheduler's messages, every copy (restores, fetches, backups) is device
    # work ordered on the compute stream or behind the backup event, and nothing here reads the
    # device back; a block the scheduler frees (a drop, a finished request) is reused by a later
    # step, queued behind the steps still reading it.
    pipelines = True

    def __init__(
        self,
        layers: list,
        layout: KVCacheLayout,
        block_table: torch.Tensor,
        max_pages: int,
        hot_rows: int,
        host_pool_gib: float,
        device: torch.device,
        num_blocks_override: int | None = None,
    ):
        """``block_table``: the runner's [max_reqs, max_pages] device block per page (−1 once a
        page is dropped), shared, not copied."""
        super().__init__(layers, layout, 0, device, num_blocks_override)
        self.block_table, self.hot_rows, self.host_pool_gib = block_table, hot_rows, host_pool_gib
        # IndexShare groups: a full layer and the shared layers that reuse its top-k
        self.group_of: list[int] = []
        self.groups: list[list[int]] = []
        for i, attn in enumerate(self.layers):
            if attn.has_indexer or not self.groups:
                self.groups.append([])
            self.groups[-1].append(i)
            self.group_of.append(len(self.groups) - 1)
        g, r = len(self.groups), block_table.shape[0]
        self.idx_table = torch.zeros(r, max_pages, dtype=torch.int32, device=device)
        self.host_table = torch.zeros(r, max_pages, dtype=torch.int64, device=device)
        self.host_np = np.zeros((r, max_pages), dtype=np.int64)
        self.num_pages = np.zeros(r, dtype=np.int64)
        self.hot_slots = torch.zeros(r, hot_rows, dtype=torch.int64, device=device)
        self.hot_pos = torch.full(
            (g, r, hot_rows + 1), -1, dtype=torch.int64, device=device
        )  # + trash column
        self.hot_lru = torch.zeros((g, r, hot_rows + 1), dtype=torch.int64, device=device)
        self.stats = torch.zeros(3, dtype=torch.int64, device=device)  # hits, misses, resident
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.backup_event = None
        self.step = 0
        self.step_t = torch.zeros(1, dtype=torch.int64, device=device)  # the step, for graphs
        # host -> device copies of per-step index arrays: the runner's pinned staging when set
        # (a copy from pageable memory synchronises the stream mid-step)
        self.h2d = None
        self.kv_access = HiSparseKVAccess(self)

    def _dev(self, arr) -> torch.Tensor:
        arr = np.ascontiguousarray(arr)
        return self.h2d(arr) if self.h2d is not None else torch.from_numpy(arr).to(self.device)

    # ---- memory (WorkerKVCache) --------------------------------------------------------------------
    def mla_bytes_per_block(self) -> int:
        return len(self.layers) * self.layout.mla_bytes_per_token * self.layout.block_size

    def idx_bytes_per_block(self) -> int:
        return (
            sum(a.has_indexer for a in self.layers)
            * self.layout.indexer_bytes_per_token
            * self.layout.block_size
        )

    def plan(self, budget_bytes: int) -> KVCachePlan:
        """Host pages from the pool size; indexer keys for every host page on the device; the
        rest of the budget for device MLA pages (less one: the trash block of masked copies)."""
        n_host = int(self.host_pool_gib * 2**30) // (
            self.mla_bytes_per_block() + self.idx_bytes_per_block()
        )
        n_idx = n_host  # every token the host pool can hold keeps its indexer keys on the GPU
        rest = budget_bytes - n_idx * self.idx_bytes_per_block()
        n_gpu = self.num_blocks_override or rest // self.mla_bytes_per_block() - 1
        return KVCachePlan(num_blocks=int(n_gpu), num_host_blocks=n_host, num_idx_blocks=n_idx)

    def allocate(self, plan: KVCachePlan, kv_access: KVAccess) -> None:
        """Device MLA caches get one extra block: the trash target of masked copies; the host
        pools one extra page: the trash target of masked backups. Layers reach their rows
        through ``self.kv_access`` whatever ``kv_access`` the runner offers (HiSparse runs on
        one rank per replica: TP/DP/EP need nothing more)."""
        pin = self.device.type == "cuda"
        t0 = time.perf_counter()
        n_gpu, n_host, n_idx = plan.num_blocks, plan.num_host_blocks + 1, plan.num_idx_blocks
        self.trash_slot = n_gpu * self.layout.block_size
        self.trash_host_page = n_host - 1
        self.host_mla, self.host_idx, self.host_mla_dev, self.host_idx_dev = [], [], [], []
        for attn in self.layers:
            idx = self.layout.allocate_indexer(n_idx, self.device) if attn.has_indexer else None
            attn.bind_kv(self.layout.allocate_mla(n_gpu + 1, self.device), idx, self.kv_access)
            h = self.layout.allocate_mla(n_host, "cpu", pin_memory=pin)
            self.host_mla.append(h)
            self.host_mla_dev.append(device_view(h, self.device))
            hi = None
            if attn.has_indexer:
                shape = self.layout.indexer_cache_shape(n_host)
                hi = torch.zeros(shape, dtype=self.layout.storage_dtype, pin_memory=pin)
            self.host_idx.append(hi)
            self.host_idx_dev.append(device_view(hi, self.device) if hi is not None else None)
        host = sum(
            t.numel() * t.element_size() for t in self.host_mla + self.host_idx if t is not None
        )
        logger.info(
            "HiSparse host pool: %.2f GiB%s (%d pages) in %.1f s",
            host / 2**30,
            " pinned" if pin else "",
            n_host,
            time.perf_counter() - t0,
        )

    def transfer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The host pool (pinned): KV received from a prefill engine lands there, by host page."""
        return list(zip(self.host_mla, self.host_idx, strict=True))

    # ---- per-request tables (StepHooks) ----------------------------------------------------------
    def add_request(self, slot: int, req: NewRequestData) -> None:
        self.num_pages[slot] = 0
        self.hot_pos[:, slot] = -1
        self.hot_lru[:, slot] = 0
        self._append(slot, req.kv_update)
        self._restore(slot, req.kv_update.restore)
        self._upload(slot, req.kv_update.upload)

    def update_request(self, slot: int, req: CachedRequestData) -> None:
        upd = req.kv_update
        if upd.dropped:  # index arrays through the staging (a list index copies synchronously)
            self.block_table[slot, self._dev(np.asarray(upd.dropped, dtype=np.int64))] = -1
        self._append(slot, upd)
        self._restore(slot, upd.restore)

    def _append(self, slot: int, upd: KVPageUpdate) -> None:
        n0, new = int(self.num_pages[slot]), len(upd.host)
        if new:
            self.host_np[slot, n0 : n0 + new] = upd.host
            self.host_table[slot, n0 : n0 + new] = self._dev(np.asarray(upd.host, dtype=np.int64))
            self.idx_table[slot, n0 : n0 + new] = self._dev(np.asarray(upd.idx, dtype=np.int32))
            self.num_pages[slot] = n0 + new
        if upd.hot:
            bs = self.layout.block_size
            rows = (np.asarray(upd.hot, dtype=np.int64)[:, None] * bs + np.arange(bs)).reshape(-1)
            self.hot_slots[slot] = self._dev(rows[: self.hot_rows])
            self.hot_pos[:, slot] = -1

    def _restore(self, slot: int, pages: list[int]) -> None:
        """Host-only prefix pages (prefix-cache hits): bring their indexer keys back to the GPU."""
        if not pages:
            return
        src = self._dev(self.host_np[slot, pages])
        dst = self.idx_table[slot, self._dev(np.asarray(pages, dtype=np.int64))].long()
        for attn, h in zip(self.layers, self.host_idx_dev, strict=True):
            if h is not None:
                words(attn.indexer_cache)[dst] = words(h)[src]

    def _upload(self, slot: int, pages: list[int]) -> None:
        """Pages received into the host pool that belong on their device block (the partial last
        page of a prompt whose KV came from a prefill engine): copy their MLA rows there."""
        if not pages:
            return
        src = self._dev(self.host_np[slot, pages])
        dst = self.block_table[slot, self._dev(np.asarray(pages, dtype=np.int64))].long()
        for attn, h in zip(self.layers, self.host_mla_dev, strict=True):
            words(attn.kv_cache)[dst] = words(h)[src]

    # ---- the step (StepHooks) --------------------------------------------------------------------
    def before_forward(self, inp) -> None:
        """Blocks freed by drops may be reused this step: order after last step's backups."""
        self.step += 1
        self.step_t.fill_(self.step)
        if self.backup_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.backup_event)

    def build_metadata(self, inp, meta: MLAMetadata) -> None:
        bs = self.layout.block_size
        idx_bt = self.idx_table[inp.idx_mapping]
        pos = inp.positions.long()
        meta.hisparse = HiSparseMetadata(
            # the device copy, as captured steps read it: on CUDA the resolver then compiles one
            # variant, not a second one for eager steps (each ~20-50 s on a fresh Triton cache)
            step=self.step_t,
            req_slots=inp.idx_np.tolist(),
            req_slots_t=inp.idx_mapping,
            block_table_full=self.block_table,
            idx_block_table=idx_bt,
            idx_slot_mapping=idx_bt[inp.token_req.long(), pos // bs].long() * bs + pos % bs,
            tokens_per_req=int(inp.num_scheduled[~inp.is_prefill].max(initial=1)),
        )

    def graph_metadata(self, meta: MLAMetadata, slots, positions) -> None:
        """A captured decode step (or a drafting step, whose positions live on the device): the
        same tables, gathered on the device; the LRU stamp read from ``step_t``, set before each
        replay; padding rows (position −1) write no keys. Rows hold the same number of tokens
        (``positions`` [B·q]: a verify row of 1 + k, padded)."""
        bs = self.layout.block_size
        idx_bt = self.idx_table[slots]
        pos = positions.clamp_min(0)
        islot = idx_bt[meta.token_req, pos // bs].long() * bs + pos % bs
        meta.hisparse = HiSparseMetadata(
            step=self.step_t,
            req_slots=[],  # host list: prefill only
            req_slots_t=slots,
            block_table_full=self.block_table,
            idx_block_table=idx_bt,
            idx_slot_mapping=torch.where(positions >= 0, islot, -1),
            tokens_per_req=positions.shape[0] // max(slots.shape[0], 1),
        )

    def after_step(self, inp, num_accepted: torch.Tensor | None) -> None:
        """Back up what this step made final: the KV of each row's committed positions (its
        rejected drafts excluded), the target's and the MTP layer's writes both queued."""
        committed = None
        if num_accepted is not None:
            committed = self._dev(inp.seq_lens - inp.num_drafts)
            rows = self._dev(inp.sample_rows)
            committed.index_add_(0, rows, num_accepted.to(committed.dtype))
        self.backup(inp.idx_np, inp.start, inp.seq_lens, committed)

    def device_stats(self) -> dict[str, torch.Tensor]:
        s = self.stats.clone()
        self.stats.zero_()
        return {"hisparse": s}

    def host_stats(self, host: dict[str, torch.Tensor]) -> dict[str, float]:
        hits, misses, resident = host["hisparse"].tolist()
        return {
            "hisparse_hits": hits,
            "hisparse_misses": misses,
            "hisparse_resident": resident,
            "hisparse_h2d_bytes": misses * self.layout.mla_bytes_per_token,
        }

    # ---- page backups ----------------------------------------------------------------------------
    def backup(
        self,
        idx_np: np.ndarray,
        start: np.ndarray,
        seq_lens: np.ndarray,
        committed: torch.Tensor | None = None,
    ) -> None:
        """Copy to the host the pages (MLA rows of every layer + indexer keys) completed this
        step over committed positions: [start // 64, committed // 64) per row, ``committed``
        [B] on the device (None: ``seq_lens``, nothing rejected). The scheduler publishes, and
        may drop, exactly the pages below its rolled-back ``num_computed_tokens``; a page that
        rejected drafts completed is backed up at the step whose accepted tokens pass its end
        (that step starts inside it), so its copy holds the rewritten rows."""
        bs = self.layout.block_size
        pages, slots, rows = [], [], []
        for b, s in enumerate(idx_np.tolist()):
            lo, hi = int(start[b]) // bs, int(seq_lens[b]) // bs
            for pg in range(lo, hi):
                pages.append(pg)
                slots.append(s)
                rows.append(b)
        if not pages:
            return
        s_t = self._dev(np.asarray(slots, dtype=np.int64))
        p_t = self._dev(np.asarray(pages, dtype=np.int64))
        gpu = self.block_table[s_t, p_t].long()
        idx = self.idx_table[s_t, p_t].long()
        host = self._dev(self.host_np[slots, pages])
        if committed is not None:  # pages past the committed end go to the trash page
            done = p_t < committed[self._dev(np.asarray(rows, dtype=np.int64))] // bs
            host = torch.where(done, host, self.trash_host_page)
        stream = self.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            for t in (gpu, idx, host):
                t.record_stream(stream)
        # the GPU writes straight into pinned host memory (device views): asynchronous, no sync
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for i, attn in enumerate(self.layers):
                words(self.host_mla_dev[i]).index_copy_(0, host, words(attn.kv_cache)[gpu])
                if attn.has_indexer:
                    words(self.host_idx_dev[i]).index_copy_(0, host, words(attn.indexer_cache)[idx])
        if stream is not None:
            self.backup_event = torch.cuda.Event()
            self.backup_event.record(stream)


class HiSparseKVAccess(KVAccess):
    """Attention data access with offloaded pages (one rank holds every page of its requests):
    new rows go to the device pool (indexer keys to their own pool), a prefill's context reads
    resident pages in place and dropped ones from the host pool, decode resolves each selected
    position to a resident row, a hot-buffer row, or a row fetched from host memory."""

    def __init__(self, hs: HiSparseWorker):
        self.hs = hs

    def write(self, attn, kv_c, k_pe, index_k, meta):
        # no HiSparse part in a step without requests (a DP dummy step): every slot is −1 there
        hm = meta.hisparse
        write_rows(
            attn,
            kv_c,
            k_pe,
            index_k,
            meta,
            meta.slot_mapping if hm is None else hm.idx_slot_mapping,
        )

    def prefill_context(self, attn, meta: MLAMetadata, r: int, need_index: bool):
        """Full context of request row r: resident pages read in place, dropped ones from host."""
        s = meta.seq_lens_cpu[r]
        bs = meta.layout.block_size
        dev = meta.positions.device
        pos = torch.arange(s, device=dev)
        slot = meta.hisparse.req_slots[r]
        gblk = meta.block_table[r, pos // bs].long()
        on_gpu = gblk >= 0
        cache = words(attn.kv_cache.view(-1, attn.kv_cache.shape[-1]))
        raw_g = cache[(gblk * bs + pos % bs).clamp_min(0)]
        host = self.hs.host_mla_dev[attn.layer_idx]
        hslot = self.hs.host_table[slot, pos // bs] * bs + pos % bs
        # rows resident on the GPU all read one host row instead of their own (no sync to skip
        # them; the link then carries only the dropped rows)
        hslot = torch.where(on_gpu, hslot[:1], hslot)
        raw_h = words(host.view(-1, host.shape[-1]))[hslot]
        raw = torch.where(on_gpu.unsqueeze(1), raw_g, raw_h).view(attn.kv_cache.dtype)
        rows = read_mla_cache(raw.unsqueeze(0), pos, meta.layout, context_dtype(attn.kv_cache))
        idx = None
        if need_index:
            islots = self.hs.idx_table[slot, pos // bs].long() * bs + pos % bs
            idx = read_indexer_cache(attn.indexer_cache, islots, meta.layout)
        return rows, idx

    def decode_topk(self, attn, meta: MLAMetadata, iq: IndexerQuery):
        return local_decode_topk(attn, meta, iq, meta.hisparse.idx_block_table)

    def decode_attend(self, attn, meta: MLAMetadata, q_abs, topk_pos):
        hs, hm = self.hs, meta.hisparse
        me = attn.layer_idx
        g = hs.group_of[me]
        if attn.has_indexer or g not in hm.group_slots:
            self._resolve(meta, g, me, topk_pos)
        else:
            ev = hm.ready.pop(me, None)
            if ev is not None:
                torch.cuda.current_stream(q_abs.device).wait_event(ev)
        out, _ = sparse_mla_decode(
            q_abs, attn.kv_cache, hm.group_slots[g], meta.layout, attn.scale, out_dtype=q_abs.dtype
        )
        return out

    def _resolve(self, meta: MLAMetadata, g: int, me: int, topk_pos: torch.Tensor) -> None:
        """Map the group's selected positions to slots; fetch this layer's missing rows now and
        the group's shared layers' on the copy stream, so that the PCIe-bound fetch overlaps this
        layer's attention and MLP (each shared layer waits for its own rows only)."""
        hs, hm = self.hs, meta.hisparse
        req_slot = hm.req_slots_t[meta.token_req[meta.decode_tokens]]
        res = hisparse_resolve(
            topk_pos,
            req_slot,
            hm.block_table_full,
            hs.host_table,
            hs.hot_slots,
            hs.hot_pos[g],
            hs.hot_lru[g],
            hm.step,
            hs.trash_slot,
            meta.layout.block_size,
            hm.tokens_per_req,
        )
        group = hs.groups[g]
        apply_copies(res, [hs.layers[me].kv_cache], [hs.host_mla_dev[me]])
        rest = [i for i in group if i != me]
        if rest:
            events = prefetch(
                res,
                [hs.layers[i].kv_cache for i in rest],
                [hs.host_mla_dev[i] for i in rest],
                hs.copy_stream,
            )
            for i, ev in zip(rest, events, strict=True):
                hm.ready[i] = ev
        hs.stats += torch.stack([res.hits, res.num_miss * len(group), res.num_resident])
        hm.group_slots[g] = res.slots
