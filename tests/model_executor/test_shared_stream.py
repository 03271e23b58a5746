"""The shared expert on a side stream (``shared_experts_stream``): the MoE layer's output is the
in-line one bit for bit (no kernel changes, only where it is queued), eagerly and replayed from
a CUDA graph captured with the fork and join inside, and the side stream is taken exactly where
the token threshold and the switch say."""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers import moe as moe_layer
from vllm.model_executor.model_loader import build_model


def test_no_side_stream_off_cuda(monkeypatch):
    monkeypatch.delenv("VLLM_DISABLE_SHARED_EXPERTS_STREAM", raising=False)
    assert moe_layer.shared_experts_stream(torch.zeros(4, 8)) is None


@pytest.fixture(scope="module", params=[False, True], ids=["bf16", "fp8"])
def moe_block(request, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from vllm.model_executor.tiny import write_slice_checkpoint

    path = write_slice_checkpoint(
        str(tmp_path_factory.mktemp(f"slice-{request.param}")), fp8=request.param, seed=4
    )
    model = build_model(path, dtype=torch.bfloat16, device="cuda")
    layer = model.model.layers[-1]
    assert layer.is_moe and layer.mlp.shared_experts is not None
    return layer.mlp


def _streams_seen(moe, monkeypatch) -> list:
    """Record the stream current while the shared expert's forward is queued."""
    seen = []
    real = type(moe.shared_experts).forward

    def spy(self, *a, **k):
        seen.append(torch.cuda.current_stream())
        return real(self, *a, **k)

    monkeypatch.setattr(type(moe.shared_experts), "forward", spy)
    return seen


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("m", [1, 64, 256, 300])
def test_side_stream_same_bits(moe_block, m, monkeypatch):
    moe = moe_block
    h = moe.gate.weight.shape[1]
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv("VLLM_DISABLE_SHARED_EXPERTS_STREAM", "1")
    seen = _streams_seen(moe, monkeypatch)
    want = moe(x)
    assert seen == [torch.cuda.current_stream()]
    monkeypatch.delenv("VLLM_DISABLE_SHARED_EXPERTS_STREAM")
    side = moe_layer.shared_experts_stream(x)
    assert (side is None) == (m > 256)
    seen.clear()
    got = moe(x)
    assert seen == [side or torch.cuda.current_stream()]
    torch.cuda.synchronize()
    assert torch.equal(got, want), m
    # the threshold is read at each call
    monkeypatch.setenv("VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD", str(m - 1))
    assert moe_layer.shared_experts_stream(x) is None


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("cold", [False, True], ids=["warm", "stream-made-in-capture"])
def test_side_stream_in_cuda_graph(moe_block, monkeypatch, cold):
    moe = moe_block
    h = moe.gate.weight.shape[1]
    monkeypatch.delenv("VLLM_DISABLE_SHARED_EXPERTS_STREAM", raising=False)
    x = torch.randn(32, h, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up off the default stream, as capture requires
        moe(x)
    torch.cuda.current_stream().wait_stream(s)
    if cold:  # the side stream's first use inside the capture
        monkeypatch.setattr(moe_layer, "_side_streams", {})
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = moe(x)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)))
        g.replay()
        monkeypatch.setenv("VLLM_DISABLE_SHARED_EXPERTS_STREAM", "1")
        want = moe(x)
        monkeypatch.delenv("VLLM_DISABLE_SHARED_EXPERTS_STREAM")
        torch.cuda.synchronize()
        assert torch.equal(out, want), seed
