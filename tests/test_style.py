"""The house style (STYLE.md): ``ruff check`` and ``ruff format --check`` over the repository, with
the settings in ``pyproject.toml`` (git-ignored paths such as the virtual environments are not
looked at). ruff comes with the ``test`` extra; the test is skipped only where it is absent."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return [exe]


@pytest.mark.parametrize(
    "args", [["check", "."], ["format", "--check", "."]], ids=["check", "format"]
)
def test_ruff(args):
    r = subprocess.run([*_ruff(), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
