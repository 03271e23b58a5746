"""What the KV-transfer tests need beyond the engine: ``nixl`` (and ``vllm-router`` for the P/D
serving tests). Locally a missing one skips; in CI (``CI=1``, set by ``.ci/run``) it fails, so
the tests can never be skipped silently there."""

from __future__ import annotations

import os
import shutil

import pytest


def _missing(what: str, how: str) -> None:
    msg = f"{what} is not installed ({how})"
    if os.environ.get("CI") == "1":
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg, allow_module_level=True)


def require_nixl() -> None:
    try:
        import nixl  # noqa: F401
    except ImportError:
        _missing("nixl", "pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1")


def require_router() -> str:
    """The vllm-router executable."""
    path = shutil.which("vllm-router")
    if path is None:
        _missing("vllm-router", "pip install vllm-router")
    return path
