"""A simulated serving engine for the queue policies (bench/queueing_sim.py): requests, the
admission gate of server.queueing's protocol, and the engine loop with step times from a linear
model fitted on the real engine (`measure_steps`)."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from toppings.server.config import EngineConfig
from toppings.server.requests.request import SamplingParams
from toppings.server.sched.queueing import Verdict


@dataclass
class StepModel:
    """Engine step times in ms; defaults: `measure_steps("float32")` of SmolLM2 on a 2-core
    Intel Xeon VM (AMX), 2026-11-25."""

    prefill_ms: float = 19.7
    prefill_ms_per_token: float = 1.09
    decode_ms: float = 64.6
    decode_ms_per_request: float = 2.09

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


def measure_steps(dtype: str, batches=(1, 4, 8, 16, 32), prompt_len: int = 64) -> tuple:
    """Fit the StepModel on the real engine: SmolLM2 with bench_queueing's adapters, `B`
    requests of `prompt_len` tokens submitted together (one prefill step) then decoded together.
    Returns the model and the measured points {B: (prefill ms, decode ms per step)}."""
    from bench.bench_queueing import make_adapters
    from toppings.server.model.loader import resolve_model_dir
    from toppings.server.requests.request import GenerationRequest
    from toppings.server.runtime import build_engine

    model_dir = resolve_model_dir("smollm2")
    adapters = make_adapters(Path("/tmp/toppings-queueing-adapters"), model_dir, 4)
    names = sorted(adapters)
    config = EngineConfig(dtype=dtype, max_total_tokens=8192, max_batch_size=max(batches))
    engine = build_engine(str(model_dir), config, adapters)
    points = {}
    rng = random.Random(0)  # prompts never seen before: no prefix-cache hit shortens a prefill
    try:
        for b in [batches[0], *batches]:  # the first pass warms up
            params = SamplingParams(max_new_tokens=33, temperature=0.0, ignore_eos=True)
            prompts = [[rng.randrange(100, 30000) for _ in range(prompt_len)] for _ in range(b)]
            reqs = [GenerationRequest(prompt, params, names[(7 * i) % len(names)])
                    for i, prompt in enumerate(prompts)]  # fmt: skip
            st = engine.step_stats
            before = (st.prefill_s, st.prefill_steps, st.decode_s, st.decode_steps)
            for handle in engine.submit_all(reqs):
                handle.result(timeout_s=600)
            prefill = (st.prefill_s - before[0]) / max(st.prefill_steps - before[1], 1)
            decode = (st.decode_s - before[2]) / max(st.decode_steps - before[3], 1)
            points[b] = (1000 * prefill, 1000 * decode)
    finally:
        engine.shutdown()
    pre = statistics.linear_regression(
        [b * prompt_len for b in points], [p for p, _ in points.values()]
    )
    dec = statistics.linear_regression(list(points), [d for _, d in points.values()])
    model = StepModel(pre.intercept, pre.slope, dec.intercept, dec.slope)
    return model, points


def simulate(policy, gate: SimGate, trace, steps: StepModel) -> list[tuple[float, int, int]]:
    """Replay `trace` through `policy` on a simulated engine with `gate`'s memory; returns
    (TTFT s, prompt + max tokens, rank) per request."""
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
    return [(s.first_token_s - s.arrival, s.kv_need, gate.ranks[s.adapter]) for s in seqs]
