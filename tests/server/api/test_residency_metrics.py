"""Adapter residency on `/metrics` (vLLM's residency names and our three states) checked against
`/stats` of the same instant, while an adapter loads, sits on the device and sits in host memory.

The device's adapter memory holds one adapter, so loading the second evicts the first; the link
is emulated slow enough that a load is seen in flight. The engine's thread is not started: the
test steps it."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from toppings.scripts.make_adapters import DEFAULT_TARGETS
from toppings.server.api.app import create_app
from toppings.server.config import EngineConfig
from toppings.server.engine.engine import Engine
from toppings.server.model.loader import load_checkpoint
from toppings.server.requests.request import GenerationRequest, SamplingParams

RANK = 8
FLOAT32_BYTES = 4


@pytest.fixture(scope="module")
def adapter_root(tiny_model_dir, tmp_path_factory):
    from toppings.scripts.make_adapters import make_random_adapter

    root = tmp_path_factory.mktemp("residency")
    for seed, name in enumerate(("a", "b")):
        make_random_adapter(root / name, tiny_model_dir, rank=RANK, seed=seed)
    return root


def one_adapter_bytes(checkpoint) -> int:
    """What one rank-RANK adapter on DEFAULT_TARGETS occupies in the float32 pool."""
    cfg = checkpoint.config
    per_rank = sum(sum(cfg.projection_shape(m)) for m in DEFAULT_TARGETS)
    return RANK * cfg.num_layers * per_rank * FLOAT32_BYTES


@pytest.fixture
def engine(tiny_model_dir, adapter_root):
    checkpoint = load_checkpoint(str(tiny_model_dir))
    one = one_adapter_bytes(checkpoint)
    # One adapter's worth of device memory; a load takes about 0.3 s over the emulated link.
    config = EngineConfig(dtype="float32", max_total_tokens=2048, max_batch_size=2,
                          lora_mode="on-demand", adapter_cache_bytes=one,
                          link_gbps=one * 8 / 0.3e9)  # fmt: skip
    eng = Engine(config, checkpoint)
    for name in ("a", "b"):
        eng.add_adapter(name, str(adapter_root / name))
    yield eng
    eng.shutdown()


def drive(engine, until, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "the engine did not get there in time"
        if engine.step() is None:
            time.sleep(0.002)


def run_one(engine, adapter: str) -> None:
    """Submit a one-token request for `adapter` and step the engine until it ends."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    handle = engine.submit(
        GenerationRequest(list(range(5, 21)), params, engine.resolve_adapter(adapter))
    )
    outs: list = []
    drive(engine, lambda: outs.extend(handle.poll()) or any(o.finish_reason for o in outs))


def scrape(client) -> tuple[dict, dict]:
    """(/metrics families by name, /stats body), read back to back on a still engine."""
    text = client.get("/metrics").get_data(as_text=True)
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return fams, client.get("/stats").get_json()


def check_against_stats(fams: dict, stats: dict) -> dict[str, str]:
    """Every residency series agrees with /stats; returns each adapter's state."""
    model = {"model_name": stats["model"]}
    level = {"device": "gpu", "loading": "cpu", "host": "cpu"}
    want_loaded = {(a["name"], level[a["state"]], str(a["pinned"]).lower(), str(a["rank"]))
                   for a in stats["adapters"]}  # fmt: skip
    got_loaded = {(s.labels["adapter_name"], s.labels["level"], s.labels["pinned"],
                   s.labels["rank"]) for s in fams["vllm:lora_adapter_loaded"].samples}  # fmt: skip
    assert got_loaded == want_loaded
    assert all(s.value == 1 for s in fams["vllm:lora_adapter_loaded"].samples)
    want_state = {(a["name"], a["state"], str(a["pinned"]).lower()) for a in stats["adapters"]}
    got_state = {(s.labels["adapter_name"], s.labels["state"], s.labels["pinned"])
                 for s in fams["toppings:lora_adapter_state"].samples}  # fmt: skip
    assert got_state == want_state
    states = [a["state"] for a in stats["adapters"]]
    assert stats["num_device_adapters"] == states.count("device")
    assert stats["num_loading_adapters"] == states.count("loading")
    assert stats["num_host_adapters"] == states.count("host")
    counts = {
        "vllm:num_gpu_loaded_lora_adapters": stats["num_device_adapters"],
        "vllm:num_cpu_loaded_lora_adapters": stats["num_host_adapters"]
        + stats["num_loading_adapters"],
        "vllm:max_gpu_lora_adapters": stats["max_device_adapters"],
    }
    for name, value in counts.items():
        ((sample),) = fams[name].samples
        assert (sample.labels, sample.value) == (model, value), name
    hist = {s.name: s for s in fams["vllm:lora_adapter_load_seconds"].samples
            if s.name.endswith(("_count", "_sum"))}  # fmt: skip
    times = stats["adapter_load_seconds"]
    assert hist["vllm:lora_adapter_load_seconds_count"].value == times["count"]
    assert hist["vllm:lora_adapter_load_seconds_sum"].value == pytest.approx(times["sum_s"])
    assert {a["name"] for a in stats["adapters"] if a["resident"]} == set(
        stats["resident_adapters"]
    )
    return {a["name"]: a["state"] for a in stats["adapters"]}


