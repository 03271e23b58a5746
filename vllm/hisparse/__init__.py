"""Hybrid HiSparse (SPEC §6): decode keeps the MLA KV in a pinned host pool, the GPU holds the
recent tail of each request plus a per-request hot buffer, and a device-side resolver maps each
top-k position to a resident page, a hot row, or a miss copied from host memory.

  * `manager.py`  — engine-core side: page residency, host/indexer pools, drops under pressure,
                    hot-buffer leases, admission by host capacity;
  * `worker.py`   — worker side: device page tables, the host pool, page backups, the attention
                    data access used by the layers (resolver for decode, host reads for prefill);
  * `resolver.py` — the resolver itself (plain torch, device-side, no host decisions).

Indexer keys always stay on the GPU (their own block pool); only MLA rows are offloaded.
"""
