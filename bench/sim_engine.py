"""A simulated serving engine for the queue policies (bench/queueing_sim.py): the real
`Scheduler` (queue policy, admission gate, finishing) over pure-Python stand-ins for the memory
and the adapters, with step times from a linear model fitted on the real engine
(`measure_steps`) in place of the model runner."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from toppings.server.config import EngineConfig
from toppings.server.requests.request import SamplingParams
from toppings.server.sched.admission import GateLimits
from toppings.server.sched.queueing import QueuePolicy
from toppings.server.sched.scheduler import Scheduler, StepResult


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

    def mixed_s(self, num_decodes: int, prompt_tokens: int) -> float:
        """A chunked-prefill step: its decodes' step (or a prefill's overhead without any)
        plus the prompt tokens beside them."""
        if not num_decodes:
            return self.prefill_s(prompt_tokens)
        return self.decode_s(num_decodes) + self.prefill_ms_per_token * prompt_tokens / 1000


@dataclass
class _Request:
    request_id: str
    adapter: str
    params: SamplingParams


@dataclass(eq=False)
class SimSeq:
    """What the scheduler and a queue policy use of a server.requests.sequence.Sequence."""

    prompt_len: int
    max_new: int
    arrival: float
    adapter: str
    output_ids: list[int] = field(default_factory=list)
    first_token_s: float | None = None
    kv_hold: _Hold | None = None
    cache_entry: str | None = None
    finished: bool = False
    num_prefilled: int = 0

    @property
    def is_prefilled(self) -> bool:
        return self.num_prefilled >= self.prompt_len

    def __post_init__(self):
        params = SamplingParams(self.max_new, temperature=0.0)
        self.request = _Request(str(id(self)), self.adapter, params)
        self.kv_need = self.prompt_len + self.max_new

    def append(self, token: int, eos_ids: set[int], max_model_len: int) -> str | None:
        self.output_ids.append(token)
        return "length" if len(self.output_ids) >= self.max_new else None

    def finish(self, reason: str, error: str | None = None) -> None:
        self.finished = True

    def restart(self) -> None:
        self.output_ids = []
        self.num_prefilled = 0


@dataclass(frozen=True)
class SimLimits:
    """One simulated engine: `memory` KV slots shared by KV (prompt + max_new_tokens per
    request) and, with `slots_per_rank`, the adapters in use (`slots_per_rank * rank` slots
    each); batch rows; the prefill token budget; each adapter's rank; with max_step_tokens,
    chunked prefill's step budget (None: whole-prompt prefill steps)."""

    memory: int
    rows: int
    max_prefill: int
    ranks: dict[str, int]
    slots_per_rank: int = 0
    max_step_tokens: int | None = None


@dataclass
class _Hold:
    reserved: int  # KV slots promised to the request


class _KV:
    """A KV pool of one-token blocks of one byte (so bytes, blocks and slots are one unit)."""

    block_tokens = 1
    block_bytes = 1

    def __init__(self, num_slots: int):
        self.num_blocks = self.num_slots = num_slots


class SimAdapters:
    """Every adapter fits: an acquired adapter is charged its slots while it has a reference
    (`SimMemory`); idle ones cost nothing (they are evicted when the room is needed)."""

    def __init__(self, ranks: dict[str, int], slots_per_rank: int):
        self.registry = ranks
        self.refs: dict[str, int] = {}
        # Bytes are memory slots when adapters are charged; else a size proportional to the rank
        # (the queue policy's size of a request) that is never charged.
        self._per_rank = max(slots_per_rank, 1)

    def acquire(self, name: str, queued: frozenset[str]) -> str:
        self.refs[name] = self.refs.get(name, 0) + 1
        return name

    def release(self, name: str) -> None:
        self.refs[name] -= 1

    def may_start(self, entry: str | None) -> bool:
        return True

    def bytes_of(self, name: str | None) -> int:
        return 0 if name is None else self.registry[name] * self._per_rank

    def prefetch(self, names: list[str], queued: frozenset[str]) -> None:
        pass

    def fits_if_released(self, name: str | None, held: str | None) -> bool:
        return False  # an adapter always finds memory: no NO_ADAPTER_MEMORY here


