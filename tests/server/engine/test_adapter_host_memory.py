"""Host memory of adapters, charged and bounded (issue 48): the same files under many names are
one copy (one set of tensors, one block of the CPU workers' arena), charged once; distinct
contents add up to the budget, past which a load is a 507 and the server keeps serving."""

from __future__ import annotations

import os

import pytest

from toppings.gpu_lora.host_memory import (
    DEFAULT_BUDGET_FRACTION,
    content_digest,
    default_budget_bytes,
)
from toppings.server.api.app import ApiOptions, create_app

NUM_NAMES = 50


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, tiny_model_dir):
    from toppings.scripts.make_adapters import make_random_adapter

    root = tmp_path_factory.mktemp("host_memory")
    return root, [make_random_adapter(root / f"d{i}", tiny_model_dir, rank=8, seed=i)
                  for i in range(3)]  # fmt: skip


def _generate(engine, name: str) -> list[int]:
    from toppings.server.requests.request import GenerationRequest, SamplingParams

    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    handle = engine.submit(GenerationRequest([1, 2, 3, 4], params, engine.resolve_adapter(name)))
    return handle.result(60).new_token_ids


def test_one_copy_for_the_same_files_under_50_names(tiny_engine, adapter_dirs):
    _, dirs = adapter_dirs
    config = dict(max_total_tokens=1024, lora_mode="cpu-assisted", num_cpu_workers=1)
    with tiny_engine({}, **config) as engine:
        repository = engine.lora.host.repository
        empty = repository.free_bytes
        first = engine.add_adapter("n0", str(dirs[0]))
        one_copy = engine.stats().adapter_host_memory["charged_bytes"]
        block = empty - repository.free_bytes
        assert one_copy == first.num_bytes + block > 0
        for i in range(1, NUM_NAMES):
            engine.add_adapter(f"n{i}", str(dirs[0]))
        held = engine.stats().adapter_host_memory
        assert (held["copies"], held["names"], held["charged_bytes"]) == (1, NUM_NAMES, one_copy)
        assert repository.free_bytes == empty - block  # one arena block for all 50
        registry = engine.lora.host.registry
        assert all(registry[f"n{i}"].weights is registry["n0"].weights for i in range(NUM_NAMES))
        assert content_digest(registry["n7"]) == content_digest(first)
        # A name that shares computes what the first does; it outlives the first's unload.
        want = _generate(engine, "n0")
        engine.remove_adapter("n0")
        assert _generate(engine, "n7") == want
        for i in range(1, NUM_NAMES):
            engine.remove_adapter(f"n{i}")
        held = engine.stats().adapter_host_memory
        assert (held["copies"], held["names"], held["charged_bytes"]) == (0, 0, 0)
        assert repository.free_bytes == empty


def test_the_sum_stops_at_the_budget_with_a_507(tiny_engine, tiny_model_dir, adapter_dirs):
    from toppings.gpu_lora.peft_format import load_peft_adapter
    from toppings.server.model.loader import load_checkpoint

    root, dirs = adapter_dirs
    shapes = load_checkpoint(str(tiny_model_dir), "auto").config
    one_copy = load_peft_adapter(dirs[0], shapes).num_bytes
    budget = 2 * one_copy + one_copy // 2  # room for two copies, not three
    with tiny_engine({}, max_total_tokens=1024, adapter_host_bytes=budget) as engine:
        client = create_app(engine, ApiOptions(lora_roots=(str(root),))).test_client()

        def load(name: str, path) -> object:
            body = {"lora_name": name, "lora_path": str(path)}
            return client.post("/v1/load_lora_adapter", json=body)

        assert load("a", dirs[0]).status_code == 200
        assert load("b", dirs[1]).status_code == 200
        refused = load("c", dirs[2])
        assert refused.status_code == 507
        error = refused.get_json()["error"]
        assert (
            error["type"] == "insufficient_storage" and "--adapter-host-bytes" in error["message"]
        )
        for i in range(20):  # more names of held contents cost nothing
            assert load(f"a{i}", dirs[i % 2]).status_code == 200
        stats = client.get("/stats").get_json()["adapter_host_memory"]
        assert stats == {"budget_bytes": budget, "charged_bytes": 2 * one_copy, "copies": 2,
                         "names": 22}  # fmt: skip
        assert "c" not in {m["id"] for m in client.get("/v1/models").get_json()["data"]}
        # freeing one content makes room for another
        for name in ["b"] + [f"a{i}" for i in range(1, 20, 2)]:
            assert (
                client.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200
            )
        assert load("c", dirs[2]).status_code == 200
        body = {"model": "c", "prompt": "hi", "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 200


def test_the_default_budget_is_a_share_of_the_machine(tiny_engine):
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default_budget_bytes() == int(physical * DEFAULT_BUDGET_FRACTION) > 0
    with tiny_engine({}, max_total_tokens=1024) as engine:
        held = engine.stats().to_json()["adapter_host_memory"]
        assert held["budget_bytes"] == default_budget_bytes() and held["charged_bytes"] == 0
