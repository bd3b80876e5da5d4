"""bench_memory's pure parts (the chat trace, the summary maths, the config shim) on no model,
and the driver end to end on a tiny random Llama (the pool configs once EngineConfig has them)."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest

from bench.chat_trace import (
    ChatSpec,
    build_conversations,
    popularity,
    system_prompts,
    turn_prompt,
)
from bench.memory_setup import engine_config
from bench.memory_stats import (
    burst_capacity,
    counter_delta,
    headline,
    hit_rates,
    peak_open_tokens,
    summarise,
    time_per_token_s,
)
from toppings.server.config import EngineConfig

ADAPTERS = [f"a{i}" for i in range(48)]
HAS_POOL = "memory_layout" in {f.name for f in dataclasses.fields(EngineConfig)}


def spec(**kw) -> ChatSpec:
    return ChatSpec(**{"rate": 2.0, "duration_s": 200.0, "seed": 3, **kw})


def test_conversations_have_the_trace_shape():
    s = spec()
    convs = build_conversations(s, ADAPTERS)
    assert len(convs) > 200
    assert [c.start_s for c in convs] == sorted(c.start_s for c in convs)
    assert all(0 < c.start_s < 200.0 for c in convs)
    for c in convs:
        assert 3 <= c.num_turns <= 6
        assert len(c.output_lens) == c.num_turns and len(c.think_s) == c.num_turns - 1
        assert all(1 <= len(u) <= 96 for u in c.user_turns)
        assert all(1 <= n <= 64 for n in c.output_lens)
        assert all(t >= 0 for t in c.think_s)
    assert {c.num_turns for c in convs} == {3, 4, 5, 6}


def test_system_prompts_are_fixed_per_adapter():
    prompts = system_prompts(ADAPTERS, spec())
    assert all(200 <= len(p) <= 400 for p in prompts.values())
    assert all(100 <= t < 250 for p in prompts.values() for t in p)
    assert system_prompts(ADAPTERS, spec(seed=9)) == prompts  # not the round's seed
    assert len({tuple(p) for p in prompts.values()}) == len(ADAPTERS)


def test_zipf_choice_is_deterministic_and_skewed():
    convs = build_conversations(spec(), ADAPTERS)
    assert convs == build_conversations(spec(), ADAPTERS)
    assert convs != build_conversations(spec(seed=4), ADAPTERS)
    order, weights = popularity(ADAPTERS, spec())
    assert popularity(ADAPTERS, spec(seed=4))[0] == order  # hot adapters stay hot over rounds
    assert weights[0] == pytest.approx(2 * weights[1]) and sum(weights) == pytest.approx(1.0)
    counts = Counter(c.adapter for c in convs)
    assert counts.most_common(1)[0][0] == order[0]
    assert counts[order[0]] > 3 * counts.get(order[10], 0)


def test_bounded_by_count_and_burst_starts_at_once():
    burst = build_conversations(spec(rate=1e6, duration_s=None, num_conversations=5), ADAPTERS)
    assert len(burst) == 5 and all(c.start_s < 1e-3 for c in burst)
    assert all(
        t == 0.0 for c in build_conversations(spec(think_s=0.0), ADAPTERS) for t in c.think_s
    )


def test_turn_prompt_holds_the_history():
    s = spec()
    conv = build_conversations(s, ADAPTERS)[0]
    system = [1, 2, 3]
    answers = [[7] * conv.output_lens[0], [8] * conv.output_lens[1]]
    u = conv.user_turns
    assert turn_prompt(system, conv, [], 0) == system + list(u[0])
    assert turn_prompt(system, conv, answers, 2) == system + [*u[0], *answers[0], *u[1],
                                                              *answers[1], *u[2]]  # fmt: skip
    with pytest.raises(ValueError):
        turn_prompt(system, conv, answers[:1], 2)
    assert s.max_context() == 400 + 6 * (96 + 64)
    systems = system_prompts(ADAPTERS, s)
    for c in build_conversations(s, ADAPTERS):
        last = c.num_turns - 1
        answers = [[0] * n for n in c.output_lens]
        need = len(turn_prompt(systems[c.adapter], c, answers, last)) + c.output_lens[last]
        assert need <= s.max_context()


def rec(conv, turn, ttft, e2e, out, sent=0.0, end=1.0, prompt=100):
    fields = {"prompt_tokens": prompt, "output_tokens": out, "ttft_s": ttft, "e2e_s": e2e}
    return {"conv": conv, "turn": turn, "adapter": "a0", "sent_s": sent, "end_s": end, **fields}


def test_summary_maths():
    run = [rec(0, 0, 0.1, 1.1, 11, end=2.0), rec(0, 1, 0.3, 0.3, 1, end=4.0),
           rec(1, 0, 0.2, 2.2, 5, end=3.0)]  # fmt: skip
    assert time_per_token_s(run[0]) == pytest.approx(0.1)
    assert time_per_token_s(run[1]) is None
    s = summarise([run, run])
    assert s["num_turns"] == 6 and s["num_conversations"] == 4
    assert s["ttft_p50_ms"] == pytest.approx(200.0)
    assert s["ttft_p50_ms_turn2plus"] == pytest.approx(300.0)
    assert s["tpt_mean_ms"] == pytest.approx(1000 * (0.1 + 0.5) / 2)
    assert s["output_tokens_per_s"] == pytest.approx(34 / 8.0)


def test_counters_and_hit_rates():
    before = {"adapter_cache": {"hits": 1, "misses": 1, "loads": 1, "evictions": 0}}
    after = {"adapter_cache": {"hits": 4, "misses": 2, "loads": 2, "evictions": 1}}
    d = counter_delta(before, after)
    assert d["hits"] == 3 and d["misses"] == 1 and d["memory"] is None
    assert hit_rates([d]) == {"adapter_hit_rate": 0.75, "prefix_hit_rate": None}
    mem_b = {"prefix_hit_tokens": 10, "prompt_tokens": 100, "blocks": {"free": 3}, "block_bytes": 8}
    mem_a = {"prefix_hit_tokens": 70, "prompt_tokens": 300, "blocks": {"free": 1}, "block_bytes": 8}
    d2 = counter_delta({**before, "memory": mem_b}, {**after, "memory": mem_a})
    assert d2["memory"] == {
        "prefix_hit_tokens": 60,
        "prompt_tokens": 200,
        "blocks_at_end": {"free": 1},
    }
    assert hit_rates([d2, d2])["prefix_hit_rate"] == pytest.approx(0.3)


def test_headline_ratios_and_capacity():
    def cfg(p50):
        row = {"ttft_p50_ms": p50, "ttft_p99_ms": 2 * p50, "ttft_p50_ms_turn2plus": p50,
               "ttft_p99_ms_turn2plus": p50, "tpt_mean_ms": 10.0, "output_tokens_per_s": 5.0,
               "prefix_hit_rate": 0.5 if p50 < 100 else None}  # fmt: skip
        return {**row, "per_round": [row, row]}

    m = headline({"static": cfg(100.0), "pool": cfg(80.0), "pool_prefix": cfg(40.0)})
    assert m["ttft_p50_ratio_vs_static"] == pytest.approx(0.4)
    assert m["ttft_p99_ratio_vs_static"] == pytest.approx(0.4)
    assert m["tpt_ratio_vs_static"] == pytest.approx(1.0)
    assert m["pool_ttft_p50_ratio_vs_static"] == pytest.approx(0.8)
    assert m["ttft_p50_ratio_vs_static_per_round"] == pytest.approx([0.4, 0.4])
    assert m["prefix_hit_rate"] == 0.5
    assert headline({"static": cfg(100.0)}) == {}
    ends = [rec(i, k, 0, 0, 1, end=float(i + 1) + k) for i in range(4) for k in range(2)]
    assert burst_capacity(ends) == pytest.approx(3 / 4.0)  # 3 of 4 ended by t = 4


def test_peak_open_tokens():
    records = [rec(0, 0, 0, 0, 10, sent=0.0, end=1.0, prompt=100),
               rec(0, 1, 0, 0, 10, sent=3.0, end=5.0, prompt=300),
               rec(1, 0, 0, 0, 5, sent=2.0, end=2.5, prompt=45),
               rec(2, 0, 0, 0, 5, sent=6.0, end=7.0, prompt=45)]  # fmt: skip
    assert peak_open_tokens(records) == 310 + 50


def test_engine_config_drops_unknown_fields():
    config, dropped = engine_config(dtype="float32", max_total_tokens=99, not_a_field=1)
    assert config.max_total_tokens == 99 and dropped == ["not_a_field"]


def test_driver_end_to_end(tmp_path):
    from bench.bench_memory import main
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny", max_position_embeddings=2048)
    out, png = tmp_path / "results" / "memory.json", tmp_path / "memory_ttft.png"
    configs = "static,pool,pool_prefix" if HAS_POOL else "static"
    main(["--model", str(model), "--configs", configs, "--duration", "2", "--rounds", "2",
          "--burst", "2", "--adapters", "8", "--budget-mb", "1", "--host-mb", "2",
          "--link-gbps", "1", "--think-s", "0.2", "--adapter-dir", str(tmp_path / "adapters"),
          "--out", str(out), "--plot", str(png)])  # fmt: skip
    result = json.loads(out.read_text())
    per_config = result["metrics"]["per_config"]
    assert list(per_config) == configs.split(",")
    assert all(len(c["per_round"]) == 2 and c["num_turns"] > 0 for c in per_config.values())
    assert 0.0 <= per_config["static"]["adapter_hit_rate"] <= 1.0
    if HAS_POOL:
        assert result["metrics"]["ttft_p50_ratio_vs_static"] > 0
        assert result["config"]["engines"]["pool_prefix"]["fields_dropped"] == []
    assert png.stat().st_size > 0
