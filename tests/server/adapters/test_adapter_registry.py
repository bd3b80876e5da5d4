"""The adapter registry: names resolve to references, in-flight counts per id, refused unloads."""

from __future__ import annotations

import pytest

from toppings.server.adapters.registry import AdapterRegistry
from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.request import GenerationRequest, RequestError, SamplingParams


def registered(*names: str) -> tuple[AdapterRegistry, list[AdapterRef]]:
    registry = AdapterRegistry()
    refs = [AdapterRef.new(n, 8, 1000) for n in names]
    for ref in refs:
        registry.add(ref)
    return registry, refs


def test_a_name_resolves_to_its_reference_and_an_unknown_one_is_a_404():
    registry, (a, b) = registered("a", "b")
    assert registry.resolve("a") is a and registry.resolve("b") is b
    assert registry.resolve(None) is None  # the base model
    with pytest.raises(RequestError) as err:
        registry.resolve("c")
    assert err.value.code == 404
    with pytest.raises(RequestError) as err:
        registry.add(AdapterRef.new("a", 4, 10))
    assert err.value.code == 409
    assert registry.refs() == [a, b]


def test_an_unload_is_refused_while_a_request_is_in_flight():
    registry, (a, b) = registered("a", "b")
    registry.acquire([a, None, a, b])
    assert registry.in_flight(a) == 2 and registry.in_flight(b) == 1
    registry.release(a)
    with pytest.raises(RequestError) as err:
        registry.retire("a")
    assert err.value.code == 409 and registry.resolve("a") is a
    registry.release(a)
    assert registry.retire("a") is a
    with pytest.raises(RequestError) as err:
        registry.retire("a")
    assert err.value.code == 404
    assert registry.in_flight(b) == 1  # the other adapter's count is its own


def test_a_reference_unloaded_since_it_was_resolved_is_refused_all_or_none():
    registry, (a, b) = registered("a", "b")
    registry.retire("a")
    with pytest.raises(RequestError) as err:
        registry.acquire([b, a])
    assert err.value.code == 404
    assert registry.in_flight(b) == 0  # nothing counted for a refused batch
    again = AdapterRef.new("a", 8, 1000)
    registry.add(again)
    assert again.id != a.id and again != a and registry.resolve("a") is again
    with pytest.raises(RequestError):
        registry.acquire([a])  # the old registration stays gone under the reused name
    registry.acquire([again])
    assert registry.in_flight(again) == 1 and registry.in_flight(a) == 0
    with pytest.raises(TypeError):
        registry.acquire(["a"])  # a name where a reference belongs


def test_a_release_without_an_acquire_raises():
    registry, (a,) = registered("a")
    registry.acquire([a])
    registry.release(a)
    with pytest.raises(RuntimeError):
        registry.release(a)


def test_references_are_keyed_and_ordered_by_id_alone():
    a = AdapterRef.new("x", 8, 100)
    b = AdapterRef.new("x", 8, 100)  # the same name and sizes: another registration
    assert a != b and len({a, b}) == 2 and a < b
    assert a == AdapterRef(a.id, "other", 1, 1) and hash(a) == hash(AdapterRef(a.id, "", 0, 0))


def test_the_engine_refuses_a_request_for_an_adapter_unloaded_since_it_was_resolved(
    tiny_engine, tiny_model_dir, tmp_path
):
    from toppings.scripts.make_adapters import make_random_adapter

    path = make_random_adapter(tmp_path / "x", tiny_model_dir, rank=8, target_modules=("q_proj",))
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    with tiny_engine(max_total_tokens=1024) as engine:
        engine.add_adapter("x", str(path))
        old = engine.resolve_adapter("x")
        engine.remove_adapter("x")
        engine.add_adapter("x", str(path))
        with pytest.raises(RequestError) as err:
            engine.submit(GenerationRequest([5, 6, 7], params, old))
        assert err.value.code == 404
        new = engine.resolve_adapter("x")
        assert new.id != old.id and new.name == "x" and new.rank == 8
        assert new.nbytes == engine.lora.cache.charge(engine.lora.host.lookup(new))
        out = engine.submit(GenerationRequest([5, 6, 7], params, new)).result(timeout_s=60)
        assert out.finish_reason == "length"
        assert engine.adapter_refs.in_flight(new) == 0  # the ended request let go
        with pytest.raises(RequestError) as err:  # counted, then refused: the count goes back
            engine.submit(GenerationRequest([5, 10**9], params, new))
        assert err.value.code == 400 and engine.adapter_refs.in_flight(new) == 0
        engine.remove_adapter("x")
