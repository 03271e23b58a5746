from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> str:
    """The built-in tiny checkpoint, written once per session."""
    from vllm.model_executor.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "tiny-glm"))


@pytest.fixture(scope="session")
def tiny_ckpt_fp8(tmp_path_factory) -> str:
    from vllm.model_executor.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny8") / "tiny-glm-fp8"), fp8=True)


@pytest.fixture(autouse=True)
def _cache_root(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.getbasetemp() / "vllm-cache"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(root))
    os.makedirs(root, exist_ok=True)
