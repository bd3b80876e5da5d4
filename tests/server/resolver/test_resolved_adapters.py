"""The load-on-miss table alone, with an in-memory name table and a registrar whose reads wait
on a gate: one load per name however many requests wait for it, a failure shared by all of them
and retried by the next, the bound on resolutions in flight, eviction that spares leased
adapters and adapters in use, reads that run beside a registration, and the host tier that
keeps evicted adapters (no second read while their files are unchanged, within its bytes)."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from toppings.gpu_lora.host_memory import ContentKey
from toppings.gpu_lora.peft.adapter import LoraAdapter
from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.errors import NOT_FOUND, UNAVAILABLE, unknown_adapter
from toppings.server.requests.request import RequestError
from toppings.server.resolver.host_tier import HostTier
from toppings.server.resolver.metrics import ResolverMetrics
from toppings.server.resolver.preparer import Preparer, fetch_files, reader_threads
from toppings.server.resolver.resolved import ResolvedAdapters
from toppings.server.resolver.sources import DirSource

ADAPTER_BYTES = 2 * 4 * 4 * 64  # the fake adapter's two float32 [4, 64] tensors


def fake_adapter(name: str, path: str) -> LoraAdapter:
    """An adapter of 2 KiB whose content (so digest) is its directory's name."""
    a = torch.full((4, 64), float(len(path)))
    weights = {(0, "q_proj"): (a, torch.full((64, 4), float(ord(path[-1]))))}
    return LoraAdapter(name, path, 4, 8.0, 2.0, ("q_proj",), weights, ADAPTER_BYTES, None)


class FakeEngine:
    """A name table and a registrar in one: reads (`open`) wait on `gate`, and `fail` makes
    them fail; `loads` lists the reads, `registers` the registrations."""

    def __init__(self, operator_names=()):
        self.refs = {n: AdapterRef.new(n, 8, 1) for n in operator_names}
        self.held: dict[str, LoraAdapter] = {}
        self.root = None  # set by make(): check() resolves paths under it
        self.gate = threading.Event()
        self.gate.set()
        self.register_gate = threading.Event()
        self.register_gate.set()
        self.removing: list[str] = []  # unloads begun (they wait on remove_gate)
        self.remove_gate = threading.Event()
        self.remove_gate.set()
        self.loads: list[str] = []
        self.registers: list[str] = []
        self.unloads: list[str] = []
        self.in_use: set[str] = set()  # names with a request in flight in the "engine"
        self.fail: RequestError | None = None
        self.stuck: set[str] = set()  # names whose reads wait on `unstick` (a store that hangs)
        self.unstick = threading.Event()
        self._lock = threading.Lock()

    def resolve_adapter(self, name):
        if name is None:
            return None
        with self._lock:
            ref = self.refs.get(name)
        if ref is None:
            raise RequestError(unknown_adapter(name), 404, NOT_FOUND)
        return ref

    def check(self, body: dict) -> tuple[str, str]:
        return body["lora_name"], str(self.root / body["lora_path"])

    def open(self, name: str, path: str) -> LoraAdapter:
        with self._lock:
            self.loads.append(name)
        assert self.gate.wait(30)
        if name in self.stuck:
            assert self.unstick.wait(30)
        if self.fail is not None:
            raise self.fail
        return fake_adapter(name, path)

    def register(self, adapter: LoraAdapter, content: ContentKey | None = None) -> AdapterRef:
        assert content is not None  # made by the reader, not on the adapter thread
        assert self.register_gate.wait(30)
        ref = AdapterRef.new(adapter.name, 8, 1)
        with self._lock:
            self.registers.append(adapter.name)
            self.refs[adapter.name] = ref
            self.held[adapter.name] = dataclasses.replace(adapter, id=ref.weights_id)
        return ref

    def retire(self, name: str) -> LoraAdapter:
        with self._lock:
            self.removing.append(name)
        assert self.remove_gate.wait(30)
        if name in self.in_use:
            raise RequestError(f"adapter {name!r} is in use", 409, "conflict")
        with self._lock:
            self.unloads.append(name)
            del self.refs[name]
            return self.held.pop(name)

    def unload(self, body: dict) -> None:
        """The operator's /v1/unload_lora_adapter, not the resolver's eviction."""
        with self._lock:
            del self.refs[body["lora_name"]]
            self.held.pop(body["lora_name"])


