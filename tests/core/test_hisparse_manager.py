"""HiSparse's page bookkeeping (``vllm/hisparse/manager.py``) without workers: a page counts as
backed up (droppable from the GPU) only once it is complete."""

from __future__ import annotations

from vllm.core.messages import EngineCoreRequest, SamplingOptions
from vllm.core.request import Request
from vllm.hisparse.manager import HiSparseKVManager


def _req(rid: str, n: int) -> Request:
    return Request(
        EngineCoreRequest(rid, list(range(10, 10 + n)), SamplingOptions(max_tokens=4), [0])
    )


def test_a_partial_page_is_never_dropped_between_prefill_chunks():
    """Chunks that end inside a page (the newcomers' reserve makes them) leave that page on the
    GPU: it has no host copy until a later chunk completes it."""
    kv = HiSparseKVManager(num_gpu_blocks=8, num_host_blocks=32, num_idx_blocks=32,
                           block_size=64, hot_rows=64)  # fmt: skip
    a = _req("a", 400)
    assert kv.allocate_slots(a, 100) is not None  # pages 0 (complete) and 1 (rows 64..99)
    a.num_computed_tokens = 100
    kv.cache_full_blocks(a, 100)
    assert kv.pages["a"].backed == 1
    assert kv.allocate_slots(a, 150) is not None  # chunk 2: rows 100..249, pages 1..3
    assert kv.pages["a"].backed == 1  # page 1 is still partial on the host
    # b is one GPU block short; a's only backed-up page would just pay for its hot-buffer lease,
    # so nothing can be dropped and b waits (before, page 1 counted as backed and was dropped)
    assert kv.allocate_slots(_req("b", 300), 300) is None
    assert all(b >= 0 for b in kv.pages["a"].gpu)
