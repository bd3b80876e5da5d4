"""The load-on-miss table alone, with an in-memory name table and a registrar whose loads wait
on a gate: one load per name however many requests wait for it, a failure shared by all of them
and retried by the next, the bound on resolutions in flight, and eviction that spares leased
adapters and adapters in use."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.errors import NOT_FOUND, UNAVAILABLE, unknown_adapter
from toppings.server.requests.request import RequestError
from toppings.server.resolver.metrics import ResolverMetrics
from toppings.server.resolver.resolved import ResolvedAdapters
from toppings.server.resolver.sources import DirSource


class FakeEngine:
    """A name table and a registrar in one: loads wait on `gate`, and `fail` makes them fail."""

    def __init__(self, operator_names=()):
        self.refs = {n: AdapterRef.new(n, 8, 1) for n in operator_names}
        self.gate = threading.Event()
        self.gate.set()
        self.loads: list[str] = []
        self.unloads: list[str] = []
        self.in_use: set[str] = set()  # names with a request in flight in the "engine"
        self.fail: RequestError | None = None
        self._lock = threading.Lock()

    def resolve_adapter(self, name):
        if name is None:
            return None
        with self._lock:
            ref = self.refs.get(name)
        if ref is None:
            raise RequestError(unknown_adapter(name), 404, NOT_FOUND)
        return ref

    def load(self, body: dict) -> dict:
        with self._lock:
            self.loads.append(body["lora_name"])
        assert self.gate.wait(30)
        if self.fail is not None:
            raise self.fail
        with self._lock:
            self.refs[body["lora_name"]] = AdapterRef.new(body["lora_name"], 8, 1)
        return {}

    def unload(self, body: dict) -> dict:
        name = body["lora_name"]
        if name in self.in_use:
            raise RequestError(f"adapter {name!r} is in use", 409, "conflict")
        with self._lock:
            self.unloads.append(name)
            del self.refs[name]
        return {}


def make(tmp_path, fake, max_adapters=64, max_loading=4, max_wait_s=0.0) -> ResolvedAdapters:
    for name in ("a", "b", "c", "d"):  # the source finds these (the fake loads no files)
        (tmp_path / name).mkdir()
    metrics = ResolverMetrics(CollectorRegistry(), "toppings:")
    return ResolvedAdapters(fake, DirSource(str(tmp_path)), fake, metrics, max_adapters,
                            max_loading, max_wait_s)  # fmt: skip


def resolve(resolver, name):
    with resolver.lease() as r:
        return r(name)


def outcome_count(resolver, outcome: str) -> float:
    return resolver.metrics.resolutions.labels(outcome)._value.get()


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def run_threads(n, fn):
    results: list = [None] * n

    def body(i):
        try:
            results[i] = fn()
        except RequestError as exc:
            results[i] = exc

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results


def test_concurrent_first_requests_share_one_load(tmp_path):
    fake = FakeEngine()
    resolver = make(tmp_path, fake)
    fake.gate.clear()
    threads, results = run_threads(32, lambda: resolve(resolver, "a"))
    wait_until(lambda: fake.loads and resolver._loading["a"].num_waiting == 32,
               "32 requests waiting on one load")  # fmt: skip
    fake.gate.set()
    for t in threads:
        t.join()
    assert fake.loads == ["a"]
    assert all(isinstance(r, AdapterRef) for r in results) and len(set(results)) == 1
    assert outcome_count(resolver, "loaded") == 1
    assert resolve(resolver, "a") == results[0] and fake.loads == ["a"]  # a hit now


def test_a_failed_load_fails_every_waiter_alike_and_is_retried(tmp_path):
    fake = FakeEngine()
    resolver = make(tmp_path, fake)
    fake.gate.clear()
    fake.fail = RequestError("cannot load adapter 'a': rank 999 > 64", 400)
    threads, results = run_threads(8, lambda: resolve(resolver, "a"))
    wait_until(lambda: fake.loads and resolver._loading["a"].num_waiting == 8, "8 waiting")
    fake.gate.set()
    for t in threads:
        t.join()
    assert fake.loads == ["a"]
    assert {(str(e), e.code) for e in results} == {("cannot load adapter 'a': rank 999 > 64", 400)}
    assert outcome_count(resolver, "refused") == 1
    fake.fail = None
    assert isinstance(resolve(resolver, "a"), AdapterRef) and fake.loads == ["a", "a"]


def test_registered_names_are_not_resolved_and_never_evicted(tmp_path):
    fake = FakeEngine(operator_names=["ops"])
    resolver = make(tmp_path, fake, max_adapters=1)
    assert resolve(resolver, "ops") is fake.refs["ops"]
    assert resolve(resolver, None) is None
    for name in ("a", "b", "c"):
        resolve(resolver, name)
    assert fake.loads == ["a", "b", "c"] and fake.unloads == ["a", "b"]
    assert "ops" in fake.refs and resolver.resolved_names() == ["c"]


def test_a_name_that_is_not_one_path_component_is_not_looked_up(tmp_path):
    fake = FakeEngine()
    resolver = make(tmp_path, fake)
    for name in ("..", ".", "/etc", "a/../../b", "org/name", "a b", ""):
        with pytest.raises(RequestError) as err:
            resolve(resolver, name)
        assert (err.value.code, err.value.error_type) == (404, NOT_FOUND), name
    with pytest.raises(RequestError) as err:
        resolve(resolver, "e")  # one component, no such directory
    assert (err.value.code, err.value.error_type) == (404, NOT_FOUND)
    assert fake.loads == []


def test_resolutions_in_flight_are_bounded_with_503_retry_after(tmp_path):
    fake = FakeEngine()
    resolver = make(tmp_path, fake, max_loading=1)
    fake.gate.clear()
    threads, _ = run_threads(1, lambda: resolve(resolver, "a"))
    wait_until(lambda: fake.loads == ["a"], "a loading")
    with pytest.raises(RequestError) as err:
        resolve(resolver, "b")
    assert (err.value.code, err.value.error_type) == (503, UNAVAILABLE)
    assert err.value.retry_after_s is not None and err.value.retry_after_s > 0
    assert outcome_count(resolver, "busy") == 1
    fake.gate.set()
    threads[0].join()
    assert isinstance(resolve(resolver, "b"), AdapterRef)  # room again


def test_a_resolution_past_the_bound_waits_for_a_slot(tmp_path):
    """Every slot taken: the next cold name waits for one to end, then loads (no 503)."""
    fake = FakeEngine()
    resolver = make(tmp_path, fake, max_loading=1, max_wait_s=30.0)
    fake.gate.clear()
    threads, _ = run_threads(1, lambda: resolve(resolver, "a"))
    wait_until(lambda: fake.loads == ["a"], "a loading")
    got = []
    waiting, _ = run_threads(1, lambda: got.append(resolve(resolver, "b")))
    time.sleep(0.2)
    assert fake.loads == ["a"] and not got  # "b" waits while "a" holds the only slot
    fake.gate.set()
    for thread in threads + waiting:
        thread.join()
    assert fake.loads == ["a", "b"] and isinstance(got[0], AdapterRef)
    assert outcome_count(resolver, "busy") == 0


def test_eviction_spares_leased_and_in_flight_adapters(tmp_path):
    fake = FakeEngine()
    resolver = make(tmp_path, fake, max_adapters=2)
    resolve(resolver, "a")
    resolve(resolver, "b")
    fake.in_use.add("a")  # a request in flight in the engine: its unload is refused (409)
    with resolver.lease() as hold:
        hold("b")  # resolved, not yet submitted
        with pytest.raises(RequestError) as err:
            resolve(resolver, "c")  # "a" in use, "b" leased: no room
        assert err.value.code == 503 and err.value.retry_after_s
        assert sorted(fake.refs) == ["a", "b"]
    resolve(resolver, "c")  # "b" is free now; "a" is older but in use
    assert fake.unloads == ["b"] and sorted(fake.refs) == ["a", "c"]
    fake.in_use.clear()
    resolve(resolver, "d")
    assert fake.unloads == ["b", "a"] and resolver.resolved_names() == ["c", "d"]
    assert resolver.metrics.evictions._value.get() == 2


def test_an_adapter_unloaded_by_the_operator_is_resolved_again(tmp_path):
    fake = FakeEngine()
    resolver = make(tmp_path, fake)
    first = resolve(resolver, "a")
    fake.unload({"lora_name": "a"})
    second = resolve(resolver, "a")
    assert second != first and fake.loads == ["a", "a"]


def test_a_name_not_found_evicts_nothing(tmp_path):
    fake = FakeEngine()
    resolver = make(tmp_path, fake, max_adapters=1)
    resolve(resolver, "a")
    with pytest.raises(RequestError):
        resolve(resolver, "e")
    assert fake.unloads == [] and resolver.resolved_names() == ["a"]
