"""The house style's tooling (STYLE.md): `ruff check` and `ruff format --check` pass on the whole
repository, with pyproject.toml's settings, so the test command CI runs also holds the lint."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff")
    cmd = [exe] if exe else [sys.executable, "-m", "ruff"]
    return subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args", [("check", "."), ("format", "--check", ".")])
def test_ruff_passes(args):
    done = ruff(*args)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
