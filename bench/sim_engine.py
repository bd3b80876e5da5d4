"""A simulated serving engine for the queue policies (bench/queueing_sim.py): the real
`Scheduler` (queue policy, admission gate, finishing) over pure-Python stand-ins for the memory
and the adapters, with step times from a linear model fitted on the real engine
(`measure_steps`) in place of the model runner."""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.sim_adapters import SimAdapterCache, SimAdapters, SimEntry, SimLink
from toppings.gpu_lora.eviction import make_policy
from toppings.server.config import EngineConfig
from toppings.server.requests.request import SamplingParams
from toppings.server.sched.gate_limits import GateLimits
from toppings.server.sched.plan import StepResult
from toppings.server.sched.queueing import QueuePolicy
from toppings.server.sched.scheduler import Scheduler
from toppings.server.sched.step_budget import StepBudget, StepTimeModel
from toppings.server.sched.step_refit import shape_of


@dataclass(frozen=True)
class StepModel(StepTimeModel):
    """Engine step times in ms: the engine's own step-time model (server/sched/step_budget.py:
    a decode step of B requests, each prompt token beside it), with the intercept of a step that
    only prefills. Defaults: `measure_steps("float32")` of SmolLM2 on a 2-core Intel Xeon VM
    (AMX), 2026-11-25."""

    prefill_ms: float = 19.7
    source: str = "measure_steps('float32') of SmolLM2, 2-core Intel Xeon VM (AMX), 2026-11-25"

    @classmethod
    def of_engine(cls, model: StepTimeModel, source: str) -> StepModel:
        """The engine's model as the simulator's: a step of prompt tokens alone costs what a
        step with prompt tokens and no decodes costs in it."""
        fields = {**asdict(model), "source": source}
        return cls(**fields, prefill_ms=model.decode_ms + model.mixed_fixed_ms)

    def prefill_s(self, tokens: int) -> float:
        """A step of `tokens` prompt tokens and no decode."""
        return (self.prefill_ms + self.ms_per_token * tokens) / 1000

    def decode_s(self, batch: int) -> float:
        return self.decode_step_ms(batch) / 1000

    def mixed_s(self, num_decodes: int, prompt_tokens: int) -> float:
        """A chunked-prefill step: the decode step of its decodes plus each prompt token beside
        them, as the step budget is sized (StepTimeModel); without decodes, a prefill step."""
        if not num_decodes:
            return self.prefill_s(prompt_tokens)
        return self.mixed_step_ms(num_decodes, prompt_tokens) / 1000


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
    finish_s: float | None = None
    kv_hold: _Hold | None = None
    cache_entry: str | SimEntry | None = None
    finished: bool = False
    num_prefilled: int = 0

    prefill_len: int = 0  # the prompt's, and the outputs' after a resume (Sequence.resume)

    @property
    def is_prefilled(self) -> bool:
        return self.num_prefilled >= self.prefill_len

    scores_prompt = False  # simulated requests ask no prompt logprobs

    def __post_init__(self):
        params = SamplingParams(self.max_new, temperature=0.0)
        self.request = _Request(str(id(self)), self.adapter, params)
        self.kv_need = self.prompt_len + self.max_new
        self.prefill_len = self.prompt_len

    def append(self, token: int, eos_ids: set[int], max_model_len: int, logprob=None) -> str | None:
        self.output_ids.append(token)
        return "length" if len(self.output_ids) >= self.max_new else None

    def finish(self, reason: str, error: str | None = None) -> None:
        self.finished = True

    def resume(self) -> None:
        self.prefill_len = self.prompt_len + len(self.output_ids)
        self.num_prefilled = 0


@dataclass(frozen=True)
class SimCache:
    """On-demand adapters in a static memory layout (bench/sim_adapters.py SimAdapterCache):
    `budget_bytes` of adapters beside the KV, `bytes_per_rank` bytes an adapter takes per rank,
    `slot_bytes` one KV slot's bytes (for the queue policy's adapter sizes in tokens), the link
    (Gbit/s, seconds of latency per load), the eviction policy's name, whether idle adapters
    stay (False: `--adapter-cache off`), and whether a step waits for its requests' loads
    (`--lora-mode on-demand-sync`; else a request waits for its own, the others go on)."""

    budget_bytes: int
    bytes_per_rank: int
    slot_bytes: int
    link_gbps: float
    link_latency_s: float = 0.0
    eviction: str = "lru"
    keep_idle: bool = True
    stall_for_load: bool = False