def make(tmp_path, fake, max_adapters=64, max_loading=4, max_wait_s=0.0,
         host_bytes=0, max_parsing=None, max_resolve_s=30.0) -> ResolvedAdapters:  # fmt: skip
    for name in ("a", "b", "c", "d"):  # the source finds these (the fake reads no tensors)
        (tmp_path / name).mkdir()
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            (tmp_path / name / file).write_text(name)  # what the host tier's file key stats
    fake.root = tmp_path
    metrics = ResolverMetrics(CollectorRegistry(), "toppings:")
    return ResolvedAdapters(fake, DirSource(str(tmp_path)), fake, metrics, max_adapters,
                            max_loading, max_wait_s, host_bytes, max_parsing,
                            max_resolve_s)  # fmt: skip


def resolve(resolver, name):
    with resolver.lease() as r:
        return r(name)


def outcome_count(resolver, outcome: str) -> float:
    return resolver.metrics.resolutions.labels(outcome)._value.get()


def waits(resolver, bound: str) -> tuple[float, float]:
    """(waits, seconds waited) at `bound` (lora_resolver_wait_seconds' count and sum)."""
    samples = resolver.metrics.waits.collect()[0].samples
    count, total = (next(s.value for s in samples
                         if s.name.endswith(suffix) and s.labels["bound"] == bound)
                    for suffix in ("_count", "_sum"))  # fmt: skip
    return count, total


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


def test_resolutions_in_flight_share_fewer_reader_threads(tmp_path):
    """Four names resolve at once (none refused or waiting for a slot) with one read past its
    fetch at a time: the reads run in turn, and all four land."""
    fake = FakeEngine()
    resolver = make(tmp_path, fake, max_loading=4, max_parsing=1)
    fake.gate.clear()
    threads, results = [], []
    for name in "abcd":
        t, r = run_threads(1, lambda n=name: resolve(resolver, n))
        threads += t
        results.append(r)
    wait_until(lambda: len(resolver._loading) == 4 and fake.loads,
               "four resolutions in flight, one read begun")  # fmt: skip
    time.sleep(0.05)
    assert len(fake.loads) == 1  # the other three reads wait for the one reader
    fake.gate.set()
    for t in threads:
        t.join()
    assert sorted(fake.loads) == list("abcd")
    assert all(isinstance(r[0], AdapterRef) for r in results)


@pytest.mark.parametrize(("max_loading", "spare", "want"), [(4, 1, 1), (4, 0, 1), (4, -3, 1),
                                                            (4, 15, 4), (2, 3, 2)])  # fmt: skip
def test_reader_threads_follow_the_cores_the_engine_leaves(max_loading, spare, want):
    assert reader_threads(max_loading, spare) == want


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
    assert waits(resolver, "max_loading")[0] == 1  # a wait that ended in its 503 counts
    fake.gate.set()
    threads[0].join()
    assert isinstance(resolve(resolver, "b"), AdapterRef)  # room again
    assert waits(resolver, "max_loading")[0] == 1  # a slot free: no wait


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
    count, seconds = waits(resolver, "max_loading")  # "b"'s wait, not its resolution after
    assert count == 1 and 0.2 <= seconds and waits(resolver, "max_adapters") == (0, 0)


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


def test_an_evicted_adapter_is_registered_again_without_a_read(tmp_path):
    fake = FakeEngine()
    resolver = make(tmp_path, fake, max_adapters=1, host_bytes=4 * ADAPTER_BYTES)
    first = resolve(resolver, "a")
    first_weights = fake.held["a"].weights
    resolve(resolver, "b")  # evicts "a" into the host tier
    assert fake.unloads == ["a"] and resolver.tier.charged_bytes == ADAPTER_BYTES
    again = resolve(resolver, "a")  # evicts "b"; "a" from the tier
    assert fake.loads == ["a", "b"] and fake.registers == ["a", "b", "a"]
    assert again != first and fake.held["a"].weights is first_weights  # the very tensors
    assert resolver.metrics.host_hits._value.get() == 1
    assert resolver.tier.charged_bytes == ADAPTER_BYTES  # "b" now, "a" taken out
    assert resolver.metrics.host_bytes._value.get() == ADAPTER_BYTES


