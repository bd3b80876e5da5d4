"""KV cache events of a running engine (tiny Llama, CPU): replayed into a fresh index they give
the server's prefix cache exactly, through stores, evictions to the host tier and out of it,
an adapter's unload and its reload under the same name; two adapters never share a hash; an
activated LoRA's blocks before its invocation are announced as the base model's; vLLM's own
structs (declared here as vLLM declares them) decode every batch; and the same holds over a
real ZMQ socket with a late subscriber that fills its gap from the replay socket."""

from __future__ import annotations

import contextlib
import json
import random

import msgspec
import pytest

from tests.server.kv_events.vllm_structs import vllm_structs
from toppings.scheduler.kv_index.index import KVIndex, decode_batch
from toppings.scheduler.kv_index.subscriber import KVEventSubscriber
from toppings.server.config import EngineConfig
from toppings.server.engine.engine import Engine
from toppings.server.kv_events.block_hash import prompt_hashes
from toppings.server.model.loader import load_checkpoint
from toppings.server.requests.request import GenerationRequest, SamplingParams

BLOCK = 16
INVOKE = [7, 8, 9]
PARAMS = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
# A small pool with a small host tier: later prompts push earlier blocks to the host and the
# host's oldest blocks out.
CONFIG = dict(dtype="float32", max_total_tokens=256, max_batch_size=2, memory_layout="static",
              lora_mode="cached")  # fmt: skip


class ListSink:
    """The publisher's batches, kept in order."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, bytes]] = []

    def send(self, seq: int, payload: bytes) -> None:
        self.batches.append((seq, payload))

    def serve(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    from toppings.scripts.make_adapters import make_random_adapter

    root = tmp_path_factory.mktemp("kv_events_adapters")
    paths = {}
    for i, name in enumerate(("a", "b", "act")):
        path = make_random_adapter(root / name, tiny_model_dir, rank=4, seed=i)
        if name == "act":
            cfg = json.loads((path / "adapter_config.json").read_text())
            cfg.update(alora_invocation_tokens=INVOKE, task_type="CAUSAL_LM")
            (path / "adapter_config.json").write_text(json.dumps(cfg))
        paths[name] = str(path)
    return paths


@contextlib.contextmanager
def engine_with(model_dir, adapters, sink=None, **fields):
    checkpoint = load_checkpoint(str(model_dir), "auto")
    engine = Engine(EngineConfig(**{**CONFIG, **fields}), checkpoint, kv_sink=sink)
    for name, path in adapters.items():
        engine.add_adapter(name, path)
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()


def run(engine, prompt: list[int], adapter: str | None) -> None:
    request = GenerationRequest(list(prompt), PARAMS, engine.resolve_adapter(adapter))
    engine.submit(request).result(timeout_s=300)


def cache_of(engine) -> dict[int, frozenset[str]]:
    """The server's prefix cache as the events describe it: hash -> medium."""
    tree = engine.memory.tree
    return {n.block_hash: frozenset({"GPU" if n.on_device else "CPU"}) for n in tree.nodes()}


def replayed(batches) -> dict[int, frozenset[str]]:
    index = KVIndex()
    for seq, payload in batches:
        assert index.apply("s", seq, payload) is None
    return index.blocks("s")


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(20, 200) for _ in range(n)]


@pytest.fixture(scope="module")
def recorded(tiny_model_dir, adapters):
    """One run through every kind of change, with the cache and the batches after each step."""
    rng = random.Random(0)
    shared = prompt(rng, 3 * BLOCK + 5)
    act_prompt = prompt(rng, 2 * BLOCK) + INVOKE + prompt(rng, BLOCK + 3)
    sink, steps = ListSink(), {}
    with engine_with(tiny_model_dir, adapters, sink, host_memory_bytes=1 << 16) as engine:
        publisher = engine.memory.kv_events

        def step(name: str) -> None:
            assert publisher.flush()
            steps[name] = (cache_of(engine), list(sink.batches))

        for adapter in ("a", "b", None):
            run(engine, shared, adapter)
        step("stored")
        run(engine, act_prompt, "act")
        step("activated")
        for _ in range(12):  # more than the pool holds: evictions to the host and out of it
            run(engine, prompt(rng, 3 * BLOCK + 1), rng.choice(["a", "b", None]))
        step("evicted")
        run(engine, shared, "a")
        engine.remove_adapter("a")
        step("unloaded")
        engine.add_adapter("a", adapters["a"])
        run(engine, shared, "a")
        step("reloaded")
        reloaded_counters = engine.memory.view()
    return dict(steps=steps, shared=shared, act_prompt=act_prompt, counters=reloaded_counters,
                batches=sink.batches)  # fmt: skip


@pytest.mark.parametrize("step", ["stored", "activated", "evicted", "unloaded", "reloaded"])
def test_events_replayed_into_a_fresh_index_equal_the_cache(recorded, step):
    cache, batches = recorded["steps"][step]
    assert cache, "the run cached nothing"
    assert replayed(batches) == cache


