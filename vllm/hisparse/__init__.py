"""Hybrid HiSparse (SPEC §6): decode keeps the MLA KV in a pinned host pool, the GPU holds the
recent tail of each request plus a per-request hot buffer, and a device-side resolver maps each
top-k position to a resident page, a hot row, or a miss copied from host memory.

  * `manager.py`  — engine-core side (a ``KVCacheManager``): page residency, host/indexer pools,
                    drops under pressure, hot-buffer leases, admission by host capacity;
  * `worker.py`   — worker side: ``HiSparseWorker`` (the runner's ``WorkerKVCache`` and
                    ``StepHooks``: device page tables, the host pool, page backups) and
                    ``HiSparseKVAccess`` (how the layers reach rows: the resolver for decode,
                    host reads for prefill);
  * `resolver.py` — the row fetches of the resolver's misses (now, or ahead on a copy stream).
The resolver itself is an op: ``vllm/kernels/hisparse_resolve.py``.

Indexer keys always stay on the GPU (their own block pool); only MLA rows are offloaded.
"""
