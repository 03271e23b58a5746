"""The HiSparse decode data path — resolver, masked row fetch, sparse MLA decode — captured once in
a CUDA graph and replayed step after step (new top-k positions and step counter written into the
graph's input tensors) gives the same slots, state and attention output as running it eagerly:
no host decision, no sync, fixed shapes."""

from __future__ import annotations

import pytest
import torch

from vllm.config.arch import GLM_5_3, ModelArch
from vllm.hisparse.resolver import apply_copies
from vllm.kernels.hisparse_resolve import hisparse_resolve
from vllm.kernels.sparse_mla import sparse_mla_decode
from vllm.kv_cache_interface import KVCacheLayout

BS, TOPK, B, CTX = 64, 256, 8, 8192


def _state(dev, layout, g):
    pages = CTX // BS
    hot = 2 * TOPK
    row = layout.mla_bytes_per_token
    n_gpu = B * (hot // BS + 1) + 1
    gpu = torch.zeros((n_gpu, BS, row), dtype=torch.uint8, device=dev)
    host = torch.randint(0, 120, (B * pages, BS, row), dtype=torch.uint8, generator=g)
    # tile scales and rope values as the fp8_ds_mla writer stores them: positive scales, bf16
    # rope of a real key's magnitude (random bytes there read as bf16 up to ~1e33, which the
    # CUDA kernel's f16 QK cannot hold)
    flat = host.view(-1, row)
    flat[:, 512:528] = torch.full((4,), 0.01).view(torch.uint8)
    rope = torch.randn(flat.shape[0], 64, generator=g).to(torch.bfloat16)
    flat[:, 528:] = rope.view(torch.uint8)
    host = host.pin_memory()
    from vllm.hisparse.worker import device_view

    page_table = torch.full((B, pages), -1, dtype=torch.int32, device=dev)
    tail = torch.arange(B, device=dev, dtype=torch.int32) * (hot // BS + 1) + hot // BS
    page_table[:, -1] = tail  # the tail page is resident
    gpu.view(-1, BS, row)[tail.long()] = host.view(B, pages, BS, row)[:, -1].to(dev)
    return dict(
        gpu=gpu,
        host=host,
        host_dev=device_view(host, dev),
        page_table=page_table,
        host_table=torch.arange(B * pages, device=dev).view(B, pages),
        hot_slots=(torch.arange(B, device=dev) * (hot // BS + 1)).unsqueeze(1) * BS
        + torch.arange(hot, device=dev),
        hot_pos=torch.full((B, hot + 1), -1, dtype=torch.int64, device=dev),
        hot_lru=torch.zeros((B, hot + 1), dtype=torch.int64, device=dev),
        trash=(n_gpu - 1) * BS,
    )


def _step(st, pos, step, q, layout):
    res = hisparse_resolve(
        pos, torch.arange(B, device=pos.device), st["page_table"], st["host_table"],
        st["hot_slots"], st["hot_pos"], st["hot_lru"], step, st["trash"], BS,
    )  # fmt: skip
    apply_copies(res, [st["gpu"]], [st["host_dev"]])
    out, _ = sparse_mla_decode(q, st["gpu"], res.slots, layout, 0.0625)
    return res.slots, out


@pytest.mark.gpu
def test_hisparse_decode_path_in_cuda_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    layout = KVCacheLayout.from_arch(ModelArch.from_dict(GLM_5_3), "fp8_ds_mla", torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    eager, graphed = _state(dev, layout, g), _state(dev, layout, torch.Generator().manual_seed(0))
    q = (torch.randn(B, 64, 576, generator=g) * 0.05).to(dev, torch.bfloat16)
    # positions per step: keep 3/4 of the previous step's, the rest fresh (some on the tail page)
    steps, pos = [], torch.stack([torch.randperm(CTX, generator=g)[:TOPK] for _ in range(B)])
    for _ in range(8):
        fresh = torch.randint(0, CTX, (B, TOPK // 4), generator=g)
        pos = torch.cat([pos[:, TOPK // 4 :], fresh], 1)
        steps.append(pos)
    steps = [torch.stack([_distinct(r, g) for r in s]).to(dev) for s in steps]

    static_pos = steps[0].clone()
    static_step = torch.ones(1, dtype=torch.int64, device=dev)
    # warm up (compiles kernels) on a side stream, as CUDA graph capture requires
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        scratch = _state(dev, layout, torch.Generator().manual_seed(0))
        _step(scratch, static_pos, static_step, q, layout)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_slots, g_out = _step(graphed, static_pos, static_step, q, layout)
    for i, p in enumerate(steps, start=1):
        e_slots, e_out = _step(eager, p, i, q, layout)
        static_pos.copy_(p)
        static_step.fill_(i)
        graph.replay()
        torch.testing.assert_close(g_slots, e_slots, rtol=0, atol=0)
        torch.testing.assert_close(g_out, e_out, rtol=0, atol=0)
        for key in ("hot_pos", "hot_lru"):
            assert torch.equal(graphed[key][:, :-1], eager[key][:, :-1])
    assert int((eager["hot_pos"][:, :-1] >= 0).sum()) > 0  # rows were fetched and kept


def _distinct(row, g):
    """Distinct positions (a top-k list never repeats one), topped up at random."""
    u = torch.unique(row)
    while u.numel() < TOPK:
        u = torch.unique(torch.cat([u, torch.randint(0, CTX, (TOPK,), generator=g)]))
    return u[torch.randperm(u.numel(), generator=g)][:TOPK]