@dataclass(frozen=True)
class SimLimits:
    """One simulated engine: `memory` KV slots shared by KV (prompt + max_new_tokens per
    request) and, with `slots_per_rank`, the adapters in use (`slots_per_rank * rank` slots
    each); batch rows; the prefill token budget; each adapter's rank; with `budget`, chunked
    prefill's steps as the engine sizes them (None: whole-prompt prefill steps); with `cache`,
    adapters loaded on demand into their own budget (then `slots_per_rank` is not used)."""

    memory: int
    rows: int
    max_prefill: int
    ranks: dict[str, int]
    slots_per_rank: int = 0
    budget: StepBudget | None = None
    cache: SimCache | None = None


@dataclass
class _Hold:
    reserved: int  # KV slots promised to the request


class _KV:
    """A KV pool of one-token blocks of one byte (so bytes, blocks and slots are one unit)."""

    block_tokens = 1
    block_bytes = 1

    def __init__(self, num_slots: int):
        self.num_blocks = self.num_slots = num_slots


class SimMemory:
    """KV reservations and the adapters in use, in one budget of slots; no prefix cache."""

    def __init__(self, num_slots: int, adapters: SimAdapters | SimAdapterCache, shared: bool):
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

    def allocate(self, seqs: list[SimSeq], tokens: list[int]) -> list[int]:
        """Slots are promised at admission (a request's whole `kv_need`): always there."""
        return [s.num_prefilled if not s.is_prefilled else s.prompt_len + len(s.output_ids) - 1
                for s in seqs]  # fmt: skip

    def tick(self, now: float) -> None:
        pass

    def after_prefill(self, seqs: list, seconds: float, num_tokens: int, now: float) -> None:
        pass

    def after_decode(self, batch_size: int, now: float) -> None:
        pass