def test_an_adapter_whose_files_changed_is_read_again(tmp_path):
    fake = FakeEngine()
    resolver = make(tmp_path, fake, max_adapters=1, host_bytes=4 * ADAPTER_BYTES)
    resolve(resolver, "a")
    resolve(resolver, "b")
    weights = tmp_path / "a" / "adapter_model.safetensors"
    replaced = tmp_path / "a" / "new.safetensors"
    replaced.write_text("other weights")
    os.replace(replaced, weights)  # a new file in its place
    resolve(resolver, "a")
    assert fake.loads == ["a", "b", "a"] and resolver.metrics.host_hits._value.get() == 0
    resolve(resolver, "b")  # "b"'s files did not change: kept
    assert fake.loads == ["a", "b", "a"] and resolver.metrics.host_hits._value.get() == 1


def test_the_host_tier_keeps_the_latest_evicted_within_its_bytes(tmp_path):
    fake = FakeEngine()
    resolver = make(tmp_path, fake, max_adapters=1, host_bytes=2 * ADAPTER_BYTES)
    for name in ("a", "b", "c", "d"):  # evicts a, b, c in turn; the tier keeps two of them
        resolve(resolver, name)
        assert resolver.tier.charged_bytes <= 2 * ADAPTER_BYTES
    assert len(resolver.tier) == 2
    resolve(resolver, "a")  # dropped from the tier for "c": read again
    assert fake.loads == ["a", "b", "c", "d", "a"]
    resolve(resolver, "c")  # kept
    assert fake.loads == ["a", "b", "c", "d", "a"] and fake.registers[-1] == "c"


def test_without_host_bytes_an_evicted_adapter_is_read_again(tmp_path):
    fake = FakeEngine()
    resolver = make(tmp_path, fake, max_adapters=1, host_bytes=0)
    for name in ("a", "b", "a"):
        resolve(resolver, name)
    assert fake.loads == ["a", "b", "a"] and resolver.tier.charged_bytes == 0


def test_an_adapter_in_use_is_not_kept_when_its_eviction_is_refused(tmp_path):
    """The tier's place is charged before the unload and given back when it is refused."""
    fake = FakeEngine()
    resolver = make(tmp_path, fake, max_adapters=1, host_bytes=4 * ADAPTER_BYTES)
    resolve(resolver, "a")
    fake.in_use.add("a")
    with pytest.raises(RequestError) as err:
        resolve(resolver, "b")  # read, then no room: "a" in use
    assert err.value.code == 503
    assert len(resolver.tier) == 1 and resolver.tier.charged_bytes == ADAPTER_BYTES  # "b", read
    fake.in_use.clear()
    resolve(resolver, "b")  # room now: "a" to the tier, "b" from it
    assert fake.loads == ["a", "b"] and fake.unloads == ["a"]
    assert resolver.tier.charged_bytes == ADAPTER_BYTES  # "a" now


def test_a_load_waits_for_a_held_adapter_to_be_let_go(tmp_path):
    """Every resolved adapter held: a load past the bound waits (no 503) until one is let go,
    a lease given back (woken at once) or its requests in the engine ended (seen on a later
    try); past `max_wait_s` it gets its 503 with Retry-After."""
    fake = FakeEngine()
    resolver = make(tmp_path, fake, max_adapters=1, max_wait_s=30.0)
    with resolver.lease() as r:
        r("a")  # leased until the block ends
        threads, results = run_threads(1, lambda: resolve(resolver, "b"))
        wait_until(lambda: fake.loads == ["a", "b"], "b read")
        time.sleep(0.2)
        assert results[0] is None and fake.unloads == []  # waiting, not refused
    threads[0].join(30)
    assert isinstance(results[0], AdapterRef) and fake.unloads == ["a"]
    fake.in_use.add("b")  # in flight in the engine: retire answers 409
    threads, results = run_threads(1, lambda: resolve(resolver, "c"))
    wait_until(lambda: fake.removing.count("b") >= 2, "b tried again")
    assert results[0] is None and fake.unloads == ["a"]
    fake.in_use.clear()  # its requests ended
    threads[0].join(30)
    assert isinstance(results[0], AdapterRef) and fake.unloads == ["a", "b"]
    count, seconds = waits(resolver, "max_adapters")  # "b" for the lease, "c" for the engine
    assert count == 2 and seconds >= 0.2 and waits(resolver, "max_loading") == (0, 0)
    (tmp_path / "short").mkdir()
    short = make(tmp_path / "short", FakeEngine(), max_adapters=1, max_wait_s=0.3)
    short.registrar.in_use.add("a")
    resolve(short, "a")
    started = time.monotonic()
    with pytest.raises(RequestError) as err:
        resolve(short, "b")
    assert err.value.code == 503 and err.value.retry_after_s
    assert time.monotonic() - started >= 0.3
    assert waits(short, "max_adapters")[0] == 1 and waits(short, "max_adapters")[1] >= 0.3


