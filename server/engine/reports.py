"""What an engine reports: its counters for /metrics, its state for /stats and the cluster
scheduler, and its registered adapters for /v1/models. Read from any thread, with no lock:
each reads snapshots of the engine thread's lists and tables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from toppings.gpu_lora.cache import EntryState
from toppings.server.adapters.manager import AdapterManager
from toppings.server.config import EngineConfig
from toppings.server.memory.kv_cache import KVPool
from toppings.server.memory.manager import MemoryManager
from toppings.server.process.thread_governor import ThreadGovernor
from toppings.server.requests.engine_counters import (
    AdapterCacheView,
    EngineCounters,
    MemoryView,
    QueueView,
)
from toppings.server.requests.stats_schema import (
    AdapterView,
    Residency,
    ServerStats,
    WorkerView,
)
from toppings.server.sched.scheduler import Scheduler
from toppings.server.sched.step_budget_keeper import StepBudgetKeeper


@dataclass
class StepStats:
    """Counts and wall time of engine steps (for benchmarks and metrics): a step that computes
    prompt tokens counts as a prefill step, one of decodes only as a decode step."""

    prefill_steps: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_s: float = 0.0

    def count(self, is_prefill: bool, seconds: float) -> None:
        if is_prefill:
            self.prefill_steps += 1
            self.prefill_s += seconds
        else:
            self.decode_steps += 1
            self.decode_s += seconds

    def reset(self) -> None:
        self.prefill_steps, self.prefill_s, self.decode_steps, self.decode_s = 0, 0.0, 0, 0.0


class Reported(Protocol):
    """What the reports read of an engine (server.engine.engine.Engine is one)."""

    config: EngineConfig
    model_name: str
    scheduler: Scheduler
    memory: MemoryManager
    lora: AdapterManager
    kv: KVPool
    budget: StepBudgetKeeper | None
    governor: ThreadGovernor | None
    step_stats: StepStats

    def is_healthy(self) -> bool: ...


def counters(engine: Reported) -> EngineCounters:
    """Monotonic counters and current gauges, for /metrics."""
    st, sched, memory = engine.step_stats, engine.scheduler, engine.memory
    lora, kv = engine.lora, engine.kv
    budget = engine.budget.budget if engine.budget is not None else None
    return EngineCounters(
        finished=dict(sched.finished),
        prefill_steps=st.prefill_steps,
        prefill_seconds=st.prefill_s,
        decode_steps=st.decode_steps,
        decode_seconds=st.decode_s,
        host_lora_calls=lora.host_stats.calls,
        host_lora_seconds=lora.host_stats.seconds,
        num_running=len(sched.running),
        num_waiting=len(sched.queue),
        queueing=QueueView.from_view(queue_view(sched)),
        kv_reserved_tokens=memory.reserved * kv.block_tokens,
        kv_used_tokens=kv.num_slots - kv.num_free_slots,
        max_total_tokens=kv.num_slots,
        memory=MemoryView.from_view(memory.view()),
        adapter_cache=AdapterCacheView.from_snapshot(lora.cache.snapshot()),
        adapter_references=lora.references(),
        host_served=lora.num_host_served,
        host_promoted=lora.num_promoted,
        num_host_served=lora.num_on_host,
        step_budget_tokens=budget and budget.tokens,
        engine_threads=engine.governor and engine.governor.threads,
        thread_switches=engine.governor.switches if engine.governor is not None else 0,
        **_worker_counts(lora.host.worker_stats()),
    )


def _worker_counts(workers: list[dict]) -> dict[str, int | None]:
    """The CPU workers' series of /metrics (None without a pool)."""
    if not workers:
        return {"cpu_workers_alive": None, "cpu_worker_restarts": None}
    return {"cpu_workers_alive": sum(bool(w["alive"]) for w in workers),
            "cpu_worker_restarts": sum(int(w["restarts"]) for w in workers)}  # fmt: skip


def adapter_list(engine: Reported) -> list[dict]:
    """The registered adapters: name, rank, path and target modules of each."""
    return [
        {"name": a.name, "rank": a.rank, "path": a.path, "target_modules": list(a.target_modules)}
        for a in engine.lora.host.registered()
    ]