def test_the_run_swapped_and_evicted(recorded):
    counters = recorded["counters"]
    assert counters["swaps_out"] > 0 and counters["evictions_kv"] > 0, counters
    media = set().union(*recorded["steps"]["evicted"][0].values())
    assert media == {"GPU", "CPU"}


def stored_events(batches) -> list[dict]:
    out = []
    for _, payload in batches:
        for tag, fields in decode_batch(payload):
            if tag == "BlockStored":
                out.append(fields)
    return out


def test_two_adapters_never_share_a_hash_and_hashes_follow_the_published_rule(recorded):
    shared = recorded["shared"]
    expected = {name: prompt_hashes(shared, BLOCK, name) for name in ("a", "b", None)}
    first = recorded["steps"]["stored"][1]
    by_name: dict[str | None, list[int]] = {}
    for event in stored_events(first):
        by_name.setdefault(event["lora_name"], []).extend(event["block_hashes"])
        assert event["block_size"] == BLOCK
        assert not event.get("extra_keys")  # the adapter is in lora_name, never a bare key
    assert by_name == expected
    assert not set(expected["a"]) & set(expected["b"])
    assert not set(expected["a"]) & set(expected[None])


def test_activated_adapter_blocks_before_its_invocation_are_the_base_models(recorded):
    act_prompt = recorded["act_prompt"]
    before = recorded["steps"]["stored"][1]
    after = recorded["steps"]["activated"][1][len(before) :]
    events = stored_events(after)
    assert events, "the activated request cached nothing"
    assert all(e["lora_name"] is None and e["lora_id"] is None for e in events)
    hashes = [h for e in events for h in e["block_hashes"]]
    # the two blocks wholly before the invocation, as a base request's
    assert hashes == prompt_hashes(act_prompt[: 2 * BLOCK], BLOCK, None)


def test_unload_removes_and_reload_under_the_name_stores_the_same_hashes(recorded):
    a_hashes = set(prompt_hashes(recorded["shared"], BLOCK, "a"))
    unloaded = recorded["steps"]["unloaded"][0]
    reloaded = recorded["steps"]["reloaded"][0]
    assert not a_hashes & unloaded.keys()
    assert a_hashes <= reloaded.keys()


def test_vllm_structs_decode_every_batch_we_sent(recorded):
    batch_cls, stored, removed, cleared = vllm_structs(array_like=True)
    decoder = msgspec.msgpack.Decoder(batch_cls)
    kinds = set()
    for _, payload in recorded["batches"]:
        batch = decoder.decode(payload)
        assert batch.data_parallel_rank == 0
        for event in batch.events:
            kinds.add(type(event))
            if isinstance(event, stored):
                assert len(event.token_ids) == event.block_size * len(event.block_hashes)
                assert event.medium in ("GPU", "CPU")
    assert kinds == {stored, removed, cleared}


def test_map_encoding_decodes_with_vllms_map_structs(tiny_model_dir, adapters):
    sink = ListSink()
    with engine_with(tiny_model_dir, {"b": adapters["b"]}, sink, kv_events_encoding="map") as e:
        run(e, list(range(30, 30 + 2 * BLOCK + 1)), "b")
        assert e.memory.kv_events.flush()
        cache = cache_of(e)
    batch_cls, stored, _, cleared = vllm_structs(array_like=False)
    decoder = msgspec.msgpack.Decoder(batch_cls)
    events = [ev for _, p in sink.batches for ev in decoder.decode(p).events]
    assert isinstance(events[0], cleared)
    assert [ev.lora_name for ev in events[1:]] == ["b"]
    assert replayed(sink.batches) == cache


def test_over_zmq_a_late_subscriber_fills_its_gap_from_the_replay_socket(
    tiny_model_dir, adapters, tmp_path
):
    endpoint, replay = f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/kv-replay.sock"
    rng = random.Random(1)
    index = KVIndex()
    with engine_with(tiny_model_dir, {"a": adapters["a"]}, kv_events_endpoint=endpoint,
                     kv_events_replay_endpoint=replay) as engine:  # fmt: skip
        run(engine, prompt(rng, 2 * BLOCK + 2), "a")  # before anyone listens
        publisher = engine.memory.kv_events
        assert publisher.flush()
        subscriber = KVEventSubscriber(index, "s", endpoint.replace("*", "127.0.0.1"), replay,
                                       topic="kv-events")  # fmt: skip
        try:
            for _ in range(30):  # PUB delivers only once the SUB has joined: keep sending
                run(engine, prompt(rng, BLOCK + 1), rng.choice(["a", None]))
                assert publisher.flush()
                if index.servers.get("s", None) and index.servers["s"].next_seq:
                    break
            run(engine, prompt(rng, 2 * BLOCK + 1), "a")
            assert publisher.flush()
            wait_for(lambda: index.servers["s"].next_seq == publisher.num_batches)
            assert index.blocks("s") == cache_of(engine)
        finally:
            subscriber.close()


def wait_for(condition, timeout_s: float = 30.0) -> None:
    """Delivery over a socket is asynchronous: wait until `condition` holds (or fail)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the events did not arrive"
        time.sleep(0.01)
