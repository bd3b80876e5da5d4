"""Registering an adapter in a LoRA mode that loads on demand does not wait for a running step
(it touches the host side only); in cached mode, which puts the adapter on the device, it does."""

from __future__ import annotations

import threading

import pytest

from tests.helpers import running_engine
from toppings.server.requests.adapter_ref import AdapterRef


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    from toppings.scripts.make_adapters import make_random_adapter

    path = tmp_path_factory.mktemp("register") / "a"
    make_random_adapter(path, tiny_model_dir, rank=8, seed=3)
    return str(path)


def register_in_thread(engine, adapter) -> tuple[threading.Thread, list]:
    got: list = []
    thread = threading.Thread(target=lambda: got.append(engine.register_adapter(adapter)))
    thread.start()
    return thread, got


@pytest.mark.parametrize("mode", ["on-demand", "cpu-assisted"])
def test_a_registration_does_not_wait_for_a_step(tiny_model_dir, adapter_dir, mode):
    with running_engine(tiny_model_dir, {}, max_total_tokens=1024, lora_mode=mode) as engine:
        adapter = engine.open_adapter("a", adapter_dir)
        with engine._lock:  # what a step holds from its plan to its outputs
            thread, got = register_in_thread(engine, adapter)
            thread.join(timeout=60)
            assert got and isinstance(got[0], AdapterRef), "the registration waited"
        assert engine.resolve_adapter("a") == got[0]


def test_a_cached_registration_waits_for_the_step(tiny_model_dir, adapter_dir):
    with running_engine(tiny_model_dir, {}, max_total_tokens=1024, lora_mode="cached") as engine:
        adapter = engine.open_adapter("a", adapter_dir)
        with engine._lock:
            thread, got = register_in_thread(engine, adapter)
            thread.join(timeout=0.5)
            assert not got  # the device is the step's while it runs
        thread.join(timeout=60)
        assert got and engine.resolve_adapter("a") == got[0]
