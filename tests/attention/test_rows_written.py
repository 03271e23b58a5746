"""The attention output is not zero-filled: every request's rows are written (a prefill request's by
the prefill paths, the others' by the decode path). Checked on mixed steps (decode rows beside
dense and sparse prompt chunks, a shared layer's reused top-k) by handing every layer an output
buffer full of NaN: every row comes back finite, and the logits equal those of zero-filled
buffers."""

from __future__ import annotations

import pytest
import torch

from vllm.attention.layer import SparseMLAAttention
from vllm.model_executor.model_loader import build_model
from vllm.model_executor.simple_forward import SimpleKV


def _steps(model, monkeypatch, fill: float) -> list[torch.Tensor]:
    real = SparseMLAAttention.forward
    seen = []

    def forward(self, q_nope, q_pe, kv_c, k_pe, idx, prev_topk, meta, out=None):
        assert out is None
        out = torch.full((q_nope.shape[0], self.num_heads, self.v_dim), fill, dtype=q_nope.dtype)
        got, topk = real(self, q_nope, q_pe, kv_c, k_pe, idx, prev_topk, meta, out=out)
        seen.append(bool(got.isfinite().all()))
        return got, topk

    monkeypatch.setattr(SparseMLAAttention, "forward", forward)
    kv = SimpleKV(model, "auto", 96, 3)
    ids = torch.arange(3, 3 + 96).remainder(model.arch.vocab_size)
    logits = []
    # (request row, start, new tokens), decode flags, sparse prefill forced
    steps = [
        ([(0, 0, 20), (1, 0, 7)], [False, False], False),
        ([(0, 20, 1), (1, 7, 30), (2, 0, 5)], [True, False, False], False),
        ([(0, 21, 1), (1, 37, 12), (2, 5, 1)], [True, False, True], True),
    ]
    with torch.no_grad():
        for reqs, flags, sparse in steps:
            meta, pos = kv.metadata(reqs, flags, force_dense_off=sparse)
            tok = torch.cat([ids[s : s + n] for _, s, n in reqs])
            logits.append(model.compute_logits(model(tok, pos, meta)))
    monkeypatch.setattr(SparseMLAAttention, "forward", real)
    assert seen and all(seen)
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_written_on_mixed_steps(tiny_ckpt, monkeypatch, dtype):
    model = build_model(tiny_ckpt, dtype=dtype)
    nan = _steps(model, monkeypatch, float("nan"))
    zero = _steps(model, monkeypatch, 0.0)
    for a, b in zip(nan, zero, strict=True):
        assert torch.equal(a, b)
