"""Helpers shared by tests of several packages (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import requests

from toppings.server.config import EngineConfig
from toppings.server.engine.engine import Engine
from toppings.server.model.config import ModelConfig
from toppings.server.runtime import build_engine


def wait_healthy(
    url: str,
    proc: subprocess.Popen,
    log: Path | None = None,
    timeout_s: float = 120.0,
    statuses: tuple[int, ...] = (200,),
) -> None:
    """Poll url/health until it answers one of statuses (a scheduler with no server registered
    yet answers 503: pass (200, 503) to wait only until it listens); fail with the log's tail if
    the process exits or time runs out."""

    def tail() -> str:
        return log.read_text()[-3000:] if log is not None and log.exists() else ""

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"{url} exited (code {proc.returncode}):\n{tail()}"
        try:
            if requests.get(url + "/health", timeout=5).status_code in statuses:
                return
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, f"{url} never became healthy:\n{tail()}"
        time.sleep(0.2)


@contextlib.contextmanager
def running_engine(
    model_dir: str | Path, adapters: dict[str, str] | None = None, **config_fields
) -> Iterator[Engine]:
    """A started engine on model_dir with the given adapters (name -> directory), shut down on
    exit. config_fields are EngineConfig fields; dtype is float32 unless they name one, so that
    outputs compare exactly with a float32 reference, and the LoRA mode on-demand (below); on
    cuda the start-up warm-up is off unless they turn it on (each test compiles the kernel
    variants it launches, not all of them)."""
    # on-demand unless they name a mode: the default (`auto`) is cpu-assisted on a CPU, whose
    # host LoRA computes a loading adapter's first steps in another order than the kernels,
    # so runs compared step for step would depend on when a load lands (test_lora_modes.py
    # checks what auto picks; the exactness tests run every mode by name)
    defaults = {"dtype": "float32", "lora_mode": "on-demand"}
    if config_fields.get("device") == "cuda":
        defaults["warmup"] = False
    config = EngineConfig(**{**defaults, **config_fields})
    engine = build_engine(str(model_dir), config, adapters)
    try:
        yield engine
    finally:
        engine.shutdown()


def post_json(http, path: str, body: dict) -> dict:
    """POST `body` to `path` with a Flask test client; the JSON answer, which must be a 200."""
    answer = http.post(path, json=body)
    assert answer.status_code == 200, answer.get_data()[:300]
    return answer.get_json()


def process_alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def tiny_model_config(**changes) -> ModelConfig:
    """The shapes of a small Llama without weights (H 128, 4 heads, 2 kv heads, 3 layers)."""
    fields = dict(
        name="tiny", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=3,
        num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=1e4,
        max_position_embeddings=256, tie_word_embeddings=False, eos_token_ids=(0,),
    )  # fmt: skip
    fields.update(changes)
    return ModelConfig(**fields)


def wait_steps_back(engine, timeout_s: float = 30.0) -> None:
    """Wait until no step is on the device (with async scheduling a request's last output is
    sent while a step computed for it may still run; what it holds comes back after)."""
    deadline = time.monotonic() + timeout_s
    while engine.scheduler.has_steps_on_device:
        assert time.monotonic() < deadline, "a launched step never came back"
        time.sleep(0.01)


def assert_memory_balanced(engine, pinned_adapter_blocks: int = 0) -> None:
    """Nothing is held after the requests ended (and their steps are back): every pool block
    is free or cached (a KV prefix, an idle adapter) and the counts add up to the pool."""
    wait_steps_back(engine)
    mem = engine.stats().to_json()["memory"]
    blocks = mem["blocks"]
    assert blocks["kv_in_use"] == 0, blocks
    assert blocks["adapters_in_use"] == pinned_adapter_blocks, blocks
    assert mem["reserved_blocks"] == 0 and mem["committed_blocks"] == pinned_adapter_blocks, mem
    parts = ("free", "kv_cached", "adapters_cached", "adapters_in_use")
    assert sum(blocks[k] for k in parts) == blocks["total"], blocks
    kv = engine.kv
    assert all(n == 0 for n in kv.lengths) and kv.num_free_rows == len(kv.lengths)
    tree = engine.memory.tree
    if tree is not None:  # every cached block is reachable, so it can be evicted
        reachable = sum(n.on_device for n in tree.nodes())
        assert reachable == tree.num_device == blocks["kv_cached"], (reachable, tree.num_device)


def spy_on_submissions(engine, monkeypatch, on_submit) -> None:
    """Call on_submit(request, handle) for every request the HTTP API submits (it submits the
    requests of one HTTP request together, through `engine.submit_all`)."""
    submit_all = engine.submit_all

    def spied(requests):
        handles = submit_all(requests)
        for req, handle in zip(requests, handles):
            on_submit(req, handle)
        return handles

    monkeypatch.setattr(engine, "submit_all", spied)


_ADAPTER_IDS: dict[str, int] = {}


def adapter_id(name: str) -> int:
    """The id the device-cache tests give their adapter of this name: one registration per
    name, as a server has at a time (far from the ids a server's registrations count up to)."""
    return _ADAPTER_IDS.setdefault(name, 10**9 + len(_ADAPTER_IDS))