def stats(engine: Reported, adapters_since: str | None = None) -> ServerStats:
    """What the cluster scheduler needs; cheap, no lock (snapshots of the lists).
    `adapters_since`: the `adapters_version` of an earlier /stats the caller holds; when the
    registered adapters are the same now, their list is left out (`adapters_unchanged`: with
    thousands of adapters it was most of the body of every poll)."""
    lora, sched, config = engine.lora, engine.scheduler, engine.config
    version = lora.host.version  # read before the list: a change meanwhile shows next time
    states = lora.cache.entry_states()  # one read of the cache entries, by weights id
    # Every name of rows several names share is resident with them.
    named = [(a.name, a, states.get(a.id)) for a in lora.host.registered()]
    resident = [n for n, _, s in named if s is not None and s.on_device]
    loading = [n for n, _, s in named if s is not None and not s.on_device]  # a failed load too
    unchanged = adapters_since == str(version)
    adapters = () if unchanged else tuple(
        adapter_view(n, a.rank, s, tuple(a.invocation_tokens)) for n, a, s in named
    )  # fmt: skip
    by_state = dict.fromkeys(Residency, 0)
    for _, _, s in named:
        by_state[residency(s)] += 1
    return ServerStats(
        model=engine.model_name,
        kernel=config.kernel,
        device=config.device,
        lora_mode=lora.mode_name,
        running=tuple(s.describe() for s in list(sched.running)),
        queue=tuple(s.describe() for s in sched.queue),
        adapters=adapters,
        adapters_version=version,
        adapters_unchanged=unchanged,
        free_kv_tokens=engine.memory.free_tokens(),
        max_total_tokens=engine.kv.num_slots,
        memory=engine.memory.view(),
        healthy=engine.is_healthy(),
        cpu_workers=tuple(WorkerView(**w) for w in lora.host.worker_stats()),
        resident_adapters=tuple(resident),
        loading_adapters=tuple(loading),
        queueing=queue_view(sched),
        adapter_host_memory=lora.host.memory.view(),
        num_device_adapters=by_state[Residency.DEVICE],
        num_loading_adapters=by_state[Residency.LOADING],
        num_host_adapters=by_state[Residency.HOST],
        max_device_adapters=lora.max_device_adapters(),
        adapter_load_seconds=lora.loader.load_times.view().to_json(),
        kv_events=kv_events_view(engine),
    )


def queue_view(sched: Scheduler) -> dict:
    """The queue policy's view, and what admission reserves and takes back (--kv-admission)."""
    admission = "expected" if sched.limits.expected_kv else "worst-case"
    return {**sched.queue.view(), "kv_admission": admission, "preemptions": sched.preemptions}


def kv_events_view(engine: Reported) -> dict:
    """Where the server's KV cache events are published and how far the stream got
    (stats_schema KV_EVENTS); {} when they are off."""
    publisher, config = engine.memory.kv_events, engine.config
    if publisher is None:
        return {}
    return {
        "endpoint": config.kv_events_endpoint,
        "replay_endpoint": config.kv_events_replay_endpoint,
        "topic": config.kv_events_topic,
        "encoding": config.kv_events_encoding,
        "block_size": engine.kv.block_tokens,
        **publisher.describe(),
    }


def adapter_view(
    name: str, rank: int, state: EntryState | None, invocation: tuple[int, ...] = ()
) -> AdapterView:
    """One registered adapter's residency, from its cache entry (None: host memory only), and
    an activated LoRA's invocation sequence."""
    if state is None:
        return AdapterView(name, rank, False, invocation_tokens=invocation)
    return AdapterView(name, rank, state.on_device, residency(state), state.pinned, invocation)


def residency(state: EntryState | None) -> Residency:
    """Where an adapter's rows are, from its cache entry (None: host memory only)."""
    if state is None:
        return Residency.HOST
    if state.loading:
        return Residency.LOADING
    return Residency.DEVICE if state.on_device else Residency.HOST
