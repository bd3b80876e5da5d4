"""The paper's comparison (Chameleon, MICRO'25) as engine configurations, and the numbers a
sweep of them is judged by; bench/bench_queueing.py runs them on the real engine,
bench/queueing_sim.py on the simulated one.

`CONFIGS` is the table of the four systems (queue policy x whether idle adapters stay on the
device), and S-LoRA a second way (`slora-sync`: its loads stall the step that needs them, as
S-LoRA's router awaits `load_adapters` before a new batch's prefill; `slora` waits only the
request, as this engine's on-demand mode does); `engine_config` is one row over the settings
all of them share. `headlines` gives the issue's ratios from each configuration's P99 TTFT per
load: Chameleon against S-LoRA at S-LoRA's highest load within the SLO and in sustained load
(`sustained`: where the P99 crosses the SLO), and the scheduler alone against cached FCFS in
sustained load and at OVERLOAD times the baseline's capacity (`burst_capacity`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from toppings.server.config import EngineConfig

CAPACITY_SHARE = 0.75  # capacity: completions per second until 75% of a burst has completed
OVERLOAD = 1.25  # p99_ttft_ratio_vs_fcfs_overload: at this multiple of the baseline's capacity


@dataclass(frozen=True)
class Comparison:
    """One system of the paper's comparison, as engine settings: the queue policy
    (`--queue-policy`), how an adapter not on the device starts (`--lora-mode`), whether idle
    adapters stay on the device (`--adapter-cache`), which of them leaves first (`--eviction`)
    and whether waiting requests take fair shares between adapters (`--fair-share`: the seed
    systems admit in arrival order; `chameleon-fair` is this engine's default since session
    62)."""

    queue_policy: str
    lora_mode: str
    adapter_cache: bool
    eviction: str
    fair_share: bool = False


CONFIGS: dict[str, Comparison] = {
    "slora": Comparison("fcfs", "on-demand", False, "lru"),
    "slora-sync": Comparison("fcfs", "on-demand-sync", False, "lru"),
    "chameleon-nocache": Comparison("chameleon", "on-demand", False, "lru"),
    "chameleon-nosched": Comparison("fcfs", "on-demand", True, "chameleon"),
    "chameleon": Comparison("chameleon", "on-demand", True, "chameleon"),
    "chameleon-fair": Comparison("chameleon", "on-demand", True, "chameleon", fair_share=True),
}
# The paper's comparison, every system in arrival order (a sweep's default configurations)
SEED_SYSTEMS = tuple(name for name, row in CONFIGS.items() if not row.fair_share)
SLORA, FCFS, CHAMELEON = "slora", "chameleon-nosched", "chameleon"  # the headlines' three
SLORA_SYNC = "slora-sync"  # S-LoRA whose loads stall its steps, as its router does


def engine_config(
    name: str, args, link_gbps: float, cache_bytes: int, slo_ms: float, slot_bytes: int = 0
) -> EngineConfig:
    """The engine of configuration `name`: its row of CONFIGS over what all of them share (the
    KV, the adapter budget beside it, the link, the step budget). With `--memory-layout pool`
    the KV (`slot_bytes` a token) and the adapter budget are one memory of their bytes summed,
    adapters taking what the KV leaves."""
    row = CONFIGS[name]
    memory = {"memory_layout": args.memory_layout, "adapter_cache_bytes": cache_bytes}
    if args.memory_layout == "pool":
        memory = {"memory_layout": "pool", "adapter_cache_bytes": 0,
                  "memory_bytes": args.max_total_tokens * slot_bytes + cache_bytes}  # fmt: skip
    return EngineConfig(
        dtype=args.dtype,
        max_total_tokens=args.max_total_tokens,
        max_batch_size=args.max_batch_size,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill=args.chunked_prefill,
        max_num_batched_tokens=args.max_num_batched_tokens,
        ttft_slo_ms=slo_ms,
        **memory,
        link_gbps=link_gbps,
        **asdict(row),
    )


def cache_budget(nbytes: dict[int, int], per_rank: int, share: float) -> int:
    """The adapter budget: `share` of all adapters' bytes (`nbytes`: one adapter's per rank),
    at least two of the largest (any request can then run beside another)."""
    return max(int(share * per_rank * sum(nbytes.values())), 2 * max(nbytes.values()))


def burst_capacity(e2e_s: list[float]) -> float:
    """Requests per second while a burst (all submitted at once) still saturates the server:
    75% of its requests over the time the 75th percent took to complete."""
    done = sorted(e2e_s)
    k = max(1, int(CAPACITY_SHARE * len(done)))
    return k / done[k - 1]


def sustained(loads: list[float], p99s: list[float], slo_ms: float) -> tuple[float, bool]:
    """The load at which P99 TTFT crosses the SLO (linear between points); True if it never
    does within the sweep (the value is then a lower bound: the highest load run)."""
    if p99s[0] > slo_ms:
        return 0.0, False
    for i in range(1, len(loads)):
        if p99s[i] > slo_ms:
            a, b = p99s[i - 1], p99s[i]
            return loads[i - 1] + (loads[i] - loads[i - 1]) * (slo_ms - a) / (b - a), False
    return loads[-1], True


def headlines(loads: list[float], p99: dict[str, list[float]], slo_ms: float,
              overload_idx: int | None) -> dict:  # fmt: skip
    """The issue's headline ratios from each configuration's P99 TTFT (ms) per load:
    `sustained_load_ratio_vs_slora` and `p99_ttft_ratio_vs_slora` (chameleon / slora, the P99 at
    slora's highest load within the SLO), `sustained_load_ratio_vs_fcfs` (chameleon /
    chameleon-nosched) and `p99_ttft_ratio_vs_fcfs_overload` (the P99s at loads[overload_idx]);
    with slora-sync, the two S-LoRA ratios against it too (`*_vs_slora_sync`).
    A ratio whose configurations did not run is None; `sustained_*` per configuration."""
    held = {c: sustained(loads, v, slo_ms) for c, v in p99.items()}

    def ratio(a: float | None, b: float | None) -> float | None:
        """a / b; None without both or where either is infinite (a P99 never reached)."""
        if a is None or not b or not math.isfinite(a) or not math.isfinite(b):
            return None
        return a / b

    def within(base: str) -> int:
        ok = [i for i, v in enumerate(p99[base]) if v <= slo_ms]
        return ok[-1] if ok else 0

    out: dict = {"sustained_rps": {c: v for c, (v, _) in held.items()},
                 "sustained_is_lower_bound": {c: b for c, (_, b) in held.items()}}  # fmt: skip
    has = set(p99)
    if {SLORA, CHAMELEON} <= has:
        at = within(SLORA)
        out["sustained_load_ratio_vs_slora"] = ratio(held[CHAMELEON][0], held[SLORA][0])
        out["p99_ttft_ratio_vs_slora"] = ratio(p99[CHAMELEON][at], p99[SLORA][at])
        out["slora_ratio_load_rps"] = loads[at]
    if {SLORA_SYNC, CHAMELEON} <= has:
        at = within(SLORA_SYNC)
        out["sustained_load_ratio_vs_slora_sync"] = ratio(held[CHAMELEON][0], held[SLORA_SYNC][0])
        out["p99_ttft_ratio_vs_slora_sync"] = ratio(p99[CHAMELEON][at], p99[SLORA_SYNC][at])
    if {FCFS, CHAMELEON} <= has:
        out["sustained_load_ratio_vs_fcfs"] = ratio(held[CHAMELEON][0], held[FCFS][0])
        if overload_idx is not None:
            i = overload_idx
            out["p99_ttft_ratio_vs_fcfs_overload"] = ratio(p99[CHAMELEON][i], p99[FCFS][i])
            out["overload_load_rps"] = loads[i]
    return out


def p99_of(rows: list[dict]) -> list[float]:
    """The P99 TTFTs (ms) of summaries; None (a tail some request never left) is infinite."""
    return [math.inf if r["ttft_p99_ms"] is None else r["ttft_p99_ms"] for r in rows]


def parse_configs(text: str, table: dict[str, Comparison] = CONFIGS) -> list[str]:
    """`--configs`: names of `table`, comma-separated; ValueError naming the choices."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in table]
    if unknown or not names:
        raise ValueError(f"unknown configurations {unknown}; choose from {sorted(table)}")
    return names


def sweep_fractions(text: str) -> tuple[list[float], int]:
    """`--loads` as sorted fractions of the baseline's capacity, OVERLOAD among them; returns
    them and OVERLOAD's index."""
    fractions = sorted({float(x) for x in text.split(",")} | {OVERLOAD})
    return fractions, fractions.index(OVERLOAD)
