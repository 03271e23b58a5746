"""Run whole prompts through the model without the engine: one request or a few, fresh caches,
optionally in chunks (chunked prefill) or token by token (decode). Used by model-level tests
(parity with transformers, FP8 checks) and kernel end-to-end checks."""

from __future__ import annotations

import torch

from vllm.attention.kv_access import LocalKVAccess
from vllm.attention.metadata import MLAMetadata, decode_token_rows
from vllm.kv_cache_interface import KVCacheLayout, cdiv


class SimpleKV:
    """Caches for a handful of requests, each with its own contiguous run of blocks."""

    def __init__(self, model, cache_dtype: str, max_len: int, num_reqs: int = 1, device="cpu"):
        arch = model.arch
        self.layout = KVCacheLayout.from_arch(arch, cache_dtype, model.dtype)
        self.blocks_per_req = cdiv(max_len, self.layout.block_size)
        n = self.blocks_per_req * num_reqs
        self.block_table = torch.arange(n, dtype=torch.int32, device=device).view(num_reqs, -1)
        for attn in model.attention_layers():
            idx = self.layout.allocate_indexer(n, device) if attn.has_indexer else None
            attn.bind_kv(self.layout.allocate_mla(n, device), idx, LocalKVAccess())
        self.index_topk = arch.index_topk

    def metadata(
        self,
        reqs: list[tuple[int, int, int]],
        decode_flags: list[bool] | None = None,
        force_dense_off: bool = False,
    ) -> tuple[MLAMetadata, torch.Tensor]:
        """reqs: (request row, start position, num new tokens). Returns metadata and positions."""
        dev = self.block_table.device
        positions, token_req, qsl, seq_lens, prefill, dense = [], [], [0], [], [], []
        for i, (_row, start, n) in enumerate(reqs):
            positions.append(torch.arange(start, start + n))
            token_req.append(torch.full((n,), i))
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            is_dec = decode_flags[i] if decode_flags else False
            prefill.append(not is_dec)
            dense.append(not is_dec and start + n <= self.index_topk and not force_dense_off)
        pos = torch.cat(positions).to(dev)
        tr = torch.cat(token_req).to(dev)
        bt = self.block_table[[r for r, _, _ in reqs]]
        meta = MLAMetadata(
            layout=self.layout,
            index_topk=self.index_topk,
            positions=pos,
            token_req=tr,
            query_start_loc_cpu=qsl,
            seq_lens=torch.tensor(seq_lens, device=dev),
            seq_lens_cpu=seq_lens,
            block_table=bt,
            is_prefill_cpu=prefill,
            use_dense_cpu=dense,
            slot_mapping=torch.zeros(0, dtype=torch.long, device=dev),
            positions_cpu=torch.cat(positions).numpy(),  # as the runner passes it
            decode_tokens=decode_token_rows(qsl, prefill, dev),
        )
        meta.slot_mapping = meta.slots_for(tr, pos)
        return meta, pos


@torch.no_grad()
def prompt_logits(
    model,
    token_ids: list[int],
    cache_dtype: str = "auto",
    chunk: int | None = None,
    decode_from: int | None = None,
    device="cpu",
) -> torch.Tensor:
    """Logits [L, vocab] fp32 for every prompt position.

    chunk: prefill in pieces of this many tokens; decode_from: positions >= this run one token per
    step through the decode path.
    """
    n = len(token_ids)
    kv = SimpleKV(model, cache_dtype, n, 1, device)
    ids = torch.tensor(token_ids, device=device)
    stop = n if decode_from is None else decode_from
    step = chunk or max(stop, 1)
    out = []
    start = 0
    while start < n:
        is_dec = start >= stop
        cnt = 1 if is_dec else min(step, stop - start)
        meta, pos = kv.metadata([(0, start, cnt)], [is_dec])
        h = model(ids[start : start + cnt], pos, meta)
        out.append(model.compute_logits(h))
        start += cnt
    return torch.cat(out)
