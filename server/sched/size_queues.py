"""Waiting requests in multi-level queues by weighted size (Chameleon, MICRO'25, sec. 4.3).

A new request gets a weighted request size (server.sched.sizing) and waits in the queue of its
size range. Every `REFRESH_S` seconds or `REFRESH_COUNT` arrivals, the last `WINDOW` arrivals
are clustered again (K <= 4 queues, midpoint cutoffs) and each queue gets a quota of tokens from
the M/M/1 bound, in the unit admission is bounded by:
- with chunked prefill (the gate has a step budget), tokens of every step: each step, a
  queue's running requests take its quota by the tokens they compute in it (one per decode, a
  chunk per prompt being prefilled), and what is left of it is what the queue may admit; the
  quota is whole again at the next step (`sizing.step_quotas`);
- without, KV slots held while a request runs: its charge is the KV slots it reserves (prompt
  plus max_new_tokens) plus its adapter's device memory in KV slots, borrowed until it ends
  (`sizing.queue_quotas`).
Which requests start is the subclass's (server.sched.chameleon).
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from dataclasses import dataclass

from toppings.server.config import SchedulingConfig
from toppings.server.requests.sequence import Sequence
from toppings.server.sched.queueing import Gate, QueuePolicy
from toppings.server.sched.sizing import (
    queue_cutoffs,
    queue_quotas,
    step_quotas,
    weighted_request_size,
)

log = logging.getLogger(__name__)

REFRESH_S = 30.0  # the paper refreshes every 5 min over hours-long traces; ours are minutes
REFRESH_COUNT = 256  # ... or after this many arrivals, whichever comes first
MIN_SAMPLES = 32  # arrivals before the first clustering (until then: one queue)
WINDOW = 1024  # recent arrivals and completions the clustering and the quotas look at


@dataclass
class Size:
    """What the policy knows of one request: its raw sizes, WRS and charge."""

    in_tokens: int
    out_tokens: float  # predicted
    adapter_size: float
    charge: int
    wrs: float = 0.0
    arrived: float = 0.0
    admitted: float = 0.0


class SizeQueues(QueuePolicy):
    """The waiting requests by size, the sizes of the running ones, and what they produced."""

    def __init__(self, config: SchedulingConfig, max_total_tokens: int):
        super().__init__(config, max_total_tokens)
        self.slo_s = config.ttft_slo_ms / 1000.0
        # output lengths by adapter: the fair shares' history (QueuePolicy.finished feeds it)
        self.predictor = self.shares.predictor
        self.cutoffs: list[float] = []
        self.quotas: list[int] = [max_total_tokens]  # one queue until the first clustering
        self._maxima = (1.0, 1.0, 1.0)  # maxIn, maxOut, maxAdapter, frozen at each refresh
        self._waiting: list[Sequence] = []  # in order (`shares.order`)
        self._queues: list[list[Sequence]] = [[]]
        self._fresh: list[Sequence] = []  # pushed, not sized yet (sizing needs the gate)
        self._sizes: dict[Sequence, Size] = {}
        self._running: dict[Sequence, Size] = {}
        self._arrivals: deque[Size] = deque(maxlen=WINDOW)
        self._served: deque[tuple[Size, float, int]] = deque(maxlen=WINDOW)  # size, s, tokens
        self._last_refresh = 0.0
        self._since_refresh = 0
        self.counters = {"refreshes": 0}

    # ---- the waiting requests ---------------------------------------------------------------

    def push(self, seq: Sequence, now: float) -> None:
        self.shares.claim(seq, not self._waiting)
        self._insert(seq)
        self._fresh.append(seq)

    def remove(self, seq: Sequence) -> None:
        self._waiting.remove(seq)
        self.shares.removed(seq)
        size = self._sizes.pop(seq, None)
        if seq in self._fresh:
            self._fresh.remove(seq)
        elif size is not None:
            self._queues[self._queue_of(size.wrs)].remove(seq)

    def __iter__(self):
        return iter(list(self._waiting))

    def __len__(self) -> int:
        return len(self._waiting)

    def head(self) -> Sequence | None:
        return self._waiting[0] if self._waiting else None

    def _insert(self, seq: Sequence) -> None:
        bisect.insort(self._waiting, seq, key=self.shares.order)

    def _queue_of(self, wrs: float) -> int:
        return bisect.bisect_right(self.cutoffs, wrs)

    def _enqueue(self, seq: Sequence) -> None:
        queue = self._queues[self._queue_of(self._sizes[seq].wrs)]
        bisect.insort(queue, seq, key=self.shares.order)

    # ---- sizing, clustering, quotas -----------------------------------------------------------

    def _size(self, seq: Sequence, gate: Gate, now: float) -> Size:
        adapter, params = seq.request.adapter, seq.request.params
        size = Size(
            in_tokens=seq.prompt_len,
            out_tokens=self.predictor.predict(adapter, params.max_new_tokens),
            adapter_size=gate.adapter_size(adapter),
            charge=seq.kv_need + gate.adapter_tokens(adapter),
            arrived=seq.arrival,
        )
        size.wrs = self._wrs(size)
        return size

    def _wrs(self, size: Size) -> float:
        return weighted_request_size(
            size.in_tokens, size.out_tokens, size.adapter_size, *self._maxima
        )

    def _take_fresh(self, gate: Gate, now: float) -> None:
        if not self.counters["refreshes"]:  # one queue until there is enough to cluster
            self.quotas = [gate.step_budget() or gate.total_tokens()]
        for seq in self._fresh:
            size = self._sizes[seq] = self._size(seq, gate, now)
            self._arrivals.append(size)
            self._since_refresh += 1
        fresh, self._fresh = self._fresh, []
        due = (
            not self.counters["refreshes"]
            or now - self._last_refresh >= REFRESH_S
            or self._since_refresh >= REFRESH_COUNT
        )
        if due and len(self._arrivals) >= MIN_SAMPLES:
            self.refresh(gate, now)
        else:
            for seq in fresh:
                self._enqueue(seq)

    def refresh(self, gate: Gate, now: float) -> None:
        """Cluster the recent sizes again, set the quotas and re-queue every waiting request."""
        sizes = list(self._arrivals)
        self._maxima = (
            max(s.in_tokens for s in sizes),
            max(s.out_tokens for s in sizes),
            gate.max_adapter_size(),
        )
        served = [s for s, _, _ in self._served]
        for s in [*sizes, *served, *self._sizes.values(), *self._running.values()]:
            s.wrs = self._wrs(s)
        self.cutoffs = queue_cutoffs([s.wrs for s in sizes])
        served = [(self._queue_of(s.wrs), t, n) for s, t, n in self._served]
        arrivals = [(self._queue_of(s.wrs), s) for s in sizes]
        num_queues, budget = len(self.cutoffs) + 1, gate.step_budget()
        if budget is None:
            self.quotas = queue_quotas(arrivals, served, num_queues, gate.total_tokens(),
                                       self.slo_s, now)  # fmt: skip
        else:
            self.quotas = step_quotas(arrivals, served, num_queues, budget, self.slo_s, now)
        self._requeue(now)
        log.info("queues: cutoffs %s, quotas %s", [round(c, 4) for c in self.cutoffs], self.quotas)

    def set_queues(
        self,
        cutoffs: list[float],
        quotas: list[int],
        maxima: tuple[float, float, float],
        now: float,
    ) -> None:
        """Fix the queues by hand (tests, experiments); the next refresh replaces them."""
        self.cutoffs, self.quotas, self._maxima = list(cutoffs), list(quotas), maxima
        for size in self._sizes.values():
            size.wrs = self._wrs(size)
        self._requeue(now)

    def _requeue(self, now: float) -> None:
        """Put every sized waiting request in its queue under the new cutoffs."""
        self._queues = [[] for _ in self.quotas]
        for seq in self._waiting:
            if seq in self._sizes:
                self._enqueue(seq)
        self._last_refresh, self._since_refresh = now, 0
        self.counters["refreshes"] += 1

    def _borrowed(self) -> list[int]:
        """The charge of each queue's running requests."""
        borrowed = [0] * len(self._queues)
        for size in self._running.values():
            borrowed[self._queue_of(size.wrs)] += size.charge
        return borrowed

    def _step_used(self, gate: Gate) -> list[int]:
        """The tokens each queue's running requests compute in this step, as planned so far."""
        used = [0] * len(self._queues)
        for seq, size in self._running.items():
            used[self._queue_of(size.wrs)] += gate.planned(seq)
        return used

    def _quota_left(self, gate: Gate) -> list[int]:
        """What each queue's quota has left now: of this step's tokens (chunked prefill), or
        of the KV slots its running requests borrow."""
        used = self._borrowed() if gate.step_budget() is None else self._step_used(gate)
        return [quota - u for quota, u in zip(self.quotas, used)]

    def _entitled(self, left: list[int], by_step: bool) -> list[Sequence]:
        """Queue heads their quota lets start now: any chunk of a step's tokens left, or their
        whole charge of the KV slots left."""
        return [
            queue[0]
            for q, queue in enumerate(self._queues)
            if queue and (left[q] > 0 if by_step else self._sizes[queue[0]].charge <= left[q])
        ]

    # ---- completions and views ----------------------------------------------------------------

    def finished(self, seq: Sequence, completed: bool, now: float) -> None:
        super().finished(seq, completed, now)
        size = self._running.pop(seq, None)
        if size is None:
            return
        if completed:
            self._served.append((size, now - size.admitted, max(len(seq.output_ids), 1)))

    def view(self) -> dict:
        queues = list(self._queues)
        return {
            "policy": self.name,
            "queue_lengths": [len(q) for q in queues],
            "cutoffs": list(self.cutoffs),
            "quotas": list(self.quotas),
            "ttft_slo_ms": self.config.ttft_slo_ms,
            **self.shares.view(),
            **self.counters,
        }
