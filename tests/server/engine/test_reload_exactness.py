"""A name unloaded and loaded again with other weights is another adapter all the way down
(issue 66): the host copies, the CPU workers' arena and their lookups key on ids, so layers
computed on the host while the new adapter loads use the new weights, and a name that shares
the old weights keeps computing with them.

The loads are held in flight by the test (each stops after its first layer until the requests
ended), so every other layer of every step runs on the host path: nothing depends on timing.
"""

from __future__ import annotations

import threading

import pytest

from tests.helpers import running_engine
from tests.server.engine.test_exactness import (
    assert_same_greedy,
    reference_greedy,
    submit_greedy,
)
from toppings.gpu_lora.loader import LoadTicket

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def model_and_weights(tmp_path_factory):
    """A 4-layer tiny Llama and two rank-16 adapters of different weights on every projection."""
    from toppings.scripts.make_adapters import make_random_adapter
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    root = tmp_path_factory.mktemp("reload")
    model_dir = make_tiny_llama(root / "model", num_layers=4)
    paths = {
        name: str(make_random_adapter(root / name, model_dir, rank=16, target_modules=ALL,
                                      seed=seed))
        for name, seed in (("old", 11), ("new", 12))
    }  # fmt: skip
    return model_dir, paths


def hold_loads_after_first_layer(monkeypatch) -> threading.Event:
    """Loads stop after their first layer until the returned event is set (the loader thread
    waits in `mark_ready`; the adapters' later loads queue behind it)."""
    gate = threading.Event()
    mark_ready = LoadTicket.mark_ready

    def held(ticket: LoadTicket, layers: int) -> None:
        if layers > 1:
            assert gate.wait(300), "the test never let the loads go on"
        mark_ready(ticket, layers)

    monkeypatch.setattr(LoadTicket, "mark_ready", held)
    return gate


@pytest.mark.parametrize("num_cpu_workers", [1, 0])
def test_a_reload_under_a_name_computes_its_new_weights_on_the_host(
    model_and_weights, monkeypatch, num_cpu_workers
):
    """`x` and `y` load the old weights (one host copy, one arena block, under x's weights
    id); `x` is unloaded and loaded again with the new weights; then `x` and `y` run together
    while both loads are held after layer 0: x gives the new weights' tokens, y the old's."""
    model_dir, paths = model_and_weights
    prompt = [5, 17, 42, 99, 7, 63, 120, 31, 8]
    want_old, margins_old = reference_greedy(model_dir, paths, prompt, "old")
    want_new, margins_new = reference_greedy(model_dir, paths, prompt, "new")
    assert want_old != want_new  # the two adapters are told apart by their tokens
    with running_engine(
        model_dir, {"x": paths["old"], "y": paths["old"]}, lora_mode="cpu-assisted",
        layers_per_group=1, num_cpu_workers=num_cpu_workers, max_total_tokens=4096,
    ) as engine:  # fmt: skip
        old_x, y = engine.resolve_adapter("x"), engine.resolve_adapter("y")
        assert y.weights_id == old_x.id  # one copy of the old weights, under x's id
        engine.remove_adapter("x")
        engine.add_adapter("x", paths["new"])
        new_x = engine.resolve_adapter("x")
        assert new_x.id != old_x.id and new_x.weights_id == new_x.id
        if num_cpu_workers:  # the arena holds both contents, by weights id
            assert sorted(engine.lora.host.repository.ids()) == sorted([old_x.id, new_x.id])
        gate = hold_loads_after_first_layer(monkeypatch)
        try:
            handles = submit_greedy(engine, [(prompt, "x"), (prompt, "y")])
            got_x, got_y = (h.result(timeout_s=300).new_token_ids for h in handles)
            states = engine.lora.cache.entry_states()
            assert not any(s.on_device for s in states.values()), "a load was not held"
            assert engine.lora.host_stats.calls > 0
        finally:
            gate.set()
        workers = engine.stats().to_json()["cpu_workers"]
        assert [w["alive"] for w in workers] == [True] * num_cpu_workers
    assert_same_greedy(got_x, want_new, margins_new, "x reloaded with the new weights")
    assert_same_greedy(got_y, want_old, margins_old, "y, which shares the old weights")
