"""The settings classes generate `toppings-serve`'s flags and check values in one place."""

from __future__ import annotations

import dataclasses

import pytest

from toppings.server.api.options import ApiOptions
from toppings.server.cli_args import build_parser, parse_configs
from toppings.server.config import ENGINE_PARTS, EngineConfig


def parse(*flags: str):
    return parse_configs(build_parser().parse_args(["--model", "m", *flags]))


def test_engine_config_is_its_parts_flat():
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    parts = [{f.name for f in dataclasses.fields(part)} for part in ENGINE_PARTS]
    assert names == set().union(*parts) and sum(map(len, parts)) == len(names)


def test_defaults_match_the_dataclasses():
    serve, engine, options = parse()
    assert engine == EngineConfig(dtype="auto") and options == ApiOptions()
    assert (serve.host, serve.port, serve.threads, serve.drain_timeout) == ("127.0.0.1", 8100, 8,
                                                                             30.0)  # fmt: skip


def test_flags_reach_their_fields():
    serve, engine, options = parse(
        "--prefix-cache", "off", "--cuda-graphs", "off", "--cpu-workers", "2", "--cpu-cores",
        "0-1", "--torch-threads", "3", "--lora", "a=/x", "--lora-dir", "d", "--allowed-lora-root",
        "r", "--max-new-tokens-limit", "7", "--queue-policy", "chameleon",
    )  # fmt: skip
    assert engine.prefix_cache is False and engine.cuda_graphs is False
    assert (engine.num_cpu_workers, engine.cpu_cores, engine.num_threads) == (2, (0, 1), 3)
    assert engine.queue_policy == "chameleon"
    assert serve.loras == (("a", "/x"),) and options.lora_roots == ("d", "r")
    assert options.max_new_tokens_limit == 7


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--memory-bytes", "-1"), "memory_bytes must be >= 0"),
        (("--cuda-graphs", "on"), "--cuda-graphs on needs --device cuda"),
        (("--cpu-workers", "3", "--cpu-cores", "1,2"), "at least one core per CPU worker"),
        (("--drain-timeout", "-1"), "drain_timeout must be >= 0"),
        (("--api-key", ""), "api_key must not be empty"),
    ],
)
def test_bad_values_are_refused_before_anything_loads(flags, message):
    with pytest.raises(ValueError, match=message):
        parse(*flags)


def test_code_gets_the_same_checks():
    with pytest.raises(ValueError, match="queue_policy must be one of fcfs, chameleon"):
        EngineConfig(queue_policy="lifo")
    with pytest.raises(ValueError, match="max_batch_size must be positive"):
        dataclasses.replace(EngineConfig(), max_batch_size=0)


def test_each_choice_list_names_its_table():
    from toppings.gpu_lora.eviction import EVICTION_POLICIES
    from toppings.server import config
    from toppings.server.memory.layout import MemoryLayout
    from toppings.server.sched.policies import QUEUE_POLICY_CLASSES

    assert config.QUEUE_POLICIES == tuple(QUEUE_POLICY_CLASSES)
    assert config.EVICTIONS == (config.AUTO_EVICTION, *EVICTION_POLICIES)
    assert config.MEMORY_LAYOUTS == tuple(m.value for m in MemoryLayout)


def test_a_part_holds_its_fields_only():
    from toppings.server.config import LoraConfig, MemoryConfig, SchedulingConfig

    engine = EngineConfig(max_total_tokens=4096, ttft_slo_ms=250.0, adapter_cache_bytes=1000)
    for cls in ENGINE_PARTS:
        part = engine.part(cls)
        assert type(part) is cls
        own = {f.name for f in dataclasses.fields(cls)}
        assert all(getattr(part, n) == getattr(engine, n) for n in own)
        others = {f.name for f in dataclasses.fields(EngineConfig)} - own
        assert not any(hasattr(part, n) for n in others)
    with pytest.raises(TypeError):
        engine.part(EngineConfig)
    assert engine.part(SchedulingConfig).ttft_slo_ms == 250.0
    assert engine.part(LoraConfig).adapter_cache_bytes == 1000
    assert engine.part(MemoryConfig).max_total_tokens == 4096


def test_modules_built_from_their_parts():
    from tests.helpers import tiny_model_config
    from toppings.server.config import LoraConfig, MemoryConfig, SchedulingConfig
    from toppings.server.memory.layout import MemoryLayout, make_layout
    from toppings.server.sched.gate_limits import GateLimits
    from toppings.server.sched.policies import make_queue_policy

    engine = EngineConfig(
        queue_policy="chameleon",
        memory_layout="static",
        max_total_tokens=256,
        max_batch_size=4,
        ttft_slo_ms=250.0,
        adapter_cache_bytes=1000,
    )
    sched = engine.part(SchedulingConfig)
    queue = make_queue_policy(sched, engine.max_total_tokens)
    assert queue.name == "chameleon" and queue.quotas == [256]
    assert queue.view()["ttft_slo_ms"] == 250.0
    limits = GateLimits(4, engine.max_prefill_tokens, expected_kv=True)
    assert GateLimits.from_config(sched) == limits
    memory, lora = engine.part(MemoryConfig), engine.part(LoraConfig)
    layout = make_layout(memory.memory_layout, memory, device=engine.device,
                         adapter_cache_bytes=lora.adapter_cache_bytes)  # fmt: skip
    assert layout.kind is MemoryLayout.STATIC
    assert layout.kv_slots(tiny_model_config(), 4, lambda: 0) == 256
    assert layout.total_tokens(256, 10.0) == 256 + 100


def test_key_flags_are_redacted_in_a_command_line():
    """The launcher's log and loadgen's result file show command lines: no key in them."""
    from toppings.server.settings import redact_keys

    argv = ["--port", "1", "--api-key", "k1", "--admin-api-key=k2",
            "--scheduler-arg=--server-api-key=k3", "--model", "m"]  # fmt: skip
    want = ["--port", "1", "--api-key", "KEY", "--admin-api-key=KEY",
            "--scheduler-arg=--server-api-key=KEY", "--model", "m"]  # fmt: skip
    assert redact_keys(argv) == want