def test_the_eviction_for_a_load_runs_while_its_files_are_read(tmp_path):
    """An unload waits for the engine's step; the read does not wait for it, nor it for the
    read, and the registration waits for both."""
    fake = FakeEngine()
    resolver = make(tmp_path, fake, max_adapters=1)
    resolve(resolver, "a")
    fake.gate.clear()
    fake.remove_gate.clear()
    threads, results = run_threads(1, lambda: resolve(resolver, "b"))
    wait_until(lambda: fake.loads == ["a", "b"] and fake.removing == ["a"],
               "the read of b and the unload of a under way together")  # fmt: skip
    fake.remove_gate.set()
    wait_until(lambda: fake.unloads == ["a"], "a unloaded")
    assert fake.registers == ["a"]  # b's read has not ended: no registration yet
    fake.gate.set()
    threads[0].join()
    assert isinstance(results[0], AdapterRef) and fake.registers == ["a", "b"]


def test_a_read_stuck_on_storage_holds_its_own_thread_only(tmp_path):
    """With one read parsing at a time, a read whose fetch hangs (its store stuck) does not
    keep the reads of other names from landing; it lands once its store answers."""
    fake = FakeEngine()
    make(tmp_path, fake)  # the directories a-d
    stuck = threading.Event()

    def fetch(directory: str) -> None:
        if directory.endswith("a"):
            assert stuck.wait(30)

    preparer = Preparer(fake, HostTier(0), max_reading=4, max_parsing=1, fetch=fetch)
    hung = preparer.start("a", str(tmp_path / "a"))
    others = [preparer.start(n, str(tmp_path / n)) for n in "bc"]
    assert [f.result(30)[0].adapter.name for f in others] == ["b", "c"]
    assert not hung.done()
    stuck.set()
    assert hung.result(30)[0].adapter.name == "a"


def test_a_stuck_read_fails_its_requests_in_time_and_frees_its_slot(tmp_path):
    """A resolution waits `max_resolve_s` for its read, then every request for that name gets
    503 with Retry-After and the slot is free for other names; the read, once it ends, is kept
    in the host tier, so the next resolution of that name reads nothing."""
    fake = FakeEngine()
    resolver = make(tmp_path, fake, max_loading=2, max_resolve_s=0.2, host_bytes=1 << 20)
    fake.stuck.add("a")
    threads, results = run_threads(3, lambda: resolve(resolver, "a"))
    for t in threads:
        t.join()
    for r in results:
        assert isinstance(r, RequestError) and r.code == 503 and r.retry_after_s
    assert not resolver._loading  # its slot is free again (its reader is not)
    assert isinstance(resolve(resolver, "b"), AdapterRef)
    fake.unstick.set()
    wait_until(lambda: resolver.tier.charged_bytes > 0, "the late read kept")
    assert isinstance(resolve(resolver, "a"), AdapterRef)
    assert fake.loads.count("a") == 1


def test_fetch_files_never_raises_nor_waits_on_what_is_not_a_regular_file(tmp_path):
    """The fetch leaves every refusal to the read: a missing directory, a FIFO in a file's
    place (never opened for a writer), an empty file, a symlink."""
    fetch_files(str(tmp_path / "missing"))
    (tmp_path / "x").mkdir()
    os.mkfifo(tmp_path / "x" / "adapter_model.safetensors")
    (tmp_path / "x" / "adapter_config.json").write_text("")
    fetch_files(str(tmp_path / "x"))
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "adapter_config.json").symlink_to(tmp_path / "x" / "adapter_config.json")
    (tmp_path / "y" / "adapter_model.safetensors").write_bytes(b"\0" * 10_000)
    fetch_files(str(tmp_path / "y"))
