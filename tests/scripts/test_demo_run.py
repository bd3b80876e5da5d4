"""`toppings-demo` on a fresh HOME serves the shipped adapters and answers (no training)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from toppings.scripts.demo import SHIPPED, STYLES
from toppings.scripts.train_demo_adapters import is_trained


@pytest.mark.slow
def test_demo_answers_on_a_fresh_home(tmp_path, free_port, smollm2_dir):
    assert all(is_trained(SHIPPED / s) for s in STYLES), "the demo adapters are not shipped"
    # A fresh HOME; the model cache is shared with the other SmolLM2 tests (converted once).
    cache = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    env = dict(os.environ, HOME=str(tmp_path), XDG_CACHE_HOME=cache)
    exe = os.path.join(os.path.dirname(sys.executable), "toppings-demo")
    cmd = [exe, "--port", str(free_port()), "--server-port", str(free_port())]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        answers = [ln for ln in lines if any(ln.strip().startswith(f"{m}:") for m in STYLES)]
        assert len(answers) == 3, "".join(lines)
        assert all(len(a.split(":", 1)[1].strip()) > 2 for a in answers), "".join(lines)
        assert not any("Training the demo adapters" in ln for ln in lines)
    finally:
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, "".join(lines) + rest
