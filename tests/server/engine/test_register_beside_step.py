"""Registering an adapter in a LoRA mode that loads on demand does not wait for a running step
(it touches the host side only); in cached mode, which puts the adapter on the device, it does.
Nor does a registration wait behind an unload, nor the resolver's retirement of an adapter
for a step (its device rows go before the next one)."""

from __future__ import annotations

import threading

import pytest

from tests.helpers import running_engine
from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.request import GenerationRequest, RequestError, SamplingParams

TWO_TOKENS = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)  # finish: length


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


def test_a_registration_does_not_wait_behind_an_unload_waiting_for_a_step(
    tiny_model_dir, adapter_dir
):
    """An unload waits for the step (it takes the engine's lock); the registration of another
    adapter through the same admin (the resolver's eviction and its next first use) does not
    wait behind it."""
    from toppings.server.api.admin.lifecycle import AdapterAdmin, AdapterPaths

    config = dict(max_total_tokens=1024, lora_mode="on-demand")
    with running_engine(tiny_model_dir, {}, **config) as engine:
        admin = AdapterAdmin(engine, AdapterPaths([]))
        admin.register(engine.open_adapter("old", adapter_dir))
        unloaded: list = []
        with engine._lock:  # a step runs
            unload = threading.Thread(target=lambda: unloaded.append(admin.remove("old")))
            unload.start()
            unload.join(timeout=0.5)
            assert not unloaded  # the unload waits for the step
            new = engine.open_adapter("new", adapter_dir)
            registered: list = []
            register = threading.Thread(target=lambda: registered.append(admin.register(new)))
            register.start()
            register.join(timeout=60)
            assert registered, "the registration waited behind the unload"
            ref = registered[0]
            assert engine.resolve_adapter("new") == ref
        unload.join(timeout=60)
        assert unloaded and unloaded[0].name == "old"
        with pytest.raises(RequestError):
            engine.resolve_adapter("old")
        assert engine.resolve_adapter("new") == ref  # it shared the content: still held


@pytest.mark.parametrize("mode", ["on-demand", "cpu-assisted"])
def test_a_retirement_does_not_wait_for_a_step_and_its_rows_go_before_the_next(
    tiny_model_dir, adapter_dir, mode
):
    """The resolver's eviction (Engine.retire_adapter): the name and host side go at once, beside
    a running step; the device rows before the engine's next plan."""
    with running_engine(tiny_model_dir, {}, max_total_tokens=1024, lora_mode=mode) as engine:
        ref = engine.register_adapter(engine.open_adapter("a", adapter_dir))
        prompt = GenerationRequest([1, 2, 3], TWO_TOKENS, ref)
        assert engine.submit(prompt).result(timeout_s=60).finish_reason == "length"
        assert engine.lora.cache.holds(ref.weights_id)  # its rows are on the device
        with engine._lock:  # a step runs
            retired: list = []
            thread = threading.Thread(target=lambda: retired.append(engine.retire_adapter("a")))
            thread.start()
            thread.join(timeout=60)
            assert retired, "the retirement waited for the step"
            with pytest.raises(RequestError):
                engine.resolve_adapter("a")  # no request can name it from here
            assert engine.lora.cache.holds(ref.weights_id)  # the step's, until it ends
        base = GenerationRequest([1, 2, 3], TWO_TOKENS, None)
        assert engine.submit(base).result(timeout_s=60).finish_reason == "length"
        assert not engine.lora.cache.holds(ref.weights_id)
        assert engine.stats().adapter_host_memory["copies"] == 0


def test_a_cached_retirement_waits_for_the_step(tiny_model_dir, adapter_dir):
    with running_engine(tiny_model_dir, {}, max_total_tokens=1024, lora_mode="cached") as engine:
        engine.register_adapter(engine.open_adapter("a", adapter_dir))
        with engine._lock:
            retired: list = []
            thread = threading.Thread(target=lambda: retired.append(engine.retire_adapter("a")))
            thread.start()
            thread.join(timeout=0.5)
            assert not retired  # the device is the step's while it runs
        thread.join(timeout=60)
        assert retired and not engine.adapters()
