"""The KV cache budget of one engine process on a GPU (`kv_budget_bytes`): its fraction of the
GPU (--gpu-memory-utilization, as upstream), less what it holds and the activation reserve, never
more than is free; another engine sharing the GPU counts only through what it leaves free."""

from __future__ import annotations

from vllm.worker.worker import kv_budget_bytes

GiB = 1 << 30


def test_alone_on_the_gpu():
    # 140 GiB, 1 GiB of weights held, 5 GiB kept aside: 0.9 · 140 − 1 − 5
    assert kv_budget_bytes(140 * GiB, 138 * GiB, 1 * GiB, 0.9, 5 * GiB) == 120 * GiB


def test_two_engines_sharing_one_gpu():
    # the first engine took 0.4 of the GPU (56 GiB); the second, at 0.4 too, still gets its own
    # share (a budget counting the first's memory against it was negative: no KV at all)
    first = kv_budget_bytes(140 * GiB, 139 * GiB, 1 * GiB, 0.4, 5 * GiB)
    assert first == 50 * GiB
    second = kv_budget_bytes(140 * GiB, 83 * GiB, 1 * GiB, 0.4, 5 * GiB)
    assert second == 50 * GiB


def test_never_more_than_free():
    # another process holds 100 GiB: a 0.9 share would ask for 125 GiB, 39 are free
    assert kv_budget_bytes(140 * GiB, 39 * GiB, 1 * GiB, 0.9, 5 * GiB) == 34 * GiB