class SimMemory:
    """KV reservations and the adapters in use, in one budget of slots; no prefix cache."""

    def __init__(self, num_slots: int, adapters: SimAdapters, shared: bool):
        self.kv = _KV(num_slots)
        self.shared = shared
        self.adapters = adapters
        self.reserved = 0

    def match(self, seq: SimSeq) -> list:
        return []

    def kv_need(self, seq: SimSeq, path: list) -> int:
        return seq.kv_need

    def adapter_need(self, name: str | None, num_bytes: int) -> int:
        if not self.shared or name is None or self.adapters.refs.get(name):
            return 0
        return num_bytes

    def fits(self, extra_blocks: int) -> bool:
        return self.committed() + extra_blocks <= self.kv.num_blocks

    def committed(self) -> int:
        if not self.shared:
            return self.reserved
        refs = self.adapters.refs
        return self.reserved + sum(self.adapters.bytes_of(a) for a, n in refs.items() if n)

    def adapter_tokens(self, num_bytes: int) -> int:
        return num_bytes if self.shared else 0

    def total_tokens(self) -> int:
        return self.kv.num_slots

    def free_tokens(self) -> int:
        return self.kv.num_blocks - self.committed()

    def admit(self, seq: SimSeq, path: list, now: float) -> _Hold:
        self.reserved += seq.kv_need
        return _Hold(seq.kv_need)

    def release(self, seq: SimSeq, keep_kv: bool, now: float) -> None:
        self.reserved -= seq.kv_hold.reserved
        seq.kv_hold = None

    def tick(self, now: float) -> None:
        pass

    def after_prefill(self, seqs: list, seconds: float, num_tokens: int, now: float) -> None:
        pass

    def after_decode(self, batch_size: int, now: float) -> None:
        pass


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


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


def simulate(
    policy: QueuePolicy, limits: SimLimits, trace, steps: StepModel
) -> list[tuple[float, int, int]]:
    """Replay `trace` through `policy` on a simulated engine of `limits`; returns (TTFT s,
    prompt + max tokens, rank) per request."""
    adapters = SimAdapters(limits.ranks, limits.slots_per_rank)
    memory = SimMemory(limits.memory, adapters, shared=limits.slots_per_rank > 0)
    clock = _Clock()
    gate_limits = GateLimits(limits.rows, limits.max_prefill, limits.max_step_tokens)
    sched = Scheduler(policy, memory, adapters, gate_limits, set(), 1 << 62, clock)
    seqs = [SimSeq(len(e.prompt), e.max_tokens, e.arrival_s, e.model) for e in trace]
    nxt = 0
    while nxt < len(seqs) or sched.has_work():
        while nxt < len(seqs) and seqs[nxt].arrival <= clock.now:
            sched.queue.push(seqs[nxt], seqs[nxt].arrival)
            nxt += 1
        plan = sched.schedule()
        if plan is None:
            clock.now = max(clock.now, seqs[nxt].arrival)
            continue
        if plan.is_mixed:
            decodes = sum(1 for s in plan.seqs if s.is_prefilled)
            clock.now += steps.mixed_s(decodes, sum(plan.chunks) - decodes)
        elif plan.is_prefill:
            clock.now += steps.prefill_s(sum(s.prompt_len for s in plan.seqs))
        else:
            clock.now += steps.decode_s(len(plan.seqs))
        sched.update(plan, StepResult([0] * len(plan.sampled)))
        for s in plan.sampled:
            if s.first_token_s is None:
                s.first_token_s = clock.now
    return [(s.first_token_s - s.arrival, s.kv_need, limits.ranks[s.adapter]) for s in seqs]