class SimStaticMemory(SimMemory):
    """KV slots plus a separate adapter budget (the static layout with --adapter-cache-bytes):
    adapters are never charged to the KV, but the queue policy sees their size in KV tokens and
    all memory as the KV plus the adapter budget (server/memory/layout.py StaticLayout)."""

    def __init__(self, num_slots: int, adapters: SimAdapterCache, cache: SimCache):
        super().__init__(num_slots, adapters, shared=False)
        self.cache = cache

    def adapter_tokens(self, num_bytes: int) -> int:
        return -(-num_bytes // self.cache.slot_bytes)

    def total_tokens(self) -> int:
        return self.kv.num_slots + self.cache.budget_bytes // self.cache.slot_bytes


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
    # whole-prompt steps: a chunked engine would split the B prompts into budget-sized steps
    config = EngineConfig(dtype=dtype, max_total_tokens=8192, max_batch_size=max(batches),
                          chunked_prefill=False)  # fmt: skip
    engine = build_engine(str(model_dir), config, adapters)
    points = {}
    rng = random.Random(0)  # prompts never seen before: no prefix-cache hit shortens a prefill
    try:
        for b in [batches[0], *batches]:  # the first pass warms up
            params = SamplingParams(max_new_tokens=33, temperature=0.0, ignore_eos=True)
            prompts = [[rng.randrange(100, 30000) for _ in range(prompt_len)] for _ in range(b)]
            refs = [engine.resolve_adapter(names[(7 * i) % len(names)]) for i in range(b)]
            reqs = [GenerationRequest(p, params, r) for p, r in zip(prompts, refs)]
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
    model = StepModel(
        ms_per_token=pre.slope,
        decode_ms=dec.intercept,
        decode_ms_per_request=dec.slope,
        prefill_ms=pre.intercept,
        source=f"measure_steps({dtype!r}) of SmolLM2 on this machine",
    )
    return model, points


class Stalled(RuntimeError):
    """Requests wait and nothing can run, with no arrival or load to come: the real engine, on
    the same code, would wait for ever. `seqs`: every request (the unserved without
    first_token_s), `now`: when it stalled."""

    def __init__(self, seqs: list[SimSeq], now: float):
        unserved = sum(s.first_token_s is None for s in seqs)
        super().__init__(f"stalled at {now:.1f} s: {unserved} requests never served")
        self.seqs, self.now = seqs, now


def simulate(
    policy: QueuePolicy, limits: SimLimits, trace, steps: StepModel
) -> list[tuple[float, int, int]]:
    """Replay `trace` through `policy` on a simulated engine of `limits`; returns (TTFT s,
    prompt + max tokens, rank) per request."""
    seqs = run(policy, limits, trace, steps)
    return [(s.first_token_s - s.arrival, s.kv_need, limits.ranks[s.adapter]) for s in seqs]


def run(policy: QueuePolicy, limits: SimLimits, trace, steps: StepModel) -> list[SimSeq]:
    """Replay `trace` (entries with .prompt, .max_tokens, .arrival_s, .model) through `policy`
    on a simulated engine of `limits`; returns each request, its first token's and its end's
    times set (`first_token_s`, `finish_s`: seconds since the start). Raises Stalled."""
    clock = _Clock()
    if limits.cache is None:
        adapters = SimAdapters(limits.ranks, limits.slots_per_rank)
        memory = SimMemory(limits.memory, adapters, shared=limits.slots_per_rank > 0)
    else:
        c = limits.cache
        link = SimLink(c.link_gbps, c.link_latency_s)
        adapters = SimAdapterCache(limits.ranks, c.bytes_per_rank, c.budget_bytes, link,
                                   make_policy(c.eviction), c.keep_idle, clock,
                                   c.stall_for_load)  # fmt: skip
        memory = SimStaticMemory(limits.memory, adapters, c)
    gate_limits = GateLimits(limits.rows, limits.max_prefill).with_budget(limits.budget)
    sched = Scheduler(policy, memory, adapters, gate_limits, set(), 1 << 62, clock)
    seqs = [SimSeq(len(e.prompt), e.max_tokens, e.arrival_s, e.model) for e in trace]
    nxt = 0
    while nxt < len(seqs) or sched.has_work():
        while nxt < len(seqs) and seqs[nxt].arrival <= clock.now:
            sched.queue.push(seqs[nxt], seqs[nxt].arrival)
            nxt += 1
        plan = sched.schedule()
        if plan is None:  # nothing runs until the next arrival or the next load lands
            events = [t for t in (adapters.next_ready_s(),) if t is not None]
            events += [seqs[nxt].arrival] if nxt < len(seqs) else []
            if not events:
                raise Stalled(seqs, clock.now)
            clock.now = max(clock.now, min(events))
            continue
        if limits.cache is not None and limits.cache.stall_for_load:
            clock.now = max(clock.now, adapters.ready_s([s.cache_entry for s in plan.seqs]))
        clock.now += step_s(plan, steps, limits.budget is not None)
        sched.update(plan, StepResult([0] * len(plan.sampled)))
        for s in plan.sampled:
            if s.first_token_s is None:
                s.first_token_s = clock.now
        for s in plan.seqs:
            if s.finished and s.finish_s is None:
                s.finish_s = clock.now
    return seqs


def step_s(plan, steps: StepModel, chunked: bool = True) -> float:
    """The seconds a step of `plan` (server/sched/scheduler.py StepPlan) takes: a step of d
    decodes and c prompt tokens (chunks, or whole prompts beside the decodes' one token each)
    and the past those attend to, or a decode step; `chunked`: False (chunked prefill off) times
    a step of whole prompts alone as a prefill of their tokens."""
    if not plan.is_prefill:
        return steps.decode_s(len(plan.seqs))
    shape = shape_of(plan)
    if not chunked and not shape.num_decodes:
        return steps.prefill_s(shape.prompt_tokens)
    past_s = steps.ms_per_token_past * shape.past_work / 1000
    return steps.mixed_s(shape.num_decodes, shape.prompt_tokens) + past_s
