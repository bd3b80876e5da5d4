"""The queue policies (`--queue-policy`) on a simulated engine: the same trace as bench_queueing,
the real FcfsQueue and ChameleonQueue code, and the engine's step times from a linear model
measured on SmolLM2 (no model runs). Seconds per sweep instead of the real benchmark's ~40
minutes, so that a policy can be tried over many more requests than a real run affords; a
figure from here is labelled "simulated" and a real run (bench_queueing) is what counts.

The simulated engine does what server.engine does each iteration: the policy admits through a
gate (batch rows, KV slots reserved for prompt + max_new_tokens, the prefill token budget); an
iteration that admits runs a prefill step of the admitted prompts only, else a decode step of
the running batch. Step times (ms): prefill `a + b * prompt tokens`, decode `c + d * batch`.

    python -m bench.queueing_sim --loads 0.5,0.75,1.0,1.25 --duration 600
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.bench_queueing import RANKS, sustained
from bench.envelope import write_result
from toppings.scripts.loadgen_stats import percentile
from toppings.scripts.workload import LengthSpec, WorkloadSpec, build_trace
from toppings.server.chameleon_queue import ChameleonQueue
from toppings.server.config import EngineConfig
from toppings.server.queueing import FcfsQueue, Verdict
from toppings.server.request import SamplingParams

log = logging.getLogger("queueing_sim")


class FirstFit(FcfsQueue):
    """Reference order, not a shipped policy: arrival order, every request that fits starts
    (no request blocks the ones behind it, and nothing bounds how long a large one waits)."""

    name = "first-fit"

    def select(self, gate, running, now):
        admitted = []
        for seq in list(self._waiting):
            verdict = gate.try_admit(seq)
            if verdict is Verdict.BATCH_FULL:
                break
            if verdict is Verdict.ADMITTED:
                self._waiting.remove(seq)
                admitted.append(seq)
        return admitted


POLICIES = {"fcfs": FcfsQueue, "chameleon": ChameleonQueue, "first-fit": FirstFit}


@dataclass
class StepModel:
    """Engine step times in ms; defaults: SmolLM2 float32 on this 2-core Intel Xeon (11-25)."""

    prefill_ms: float = 60.0
    prefill_ms_per_token: float = 0.2
    decode_ms: float = 50.0
    decode_ms_per_request: float = 1.8

    def prefill_s(self, tokens: int) -> float:
        return (self.prefill_ms + self.prefill_ms_per_token * tokens) / 1000

    def decode_s(self, batch: int) -> float:
        return (self.decode_ms + self.decode_ms_per_request * batch) / 1000


@dataclass
class _Request:
    adapter: str
    params: SamplingParams


@dataclass(eq=False)
class SimSeq:
    """What a queue policy reads of a server.sequence.Sequence."""

    prompt_len: int
    max_new: int
    arrival: float
    adapter: str
    output_ids: list[int] = field(default_factory=list)
    first_token_s: float | None = None
    cache_entry: object = None

    def __post_init__(self):
        self.request = _Request(self.adapter, SamplingParams(self.max_new, temperature=0.0))
        self.kv_need = self.prompt_len + self.max_new

    def restart(self) -> None:
        self.output_ids = []


class SimGate:
    """Admission of one simulated engine: batch rows, the prefill token budget, and one memory
    of `memory` KV slots for KV (prompt + max_new_tokens per request) and adapters (each
    `slots_per_rank * rank` slots while cached; idle ones are evicted, least recently used
    first, when a request needs the room)."""

    def __init__(self, memory: int, rows: int, max_prefill: int, ranks: dict[str, int],
                 slots_per_rank: int = 0):  # fmt: skip
        self.memory, self.rows, self.max_prefill, self.ranks = memory, rows, max_prefill, ranks
        self.slots = {a: slots_per_rank * r for a, r in ranks.items()}
        self.running: list[SimSeq] = []
        self.reserved = 0  # KV slots of the running requests
        self.refs: dict[str, int] = {}  # cached adapter -> running requests using it
        self.admitted: list[SimSeq] = []
        self.prefill_tokens = 0

    def new_iteration(self) -> None:
        self.admitted, self.prefill_tokens = [], 0

    def _pinned(self) -> int:
        return sum(self.slots[a] for a, n in self.refs.items() if n)

    def _evict_for(self, need: int) -> None:
        idle = [a for a, n in self.refs.items() if not n]  # insertion order: least recent first
        while idle and self.memory - self.reserved - self._cached() < need:
            del self.refs[idle.pop(0)]

    def _cached(self) -> int:
        return sum(self.slots[a] for a in self.refs)

    def try_admit(self, seq: SimSeq) -> Verdict:
        if len(self.running) >= self.rows:
            return Verdict.BATCH_FULL
        over_budget = self.admitted and self.prefill_tokens + seq.prompt_len > self.max_prefill
        need = self.need_tokens(seq)
        if need > self.free_tokens() or over_budget:
            return Verdict.NO_ROOM
        self._evict_for(need)
        a = seq.adapter
        self.refs[a] = self.refs.pop(a, 0) + 1  # most recently used last
        self.reserved += seq.kv_need
        self.running.append(seq)
        self.admitted.append(seq)
        self.prefill_tokens += seq.prompt_len
        return Verdict.ADMITTED

    def release(self, seq: SimSeq) -> None:
        self.running.remove(seq)
        self.reserved -= seq.kv_need
        self.refs[seq.adapter] -= 1

    def squash(self, seq: SimSeq) -> None:
        self.release(seq)
        seq.restart()

    def fits_if_released(self, waiting, running) -> bool:
        return False  # admission counts adapter memory as KV room: no NO_ADAPTER_MEMORY here

    def adapter_tokens(self, adapter) -> int:
        return self.slots[adapter]

    def adapter_size(self, adapter) -> float:
        return float(self.ranks[adapter])

    def max_adapter_size(self) -> float:
        return float(max(self.ranks.values()))

    def total_tokens(self) -> int:
        return self.memory

    def prefetch(self, adapters) -> None:
        pass

    def free_tokens(self) -> int:
        return self.memory - self.reserved - self._pinned()

    def free_rows(self) -> int:
        return self.rows - len(self.running)

    def need_tokens(self, seq: SimSeq) -> int:
        return seq.kv_need + (0 if self.refs.get(seq.adapter) else self.slots[seq.adapter])

    def release_tokens(self, seq: SimSeq) -> int:
        last = self.refs.get(seq.adapter) == 1
        return seq.kv_need + (self.slots[seq.adapter] if last else 0)


def simulate(policy_name: str, trace, ranks, args, steps: StepModel, slo_ms: float) -> list:
    """Replay `trace` on one simulated engine; returns (TTFT s, size, rank) per request."""
    config = EngineConfig(max_total_tokens=args.max_total_tokens, ttft_slo_ms=slo_ms)
    policy = POLICIES[policy_name](config)
    gate = SimGate(
        args.memory_tokens or args.max_total_tokens,
        args.max_batch_size,
        args.max_prefill_tokens,
        ranks,
        args.slots_per_rank,
    )
    seqs = [SimSeq(len(e.prompt), e.max_tokens, e.arrival_s, e.model) for e in trace]
    now, nxt, done = 0.0, 0, 0
    while done < len(seqs):
        while nxt < len(seqs) and seqs[nxt].arrival <= now:
            policy.push(seqs[nxt], seqs[nxt].arrival)
            nxt += 1
        gate.new_iteration()
        admitted = policy.select(gate, list(gate.running), now)
        if admitted:
            now += steps.prefill_s(sum(s.prompt_len for s in admitted))
            stepped = admitted
        elif gate.running:
            stepped = list(gate.running)
            now += steps.decode_s(len(stepped))
        else:
            now = max(now, seqs[nxt].arrival)
            continue
        for s in stepped:
            s.output_ids.append(0)
            if s.first_token_s is None:
                s.first_token_s = now
            if len(s.output_ids) >= s.max_new:
                gate.release(s)
                policy.finished(s, True, now)
                done += 1
    return [(s.first_token_s - s.arrival, s.kv_need, ranks[s.adapter]) for s in seqs]


def summarise(records: list, slo_ms: float) -> dict:
    ttft = [1000 * t for t, _, _ in records]
    return {
        "num_requests": len(ttft),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "ttft_p999_ms": percentile(ttft, 99.9),
        "ttft_max_ms": max(ttft),
        "ttft_mean_ms": statistics.fmean(ttft),
        "slo_attainment": sum(t <= slo_ms for t in ttft) / len(ttft),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loads", default="2.0,2.25,2.5,2.75,3.0", help="request rates, req/s")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals a round")
    p.add_argument("--rounds", type=int, default=3, help="traces per load (seeds)")
    p.add_argument("--slo-ms", type=float, default=6100.0, help="bench_queueing's: 5x E2E alone")
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--output-len", default="lognormal:40:1.0")
    p.add_argument("--max-output-len", type=int, default=256)
    p.add_argument("--max-total-tokens", type=int, default=2048)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--memory-tokens", type=int, default=0, help="KV + adapters (0: KV only)")
    p.add_argument(
        "--slots-per-rank",
        type=int,
        default=0,
        help="an adapter's memory in KV slots per rank (SmolLM2 q,k,v float32: 7)",
    )
    p.add_argument("--max-prefill-tokens", type=int, default=8192)
    p.add_argument("--steps", default="{}", help="StepModel fields as JSON")
    p.add_argument(
        "--steps-source",
        default="measured: SmolLM2 float32, this repo's engine, "
        "2-core Intel Xeon (AMX), 2026-11-25: decode 52/59/72/87/109 ms at batch "
        "1/4/8/16/32, prefill 0.075 s for 64 tokens, 0.477 s for 2048",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/queueing_sim.json"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    steps = StepModel(**json.loads(args.steps))
    ranks = {f"r{r}-{i}": r for r in RANKS for i in range(4)}
    loads = [float(x) for x in args.loads.split(",")]
    table: dict[str, list[dict]] = {pol: [] for pol in POLICIES}
    for rps in loads:
        for pol in POLICIES:
            records = []
            for rnd in range(args.rounds):
                spec = WorkloadSpec(
                    rps=rps, duration_s=args.duration, popularity="zipf",
                    rank_mix=tuple((r, 1.0) for r in RANKS),
                    prompt_len=LengthSpec.parse("lmsys", args.max_prompt_len, "prompt"),
                    output_len=LengthSpec.parse(args.output_len, args.max_output_len, "output"),
                    seed=rnd * 100 + int(rps * 1000),
                )  # fmt: skip
                records += simulate(pol, build_trace(spec, ranks), ranks, args, steps, args.slo_ms)
            row = summarise(records, args.slo_ms)
            table[pol].append(row)
            log.warning("%5.2f req/s %-10s P50 %6.0f  P99 %6.0f  P99.9 %6.0f  max %6.0f ms  "
                        "attainment %.3f", rps, pol, row["ttft_p50_ms"], row["ttft_p99_ms"],
                        row["ttft_p999_ms"], row["ttft_max_ms"], row["slo_attainment"])  # fmt: skip
    write(args, argv, steps, loads, table)


def write(args, argv, steps: StepModel, loads: list[float], table: dict) -> None:
    p99 = {pol: [r["ttft_p99_ms"] for r in rows] for pol, rows in table.items()}
    held = {pol: sustained(loads, p99[pol], args.slo_ms) for pol in table}
    within = [i for i, v in enumerate(p99["fcfs"]) if v <= args.slo_ms]
    at = within[-1] if within else 0
    metrics = {
        "p99_ttft_ratio_vs_fcfs": {pol: p99[pol][at] / p99["fcfs"][at] for pol in table},
        "ratio_load_rps": loads[at],
        "sustained_rps": {pol: v for pol, (v, _) in held.items()},
        "sustained_is_lower_bound": {pol: b for pol, (_, b) in held.items()},
        "sustained_load_ratio_vs_fcfs": {
            pol: v / held["fcfs"][0] if held["fcfs"][0] else None for pol, (v, _) in held.items()
        },
        "loads_rps": loads,
        "per_load": table,
    }
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    config["step_model"] = asdict(steps)
    config["policies"] = {p: f"{c.__module__}.{c.__name__}" for p, c in POLICIES.items()}
    device = "simulated (no model runs)"
    write_result(args.out, "queueing_sim", "queueing_sim", device=device, argv=argv,
                 config=config, metrics=metrics)  # fmt: skip
    log.warning("%s", {k: v for k, v in metrics.items() if k not in ("per_load", "loads_rps")})


if __name__ == "__main__":
    main()
