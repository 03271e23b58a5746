"""Worker side of HiSparse: device page tables, the host pool, page backups, and the attention
data access (`HiSparseContext`) that the layers use through `meta.cp`.

Per request slot: `block_table` (the runner's) maps pages to GPU MLA blocks or −1; here
`idx_table` maps pages to indexer blocks (always on GPU), `host_table` to host pages, and the hot
buffer is `hot_slots` (GPU slots of the leased rows) with, per IndexShare group, `hot_pos` (the
position each row holds) and `hot_lru` (last step it was used).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.attention.kv_cache import KVCacheLayout, read_indexer_cache_ref, read_mla_cache_ref
from vllm.attention.layer import LocalContext, context_dtype
from vllm.attention.metadata import MLAMetadata
from vllm.attention.ops import dispatch
from vllm.hisparse.resolver import apply_copies, prefetch


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on `device` aliasing pinned host memory (zero-copy reads over PCIe); on CPU the
    tensor itself."""
    if device.type != "cuda":
        return host
    import cupy  # the GPU image ships CuPy

    dptr = _host_device_pointer(host.data_ptr())
    mem = cupy.cuda.UnownedMemory(dptr, host.nbytes, host)
    arr = cupy.ndarray((host.nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    return torch.from_dlpack(arr).view(host.dtype).view(host.shape)


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


class HiSparseWorker:
    def __init__(
        self,
        model,
        layout: KVCacheLayout,
        max_reqs: int,
        max_pages: int,
        hot_rows: int,
        device: torch.device,
    ):
        self.layout, self.device = layout, device
        self.layers = model.attention_layers()
        self.hot_rows = hot_rows
        # IndexShare groups: a full layer and the shared layers that reuse its top-k
        self.group_of: list[int] = []
        self.groups: list[list[int]] = []
        for i, attn in enumerate(self.layers):
            if attn.has_indexer or not self.groups:
                self.groups.append([])
            self.groups[-1].append(i)
            self.group_of.append(len(self.groups) - 1)
        for i, attn in enumerate(self.layers):
            attn.hisparse_group = self.group_of[i]
            attn.hisparse_index = i
        g, r = len(self.groups), max_reqs
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
        self.context = HiSparseContext(self)

    # ---- memory ----------------------------------------------------------------------------------
    def mla_bytes_per_block(self) -> int:
        return len(self.layers) * self.layout.mla_bytes_per_token * self.layout.block_size

    def idx_bytes_per_block(self) -> int:
        return (
            sum(a.has_indexer for a in self.layers)
            * self.layout.indexer_bytes_per_token
            * self.layout.block_size
        )

    def allocate(self, num_gpu_blocks: int, num_host_blocks: int, num_idx_blocks: int) -> None:
        """GPU MLA caches get one extra block: the trash target of masked copies."""
        pin = self.device.type == "cuda"
        self.trash_slot = num_gpu_blocks * self.layout.block_size
        self.host_mla, self.host_idx, self.host_mla_dev, self.host_idx_dev = [], [], [], []
        for attn in self.layers:
            attn.kv_cache = self.layout.allocate_mla(num_gpu_blocks + 1, self.device)
            attn.indexer_cache = (
                self.layout.allocate_indexer(num_idx_blocks, self.device)
                if attn.has_indexer
                else None
            )
            h = self.layout.allocate_mla(num_host_blocks, "cpu", pin_memory=pin)
            self.host_mla.append(h)
            self.host_mla_dev.append(device_view(h, self.device))
            hi = (
                torch.zeros(
                    self.layout.indexer_cache_shape(num_host_blocks),
                    dtype=self.layout.storage_dtype,
                    pin_memory=pin,
                )
                if attn.has_indexer
                else None
            )
            self.host_idx.append(hi)
            self.host_idx_dev.append(device_view(hi, self.device) if hi is not None else None)

    # ---- per-request tables ------------------------------------------------------------------
    def on_add(self, slot: int, hs: dict) -> None:
        self.num_pages[slot] = 0
        self.hot_pos[:, slot] = -1
        self.hot_lru[:, slot] = 0
        self._append(slot, hs)
        self._restore(slot, hs.get("restore", []))

    def on_update(self, slot: int, hs: dict) -> None:
        self._append(slot, hs)
        self._restore(slot, hs.get("restore", []))

    def _append(self, slot: int, hs: dict) -> None:
        n0, new = int(self.num_pages[slot]), len(hs["host"])
        if new:
            self.host_np[slot, n0 : n0 + new] = hs["host"]
            self.host_table[slot, n0 : n0 + new] = torch.tensor(hs["host"], dtype=torch.int64)
            self.idx_table[slot, n0 : n0 + new] = torch.tensor(hs["idx"], dtype=torch.int32)
            self.num_pages[slot] = n0 + new
        if hs.get("hot"):
            bs = self.layout.block_size
            rows = (torch.tensor(hs["hot"]).unsqueeze(1) * bs + torch.arange(bs)).flatten()[
                : self.hot_rows
            ]
            self.hot_slots[slot] = rows.to(self.device)
            self.hot_pos[:, slot] = -1

    def _restore(self, slot: int, pages: list[int]) -> None:
        """Host-only prefix pages (prefix-cache hits): bring their indexer keys back to the GPU."""
        if not pages:
            return
        src = torch.tensor(self.host_np[slot, pages], device=self.device)
        dst = self.idx_table[slot, pages].long()
        for attn, h in zip(self.layers, self.host_idx_dev, strict=True):
            if h is not None:
                words(attn.indexer_cache)[dst] = words(h)[src]

    # ---- page backups -------------------------------------------------------------------------------
    def backup(
        self, block_table: torch.Tensor, idx_np: np.ndarray, start: np.ndarray, seq_lens: np.ndarray
    ) -> None:
        """Copy pages completed this step (MLA rows of every layer + indexer keys) to the host."""
        bs = self.layout.block_size
        pages, slots = [], []
        for b, s in enumerate(idx_np.tolist()):
            lo, hi = int(start[b]) // bs, int(seq_lens[b]) // bs
            for pg in range(lo, hi):
                pages.append(pg)
                slots.append(s)
        if not pages:
            return
        s_t = torch.tensor(slots, device=self.device)
        p_t = torch.tensor(pages, device=self.device)
        gpu = block_table[s_t, p_t].long()
        idx = self.idx_table[s_t, p_t].long()
        host = torch.from_numpy(self.host_np[slots, pages]).to(self.device)
        stream = self.copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            for t in (gpu, idx, host):
                t.record_stream(stream)
        # the GPU writes straight into pinned host memory (device views): asynchronous, no sync
        with torch.cuda.stream(stream) if stream is not None else _nullcontext():
            for i, attn in enumerate(self.layers):
                words(self.host_mla_dev[i]).index_copy_(0, host, words(attn.kv_cache)[gpu])
                if attn.has_indexer:
                    words(self.host_idx_dev[i]).index_copy_(0, host, words(attn.indexer_cache)[idx])
        if stream is not None:
            self.backup_event = torch.cuda.Event()
            self.backup_event.record(stream)

    def before_step(self) -> None:
        """Blocks freed by drops may be reused this step: order after last step's backups."""
        if self.backup_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.backup_event)

    def take_stats(self) -> torch.Tensor:
        s = self.stats.clone()
        self.stats.zero_()
        return s


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class HiSparseContext(LocalContext):
    """Attention data access with offloaded pages (single rank; TP/DP/EP need nothing more)."""

    def __init__(self, hs: HiSparseWorker):
        self.hs = hs

    def prefill_context(self, attn, meta: MLAMetadata, r: int, need_index: bool):
        """Full context of request row r: resident pages read in place, dropped ones from host."""
        s = meta.seq_lens_cpu[r]
        bs = meta.layout.block_size
        dev = meta.positions.device
        pos = torch.arange(s, device=dev)
        slot = meta.extras["req_slots"][r]
        gblk = meta.block_table[r, pos // bs].long()
        on_gpu = gblk >= 0
        cache = words(attn.kv_cache.view(-1, attn.kv_cache.shape[-1]))
        raw_g = cache[(gblk * bs + pos % bs).clamp_min(0)]
        i = attn.hisparse_index
        host = self.hs.host_mla_dev[i]
        hslot = self.hs.host_table[slot, pos // bs] * bs + pos % bs
        # rows resident on the GPU all read one host row instead of their own (no sync to skip
        # them; the link then carries only the dropped rows)
        hslot = torch.where(on_gpu, hslot[:1], hslot)
        raw_h = words(host.view(-1, host.shape[-1]))[hslot]
        raw = torch.where(on_gpu.unsqueeze(1), raw_g, raw_h).view(attn.kv_cache.dtype)
        rows = read_mla_cache_ref(raw.unsqueeze(0), pos, meta.layout, context_dtype(attn.kv_cache))
        idx = None
        if need_index:
            islots = self.hs.idx_table[slot, pos // bs].long() * bs + pos % bs
            idx = read_indexer_cache_ref(attn.indexer_cache, islots, meta.layout)
        return rows, idx

    def decode_attend(self, attn, meta: MLAMetadata, q_abs, tok, topk_pos):
        hs = self.hs
        g = attn.hisparse_group
        key = ("hisparse_slots", g)
        ready = ("hisparse_ready", attn.hisparse_index)
        if attn.has_indexer or key not in meta.extras:
            req_slot = meta.extras["req_slots_t"][meta.token_req[tok]]
            res = dispatch.hisparse_resolve(
                topk_pos,
                req_slot,
                meta.block_table_full,
                hs.host_table,
                hs.hot_slots,
                hs.hot_pos[g],
                hs.hot_lru[g],
                meta.extras["step"],
                hs.trash_slot,
                meta.layout.block_size,
            )
            group = hs.groups[g]
            me = attn.hisparse_index
            # this layer's missing rows now; the shared layers' on the copy stream, so that the
            # PCIe-bound fetch overlaps this layer's attention and MLP (each shared layer waits
            # for its own rows only)
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
                    meta.extras[("hisparse_ready", i)] = ev
            hs.stats += torch.stack([res.hits, res.num_miss * len(group), res.num_resident])
            meta.extras[key] = res.slots
        else:
            ev = meta.extras.pop(ready, None)
            if ev is not None:
                torch.cuda.current_stream(q_abs.device).wait_event(ev)
        out, _ = dispatch.sparse_mla_decode(
            q_abs, attn.kv_cache, meta.extras[key], meta.layout, attn.scale
        )
        return out
