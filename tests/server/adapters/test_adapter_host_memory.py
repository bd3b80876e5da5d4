"""Host memory of adapters, charged and bounded (issue 48): the same files under many names are
one copy (one set of tensors, one block of the CPU workers' arena), charged once; distinct
contents add up to the budget, past which a load is a 507 and the server keeps serving."""

from __future__ import annotations

import os

import pytest
import torch

from toppings.gpu_lora.host_memory import (
    DEFAULT_BUDGET_FRACTION,
    MIN_NAMES,
    NAME_BYTES,
    HostAdapterMemory,
    HostMemoryFull,
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
        registry = {a.name: a for a in engine.lora.host.registered()}
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


def test_a_bfloat16_engine_holds_and_charges_its_adapters_at_bfloat16(tiny_engine, adapter_dirs):
    """Every copy a bfloat16 engine makes of an adapter is bfloat16, so its host copy is too:
    half the float32 engine's charge for the same files."""
    _, dirs = adapter_dirs
    charged = {}
    for dtype in (torch.float32, torch.bfloat16):
        config = dict(max_total_tokens=1024, lora_mode="on-demand", dtype=str(dtype)[6:])
        with tiny_engine({}, **config) as engine:
            engine.add_adapter("a", str(dirs[0]))
            (held,) = engine.lora.host.registered()
            assert {t.dtype for pair in held.weights.values() for t in pair} == {dtype}
            charged[dtype] = engine.stats().adapter_host_memory["charged_bytes"]
    assert charged[torch.bfloat16] * 2 == charged[torch.float32] > 0


def test_the_sum_stops_at_the_budget_with_a_507(tiny_engine, tiny_model_dir, adapter_dirs):
    from toppings.gpu_lora.peft.adapter import load_peft_adapter
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
                         "names": 22, "max_names": MIN_NAMES}  # fmt: skip
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


def _resident_bytes() -> int:
    """This process's RSS once glibc has handed its free heap pages back."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("lora_mode", ["cached", "cpu-assisted"])
def test_one_device_copy_for_the_same_files_under_12_names(tiny_engine, adapter_dirs, lora_mode):
    _, dirs = adapter_dirs
    with tiny_engine({}, max_total_tokens=1024, lora_mode=lora_mode) as engine:
        cache = engine.lora.cache
        engine.add_adapter("n0", str(dirs[0]))
        want = _generate(engine, "n0")
        one_copy = cache.used_bytes
        for i in range(1, 12):
            engine.add_adapter(f"n{i}", str(dirs[0]))
            assert _generate(engine, f"n{i}") == want
        assert (len(cache.entries), cache.used_bytes) == (1, one_copy) and one_copy > 0
        names = {f"n{i}" for i in range(12)}
        assert set(engine.stats().to_json()["resident_adapters"]) >= names
        # The first name goes; its rows stay for the others, which compute what it did.
        engine.remove_adapter("n0")
        assert (len(cache.entries), cache.used_bytes) == (1, one_copy)
        assert next(iter(cache.entries.values())).resident.name != "n0"
        assert _generate(engine, "n5") == want
        engine.add_adapter("other", str(dirs[1]))  # other weights: their own rows
        assert _generate(engine, "other") != want and len(cache.entries) == 2
        for i in range(1, 12):
            engine.remove_adapter(f"n{i}")
        assert list(e.resident.name for e in cache.entries.values()) == ["other"]


def test_rss_of_12_names_of_one_directory_is_one_copy(tiny_engine, tmp_path):
    from toppings.scripts.make_adapters import make_random_adapter
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    model = make_tiny_llama(tmp_path / "wide", hidden_size=512, intermediate_size=512,
                            num_heads=8, num_kv_heads=8)  # fmt: skip
    adapter = make_random_adapter(tmp_path / "r256", model, rank=256, seed=0)
    from tests.helpers import running_engine

    with running_engine(model, {}, max_total_tokens=1024, lora_mode="cached") as engine:
        engine.add_adapter("n0", str(adapter))
        one_copy = engine.lora.cache.used_bytes
        after_one = _resident_bytes()
        for i in range(1, 12):
            engine.add_adapter(f"n{i}", str(adapter))
        grown = _resident_bytes() - after_one
        assert grown < one_copy, (grown, one_copy)


def test_names_are_bounded_by_the_budget():
    from types import SimpleNamespace

    memory = HostAdapterMemory((MIN_NAMES + 44) * NAME_BYTES)
    assert memory.max_names == MIN_NAMES + 44
    for i in range(memory.max_names):  # registrations 0.. of the same content
        memory.charge(i, SimpleNamespace(name=f"n{i}", id=1), "digest", 1000)
    more = memory.max_names
    with pytest.raises(HostMemoryFull, match=f"take {memory.max_names} names"):
        memory.charge(more, SimpleNamespace(name="one-more", id=1), "digest", 1000)
    memory.release(3)
    memory.charge(more, SimpleNamespace(name="one-more", id=1), "digest", 1000)
    assert memory.view()["charged_bytes"] == 1000
    assert HostAdapterMemory(NAME_BYTES).max_names == MIN_NAMES