def pinned(stats: dict, name: str) -> bool:
    return next(a["pinned"] for a in stats["adapters"] if a["name"] == name)


def test_residency_series_follow_loads_and_evictions(engine):
    client = create_app(engine).test_client()
    fams, stats = scrape(client)
    assert check_against_stats(fams, stats) == {"a": "host", "b": "host"}
    assert stats["max_device_adapters"] == 1  # the memory holds one adapter of this size
    assert stats["adapter_load_seconds"]["count"] == 0

    # A request for "a": its load is seen in flight, pinned while it runs.
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    handle = engine.submit(
        GenerationRequest(list(range(5, 21)), params, engine.resolve_adapter("a"))
    )
    drive(engine, lambda: engine.stats().loading_adapters)
    fams, stats = scrape(client)
    assert check_against_stats(fams, stats) == {"a": "loading", "b": "host"}
    assert pinned(stats, "a") and not pinned(stats, "b")
    outs: list = []
    drive(engine, lambda: outs.extend(handle.poll()) or any(o.finish_reason for o in outs))

    # Idle on the device: not pinned; one load observed.
    fams, stats = scrape(client)
    assert check_against_stats(fams, stats) == {"a": "device", "b": "host"}
    assert not pinned(stats, "a")
    assert stats["adapter_load_seconds"]["count"] == 1
    buckets = [s for s in fams["vllm:lora_adapter_load_seconds"].samples
               if s.name.endswith("_bucket")]  # fmt: skip
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == 1
    # the emulated link makes the load take at least its transfer time
    assert stats["adapter_load_seconds"]["sum_s"] >= 0.2

    # "b" needs the memory "a" holds: "a" goes back to host memory only.
    run_one(engine, "b")
    fams, stats = scrape(client)
    assert check_against_stats(fams, stats) == {"a": "host", "b": "device"}
    assert stats["adapter_load_seconds"]["count"] == 2
    # the rank-aware scheduler reads the same body
    from toppings.scheduler.state import ServerState

    state = ServerState.from_stats("http://s", stats)
    assert (state.residency("b"), state.residency("a"), state.residency("c")) == (0, 2, 3)


def test_adapter_series_may_be_limited_to_the_device_or_left_out(engine):
    # --adapter-series: "device" publishes the adapters on the device (or loading there) only,
    # "off" none; the counts by residency stay whatever it says
    from toppings.server.api.options import ApiOptions

    run_one(engine, "a")  # "a" on the device (one adapter's memory), "b" in host memory
    per_adapter = ("vllm:lora_adapter_loaded", "toppings:lora_adapter_state")
    seen = {}
    for which in ("all", "device", "off"):
        fams, stats = scrape(create_app(engine, ApiOptions(adapter_series=which)).test_client())
        assert {a["name"]: a["state"] for a in stats["adapters"]} == {"a": "device", "b": "host"}
        names = [{s.labels["adapter_name"] for s in fams[n].samples} for n in per_adapter]
        assert names[0] == names[1]
        seen[which] = names[0]
        (gpu,) = fams["vllm:num_gpu_loaded_lora_adapters"].samples
        (cpu,) = fams["vllm:num_cpu_loaded_lora_adapters"].samples
        assert (gpu.value, cpu.value) == (1, 1)
    assert seen == {"all": {"a", "b"}, "device": {"a"}, "off": set()}
