"""bench/queueing_configs.py's table of the paper's comparison (slora, chameleon-nocache,
chameleon-nosched, chameleon), the engine settings each row gives, and the headline ratios."""

from __future__ import annotations

import argparse

import pytest

from bench.bench_queueing import add_arguments
from bench.queueing_configs import (
    CONFIGS,
    OVERLOAD,
    burst_capacity,
    cache_budget,
    engine_config,
    headlines,
    parse_configs,
    sweep_fractions,
)


def args_of(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(list(argv))
    args.chunked_prefill = args.chunked_prefill == "on"
    return args


def test_the_rows_differ_only_in_queue_policy_cache_and_whether_a_load_stalls_the_step():
    rows = {
        n: (c.queue_policy, c.lora_mode, c.adapter_cache, c.fair_share) for n, c in CONFIGS.items()
    }
    assert rows == {  # the seed systems in arrival order, and this engine's default
        "slora": ("fcfs", "on-demand", False, False),
        "slora-sync": ("fcfs", "on-demand-sync", False, False),
        "chameleon-nocache": ("chameleon", "on-demand", False, False),
        "chameleon-nosched": ("fcfs", "on-demand", True, False),
        "chameleon": ("chameleon", "on-demand", True, False),
        "chameleon-fair": ("chameleon", "on-demand", True, True),
    }


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_row_is_an_engine_of_the_shared_memory_link_and_chunked_steps(name):
    config = engine_config(name, args_of(), link_gbps=1.5, cache_bytes=1 << 26, slo_ms=4000.0)
    row = CONFIGS[name]
    assert (config.queue_policy, config.lora_mode) == (row.queue_policy, row.lora_mode)
    assert config.adapter_cache is row.adapter_cache and config.eviction == row.eviction
    assert config.fair_share is row.fair_share
    assert config.memory_layout == "static" and config.adapter_cache_bytes == 1 << 26
    assert config.link_gbps == 1.5 and config.chunked_prefill and config.ttft_slo_ms == 4000.0
    pool = engine_config(name, args_of("--memory-layout", "pool"), 1.5, 1 << 26, 4000.0, 100)
    # the same bytes as one memory: the KV's 2048 slots of 100 bytes and the adapter budget
    assert pool.memory_layout == "pool" and pool.adapter_cache_bytes == 0
    assert pool.memory_bytes == 2048 * 100 + (1 << 26)


def test_chunked_prefill_off_and_a_step_budget_reach_the_engine():
    args = args_of("--chunked-prefill", "off", "--max-num-batched-tokens", "512")
    config = engine_config("chameleon", args, 1.0, 1 << 26, 5000.0)
    assert not config.chunked_prefill and config.max_num_batched_tokens == 512


def test_the_adapter_budget_is_a_share_of_the_working_set_and_holds_two_of_the_largest():
    nbytes = {8: 80, 16: 160, 128: 1280}
    assert cache_budget(nbytes, per_rank=10, share=0.5) == 7600  # half of 10 of each
    assert cache_budget(nbytes, per_rank=1, share=0.25) == 2560  # two rank-128s


def test_configs_are_parsed_and_unknown_ones_refused():
    assert parse_configs("slora, chameleon") == ["slora", "chameleon"]
    with pytest.raises(ValueError, match="fcfs"):
        parse_configs("slora,fcfs")


def test_the_overload_point_is_always_swept():
    fractions, idx = sweep_fractions("1.0,0.5")
    assert fractions == [0.5, 1.0, OVERLOAD] and fractions[idx] == OVERLOAD


def test_burst_capacity_counts_the_first_three_quarters():
    assert burst_capacity([1.0, 2.0, 3.0, 4.0, 100.0, 200.0, 300.0, 400.0]) == 6 / 200.0


def test_headlines_compare_chameleon_with_slora_and_with_cached_fcfs():
    loads = [1.0, 2.0, 3.0, 4.0]
    p99 = {
        "slora": [100.0, 600.0, 2000.0, 4000.0],  # within the SLO up to 2 req/s
        "chameleon-nosched": [100.0, 400.0, 1500.0, 3000.0],
        "chameleon": [50.0, 200.0, 500.0, 1500.0],
    }
    out = headlines(loads, p99, slo_ms=1000.0, overload_idx=3)
    assert out["slora_ratio_load_rps"] == 2.0
    assert out["p99_ttft_ratio_vs_slora"] == pytest.approx(200 / 600)
    # slora crosses 1000 ms at 2 + 400/1400, chameleon at 3 + 500/1000
    assert out["sustained_load_ratio_vs_slora"] == pytest.approx(3.5 / (2 + 400 / 1400))
    assert out["sustained_load_ratio_vs_fcfs"] == pytest.approx(3.5 / (2 + 600 / 1100))
    assert out["p99_ttft_ratio_vs_fcfs_overload"] == pytest.approx(0.5)
    assert "p99_ttft_ratio_vs_slora" not in headlines(loads, {"chameleon": p99["chameleon"]},
                                                      1000.0, 3)  # fmt: skip
    assert "p99_ttft_ratio_vs_slora_sync" not in out
    # within the SLO up to 1 req/s, crossing it at 1 + 200/1200
    sync = headlines(loads, {**p99, "slora-sync": [800.0, 2000.0, 3000.0, 5000.0]}, 1000.0, 3)
    assert sync["p99_ttft_ratio_vs_slora_sync"] == pytest.approx(50 / 800)
    assert sync["sustained_load_ratio_vs_slora_sync"] == pytest.approx(3.5 / (1 + 200 / 1200))
