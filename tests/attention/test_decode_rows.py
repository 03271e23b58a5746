"""Decode-token rows of the attention metadata: without a gather when every row decodes, the
decode slots computed once per top-k tensor."""

from __future__ import annotations

import torch

from vllm.attention.metadata import MLAMetadata, decode_token_rows
from vllm.config.arch import ModelArch
from vllm.kv_cache_interface import KVCacheLayout
from vllm.model_executor.tiny import TINY_CONFIG


def _meta(qsl, prefill):
    arch = ModelArch.from_dict(TINY_CONFIG)
    layout = KVCacheLayout.from_arch(arch, "auto", torch.float32)
    t, b = qsl[-1], len(prefill)
    req = torch.repeat_interleave(torch.arange(b), torch.tensor(qsl).diff())
    return MLAMetadata(
        layout,
        8,
        torch.arange(t) + 5,
        req,
        qsl,
        torch.full((b,), 64),
        [64] * b,
        torch.arange(b * 4, dtype=torch.int32).view(b, 4),
        prefill,
        [False] * b,
        torch.empty(0),
        decode_tokens=decode_token_rows(qsl, prefill, torch.device("cpu")),
    )


def test_all_decode_rows_are_the_tensors_themselves():
    meta = _meta([0, 1, 3, 4], [False, False, False])
    assert meta.decode_is_all
    assert torch.equal(meta.decode_tokens, torch.arange(4))
    x = torch.randn(4, 3)
    assert meta.decode_rows(x) is x


def test_mixed_step_gathers():
    meta = _meta([0, 3, 4, 6], [False, True, False])
    assert not meta.decode_is_all
    x = torch.randn(6, 2)
    assert torch.equal(meta.decode_rows(x), x[[0, 1, 2, 4, 5]])


def test_decode_slots_once_per_topk_tensor():
    meta = _meta([0, 1, 2], [False, False])
    topk = torch.tensor([[0, 3, -1], [7, 1, 2]], dtype=torch.int32)
    s1 = meta.decode_slots(topk)
    assert s1.dtype == torch.int32
    assert torch.equal(s1.long(), meta.slots_for(meta.token_req, topk))
    assert meta.decode_slots(topk) is s1  # a shared layer: the same tensor, the same slots
    other = topk.clone()
    other[0, 0] = 5
    s2 = meta.decode_slots(other)  # a new top-k tensor (the next full layer): computed again
    assert s2 is not s1 and int(s2[0, 0]) == int(meta.slots_for(meta.token_req, other)[0, 0])
