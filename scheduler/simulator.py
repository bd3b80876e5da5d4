"""Discrete-event simulation of a cluster of LoRA servers routed by a `Policy`.

Each simulated server runs the engine's continuous-batching loop: when requests wait and fit
(batch size, KV slots for prompt + output, prefill token budget), the next iteration prefills
them, FIFO, and they emit their first token; otherwise it decodes one token for the whole
running batch. Iteration durations come from the perf models of the server's kernel. The
policy sees what the real scheduler sees: a snapshot of every server taken every `refresh_s`
plus the requests it routed since. A request reserves KV slots for its prompt and its true
output length (the engine reserves max_new_tokens; a trace has no separate cap). Adapters are
in every server's host memory and adapter loading is not modelled (for `loraserve`, a server
that must fetch an adapter from a peer serves it at once: fetch time is not modelled either).
At every snapshot the policy's `tick` runs with the simulated time and every adapter the
cluster knows (`adapters`, default: those of the trace): that is where `loraserve` re-places.

Metrics per request follow the paper: TTFT, and time per token TPT = end-to-end latency /
output tokens (prefill and queueing included); a request meets the SLO when TPT <= SLO.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from toppings.scheduler.perf_model import PerfModels
from toppings.scheduler.policies import Policy
from toppings.scheduler.state import BatchShape, RouteRequest, ServerState
from toppings.scheduler.trace import TraceRequest


@dataclass(frozen=True)
class SimConfig:
    """Per-server limits mirror server.config.EngineConfig's defaults, except the KV slots:
    40,000 tokens is ~20 GB of Llama-7B fp16 KV (0.5 MB per token), what an A100-40GB has left
    after the weights and activations."""

    num_servers: int = 60
    kernel: str = "bgmv"
    max_total_tokens: int = 40_000
    max_batch_size: int = 128
    max_prefill_tokens: int = 8192
    warmup_fraction: float = 0.1  # arrivals in the first 10% of the trace are not measured
    # Like the scheduler's /stats polling: policies see snapshots taken every refresh_s (at the
    # first arrival after each tick) plus the requests routed since; 0 means always fresh.
    refresh_s: float = 0.1

    def __post_init__(self) -> None:
        if self.num_servers < 1 or self.kernel not in ("bgmv", "mbgmv"):
            raise ValueError("num_servers must be >= 1 and kernel bgmv or mbgmv")
        if self.refresh_s < 0:
            raise ValueError("refresh_s must be >= 0")


@dataclass(slots=True)
class _Request:
    trace: TraceRequest
    first_token_s: float = math.nan
    finish_s: float = math.nan


class _RankSet:
    """Aggregates of a request set that supports removal (max rank from per-rank counts)."""

    __slots__ = ("counts", "num", "sum_rank", "sum_tokens", "sum_token_rank")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.num = self.sum_rank = self.sum_tokens = self.sum_token_rank = 0

    def change(self, rank: int, tokens: int, sign: int) -> None:
        self.counts[rank] = self.counts.get(rank, 0) + sign
        self.num += sign
        self.sum_rank += sign * rank
        self.sum_tokens += sign * tokens
        self.sum_token_rank += sign * tokens * rank

    def shape(self) -> BatchShape:
        max_rank = max((r for r, c in self.counts.items() if c), default=0)
        return BatchShape(self.num, self.sum_rank, max_rank, self.sum_tokens, self.sum_token_rank)


class SimServer:
    """One server's queue, running batch and iteration clock."""

    def __init__(self, idx: int, config: SimConfig, perf: PerfModels, adapters: frozenset[str]):
        self.idx = idx
        self.config = config
        self.decode_model = perf.decode(config.kernel)
        self.prefill_model = perf.prefill(config.kernel)
        self.adapters = adapters
        self.waiting: deque[_Request] = deque()
        self.running: list[tuple[int, int, _Request]] = []  # heap of (finish step, idx, request)
        self.wait_set, self.run_set = _RankSet(), _RankSet()
        self.reserved_tokens = 0  # KV slots of admitted requests (prompt + output each)
        self.queued_tokens = 0  # the same, of waiting requests
        self.step = 0
        self.busy = False
        self.prefilling: list[_Request] = []
        self._state: ServerState | None = None

    def state(self) -> ServerState:
        if self._state is None:
            queue = self.wait_set.shape()
            cfg_total = self.config.max_total_tokens
            self._state = ServerState(
                url=f"sim-{self.idx}",
                kernel=self.config.kernel,
                healthy=True,
                num_running=self.run_set.num + len(self.prefilling),
                num_queued=self.wait_set.num,
                batch=self.run_set.shape().merge(queue),
                queue=queue,
                room_tokens=cfg_total - self.reserved_tokens - self.queued_tokens,
                adapters=self.adapters,
            )
        return self._state

    def enqueue(self, request: _Request) -> None:
        self.waiting.append(request)
        self.wait_set.change(request.trace.rank, request.trace.prompt_tokens, +1)
        self.queued_tokens += request.trace.prompt_tokens + request.trace.output_tokens
        self._state = None

    def start_iteration(self, now: float) -> float | None:
        """Begin the next iteration; returns its end time, or None when there is nothing to do."""
        cfg = self.config
        admitted: list[_Request] = []
        num_tokens = 0
        while self.waiting:
            trace = self.waiting[0].trace
            need = trace.prompt_tokens + trace.output_tokens
            if (
                len(self.running) + len(admitted) >= cfg.max_batch_size
                or self.reserved_tokens + need > cfg.max_total_tokens
                or (admitted and num_tokens + trace.prompt_tokens > cfg.max_prefill_tokens)
            ):
                break
            admitted.append(self.waiting.popleft())
            self.wait_set.change(trace.rank, trace.prompt_tokens, -1)
            self.reserved_tokens += need
            self.queued_tokens -= need
            num_tokens += trace.prompt_tokens
        if admitted:
            shape = BatchShape.of(
                (r.trace.rank for r in admitted), (r.trace.prompt_tokens for r in admitted)
            )
            self.prefilling = admitted
            duration_ms = self.prefill_model.predict(shape)
        elif self.running:
            duration_ms = self.decode_model.predict(self.run_set.shape())
        else:
            self.busy = False
            return None
        self.busy = True
        self._state = None
        return now + duration_ms / 1000.0

    def finish_iteration(self, now: float, done: list[_Request]) -> None:
        """End the current iteration at `now`; appends finished requests to `done`."""
        if self.prefilling:
            for request in self.prefilling:
                request.first_token_s = now
                trace = request.trace
                if trace.output_tokens <= 1:
                    self._finish(request, now, done)
                    continue
                self.run_set.change(trace.rank, trace.prompt_tokens, +1)
                finish_step = self.step + trace.output_tokens - 1
                heapq.heappush(self.running, (finish_step, trace.idx, request))
            self.prefilling = []
        else:
            self.step += 1
            while self.running and self.running[0][0] <= self.step:
                request = heapq.heappop(self.running)[2]
                self.run_set.change(request.trace.rank, request.trace.prompt_tokens, -1)
                self._finish(request, now, done)
        self._state = None

    def _finish(self, request: _Request, now: float, done: list[_Request]) -> None:
        request.finish_s = now
        self.reserved_tokens -= request.trace.prompt_tokens + request.trace.output_tokens
        done.append(request)


@dataclass
class SimResult:
    """Finished requests (all of them, warm-up included) and how many were measured."""

    requests: list[_Request]
    measure_from_s: float
    num_unrouted: int = 0
    per_server_requests: list[int] = field(default_factory=list)

    def measured(self) -> list[_Request]:
        return [r for r in self.requests if r.trace.arrival_s >= self.measure_from_s]

    def tpt_ms(self) -> list[float]:
        return [
            (r.finish_s - r.trace.arrival_s) * 1000.0 / r.trace.output_tokens
            for r in self.measured()
        ]

    def summary(self, slo_tpt_ms: float) -> dict[str, float]:
        tpt = sorted(self.tpt_ms())
        ttft = sorted((r.first_token_s - r.trace.arrival_s) * 1000.0 for r in self.measured())
        num = len(tpt)
        if num == 0:
            return {"num_measured": 0}
        return {
            "num_measured": num,
            "slo_attainment": sum(1 for t in tpt if t <= slo_tpt_ms) / num,
            "mean_tpt_ms": sum(tpt) / num,
            "p50_tpt_ms": tpt[num // 2],
            "p99_tpt_ms": tpt[min(num - 1, int(0.99 * num))],
            "mean_ttft_ms": sum(ttft) / num,
            "p99_ttft_ms": ttft[min(num - 1, int(0.99 * num))],
            "num_unrouted": self.num_unrouted,
        }


def simulate(
    trace: Sequence[TraceRequest],
    policy: Policy,
    perf: PerfModels,
    config: SimConfig,
    adapters: Mapping[str, int] | None = None,
) -> SimResult:
    """Run `trace` through `config.num_servers` servers routed by `policy` until all finish.

    adapters: every adapter of the cluster (name -> rank) for the policy's `tick`.
    """
    if adapters is None:
        adapters = {r.adapter: r.rank for r in trace}
    known = frozenset(adapters) | frozenset(r.adapter for r in trace)
    servers = [SimServer(i, config, perf, known) for i in range(config.num_servers)]
    # (time, server idx, is_end): an iteration ends, or an idle server starts one. A start is an
    # event at the arrival time, not an immediate call, so that requests arriving at the same
    # instant share one prefill.
    events: list[tuple[float, int, bool]] = []
    done: list[_Request] = []
    per_server = [0] * config.num_servers
    num_unrouted = 0
    arrival_idx = 0
    views: list[ServerState] = []
    next_refresh_s = -math.inf
    while arrival_idx < len(trace) or events:
        if arrival_idx < len(trace) and (
            not events or trace[arrival_idx].arrival_s <= events[0][0]
        ):
            item = trace[arrival_idx]
            arrival_idx += 1
            route = RouteRequest(item.adapter, item.rank, item.prompt_tokens, item.output_tokens)
            if item.arrival_s >= next_refresh_s:
                views = [s.state() for s in servers]
                policy.tick(item.arrival_s, views, adapters)
                next_refresh_s = (
                    item.arrival_s
                    if config.refresh_s == 0
                    else (math.floor(item.arrival_s / config.refresh_s) + 1) * config.refresh_s
                )
            target = policy.choose(route, views)
            if target is None:
                num_unrouted += 1
                continue
            views[target] = views[target].with_routed(
                item.rank, item.prompt_tokens, item.output_tokens
            )
            per_server[target] += 1
            server = servers[target]
            server.enqueue(_Request(item))
            if not server.busy:
                server.busy = True
                heapq.heappush(events, (item.arrival_s, target, False))
            continue
        now, target, is_end = heapq.heappop(events)
        server = servers[target]
        if is_end:
            server.finish_iteration(now, done)
        end = server.start_iteration(now)
        if end is not None:
            heapq.heappush(events, (end, target, True))
    duration = trace[-1].arrival_s if trace else 0.0
    return SimResult(done, config.warmup_fraction * duration, num_unrouted, per_server)
