"""Chameleon's non-preemptive, adapter-aware multi-level queues (MICRO'25, sec. 4.3).

A new request gets a weighted request size (server.queue_sizing) and waits in the queue of its
size range. Every `REFRESH_S` seconds or `REFRESH_COUNT` arrivals, the last `WINDOW` arrivals
are clustered again (K <= 4 queues, midpoint cutoffs) and each queue gets a quota of tokens from
the M/M/1 bound. A request's charge on its queue's quota is the KV slots it reserves (prompt plus
max_new_tokens) plus its adapter's device memory in KV slots; it borrows that while it runs.

Each iteration (`select`):
0. the oldest waiting request goes first if it fits; if not, it gets a reservation
   (server.backfill), as does the oldest queue head its quota entitles to start (or whose queue
   runs nothing) that finds no room: the step from which the memory stays free enough for it,
   kept until it starts. No other request starts if that would delay a reservation;
1. Algorithm 1 of the paper: every queue, smallest first, admits from its head while its
   unborrowed quota allows; a queue with nothing running may always admit its head (so a
   request larger than the quota runs);
2. the memory phase 1 left goes to the queues in the same order, each from its head, while
   it fits (work-conserving; see below).
Deviation (step 0): the paper protects large requests by quotas alone; here the small queues
took the memory as it freed, so a large request rarely found room and became the P99
(bench_queueing, sessions 9-12). A reserved request waits at most for the requests running or
reserved before it; backfilling keeps small requests flowing in memory FCFS leaves idle.
Deviation in phase 2: the paper redistributes only what queues left of their quotas, which are
tokens per iteration (capacity kept back shortens every iteration). Ours reserve memory, and idle
memory shortens nothing: it made the large queue's requests wait for each other while memory
sat unused. The quotas still decide, under contention, which queues memory goes to first.
Opportunistic bypass: when a head finds no adapter memory, a younger request of its queue may
go first, and be squashed later, as server.bypass says.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from dataclasses import dataclass

from toppings.server.backfill import Reservations, allows, reserve, take
from toppings.server.bypass import SquashBudget, is_deterministic, may_bypass
from toppings.server.config import EngineConfig
from toppings.server.queue_sizing import (
    OutputPredictor,
    queue_cutoffs,
    queue_quotas,
    weighted_request_size,
)
from toppings.server.queueing import Gate, QueuePolicy, Verdict
from toppings.server.sequence import Sequence

log = logging.getLogger(__name__)

REFRESH_S = 30.0  # the paper refreshes every 5 min over hours-long traces; ours are minutes
REFRESH_COUNT = 256  # ... or after this many arrivals, whichever comes first
MIN_SAMPLES = 32  # arrivals before the first clustering (until then: one queue)
WINDOW = 1024  # recent arrivals and completions the clustering and the quotas look at
MAX_RESERVATIONS = 2  # requests that hold a reservation at once (the oldest, a queue head)


@dataclass
class _Size:
    """What the policy knows of one request: its raw sizes, WRS and charge."""

    in_tokens: int
    out_tokens: float  # predicted
    adapter_size: float
    charge: int
    wrs: float = 0.0
    arrived: float = 0.0
    admitted: float = 0.0


class ChameleonQueue(QueuePolicy):
    """See the module docstring."""

    name = "chameleon"

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.slo_s = config.ttft_slo_ms / 1000.0
        self.predictor = OutputPredictor()
        self.cutoffs: list[float] = []
        self.quotas: list[int] = [config.max_total_tokens]
        self._maxima = (1.0, 1.0, 1.0)  # maxIn, maxOut, maxAdapter, frozen at each refresh
        self._waiting: list[Sequence] = []  # arrival order
        self._queues: list[list[Sequence]] = [[]]
        self._fresh: list[Sequence] = []  # pushed, not sized yet (sizing needs the gate)
        self._sizes: dict[Sequence, _Size] = {}
        self._running: dict[Sequence, _Size] = {}
        self._arrivals: deque[_Size] = deque(maxlen=WINDOW)
        self._served: deque[tuple[_Size, float, int]] = deque(maxlen=WINDOW)  # size, s, tokens
        self._bypasses: list[tuple[Sequence, Sequence]] = []  # (bypassed, bypasser)
        self._reserved: list[Sequence] = []  # waiting requests with a reservation, in order
        self._last_refresh = 0.0
        self._since_refresh = 0
        self.counters = {"bypasses": 0, "squashes": 0, "refreshes": 0, "reserved": 0,
                         "backfilled": 0, "reclaims": 0}  # fmt: skip
        self._budget = SquashBudget()

    # ---- the waiting requests ---------------------------------------------------------------

    def push(self, seq: Sequence, now: float) -> None:
        self._insert(seq)
        self._fresh.append(seq)

    def remove(self, seq: Sequence) -> None:
        self._waiting.remove(seq)
        size = self._sizes.pop(seq, None)
        if seq in self._fresh:
            self._fresh.remove(seq)
        elif size is not None:
            self._queues[self._queue_of(size.wrs)].remove(seq)

    def __iter__(self):
        return iter(list(self._waiting))

    def __len__(self) -> int:
        return len(self._waiting)

    def _insert(self, seq: Sequence) -> None:
        bisect.insort(self._waiting, seq, key=lambda s: s.arrival)

    def _queue_of(self, wrs: float) -> int:
        return bisect.bisect_right(self.cutoffs, wrs)

    def _enqueue(self, seq: Sequence) -> None:
        queue = self._queues[self._queue_of(self._sizes[seq].wrs)]
        bisect.insort(queue, seq, key=lambda s: s.arrival)

    # ---- sizing, clustering, quotas -----------------------------------------------------------

    def _size(self, seq: Sequence, gate: Gate, now: float) -> _Size:
        adapter, params = seq.request.adapter, seq.request.params
        size = _Size(
            in_tokens=seq.prompt_len,
            out_tokens=self.predictor.predict(adapter, params.max_new_tokens),
            adapter_size=gate.adapter_size(adapter),
            charge=seq.kv_need + gate.adapter_tokens(adapter),
            arrived=seq.arrival,
        )
        size.wrs = self._wrs(size)
        return size

    def _wrs(self, size: _Size) -> float:
        return weighted_request_size(
            size.in_tokens, size.out_tokens, size.adapter_size, *self._maxima
        )

    def _take_fresh(self, gate: Gate, now: float) -> None:
        if not self.counters["refreshes"]:
            self.quotas = [gate.total_tokens()]  # one queue until there is enough to cluster
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
        self.quotas = queue_quotas(arrivals, served, len(self.cutoffs) + 1, gate.total_tokens(),
                                   self.slo_s, now)  # fmt: skip
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

    # ---- batch formation ----------------------------------------------------------------------

    def select(self, gate: Gate, running: list[Sequence], now: float) -> list[Sequence]:
        self._take_fresh(gate, now)
        self._squash_bypassers(gate)
        batch: list[Sequence] = []
        self._reclaim(gate, self._borrowed(), now, batch)
        reserved = self._reserve(gate, self._borrowed())
        stop = False
        for seq in [*reserved.holders, *self._waiting[:1]]:  # step 0
            if seq in self._sizes:
                stop = self._admit(seq, gate, now, batch, reserved) is Verdict.BATCH_FULL
            if stop:
                break
        borrowed = self._borrowed()
        for q, queue in enumerate(self._queues):  # phase 1: each within its quota
            if stop:
                break
            unborrowed = max(self.quotas[q] - borrowed[q], 0)
            stop = self._put(queue, unborrowed, gate, running, now, batch, reserved,
                             may_exceed=not borrowed[q])  # fmt: skip
        everything = gate.total_tokens()  # phase 2 has no quota: the gate refuses what won't fit
        for queue in self._queues:  # phase 2: the memory phase 1 left, smallest requests first
            if stop:
                break
            stop = self._put(queue, everything, gate, running, now, batch, reserved, False)
        self._prefetch(gate)
        return batch

    def _borrowed(self) -> list[int]:
        """The charge of each queue's running requests."""
        borrowed = [0] * len(self._queues)
        for size in self._running.values():
            borrowed[self._queue_of(size.wrs)] += size.charge
        return borrowed

    def _entitled(self, borrowed: list[int]) -> list[Sequence]:
        """Queue heads within their queue's unborrowed quota."""
        return [
            queue[0]
            for q, queue in enumerate(self._queues)
            if queue and self._sizes[queue[0]].charge <= self.quotas[q] - borrowed[q]
        ]

    def _reclaim(self, gate: Gate, borrowed: list[int], now: float, batch: list) -> None:
        """Squash the youngest requests running beyond their own queue's quota (deterministic
        ones, within the squash budget) so that the oldest queue head within its quota that
        finds no room starts now: the quota is its queue's, lent out only while unused."""
        free = gate.free_tokens()
        late = [s for s in self._entitled(borrowed) if gate.need_tokens(s) > free]
        if not late:
            return
        head = min(late, key=lambda s: s.arrival)
        need, over = gate.need_tokens(head), list(borrowed)
        victims, work = [], 0
        for seq, size in sorted(self._running.items(), key=lambda kv: -kv[1].admitted):
            q = self._queue_of(size.wrs)
            cost = seq.prompt_len + len(seq.output_ids)
            if over[q] <= self.quotas[q] or not is_deterministic(seq.request.params):
                continue
            if not self._budget.allows(work + cost):
                break
            victims.append(seq)
            over[q], work = over[q] - size.charge, work + cost
            free += gate.release_tokens(seq)
            if free >= need:
                for victim in victims:
                    self.squash(victim, gate)
                self.counters["reclaims"] += 1
                self._try(head, gate, now, batch)
                return

    def _reserve(self, gate: Gate, borrowed: list[int]) -> Reservations:
        """This iteration's reservations (step 0); each keeps its place until it starts."""
        self._reserved = [s for s in self._reserved if s in self._sizes]  # still waiting
        free = gate.free_tokens()
        idle = [queue[0] for q, queue in enumerate(self._queues) if queue and not borrowed[q]]
        entitled = [*self._entitled(borrowed), *idle]
        late = sorted(
            (s for s in [*self._waiting[:1], *entitled] if gate.need_tokens(s) > free),
            key=lambda s: s.arrival,
        )
        for seq in late[:MAX_RESERVATIONS]:
            if len(self._reserved) < MAX_RESERVATIONS and all(seq is not r for r in self._reserved):
                self._reserved.append(seq)
                self.counters["reserved"] += 1
        if not self._reserved:
            return Reservations([], [])
        ends = [(_steps_left(s), gate.release_tokens(s)) for s in self._running]
        needs = [(gate.need_tokens(s), _steps_left(s)) for s in self._reserved]
        return Reservations(list(self._reserved), reserve(needs, free, gate.free_rows(), ends))

    def _put(
        self,
        queue: list[Sequence],
        tokens: int,
        gate: Gate,
        running: list[Sequence],
        now: float,
        batch: list[Sequence],
        reserved: Reservations,
        may_exceed: bool,
    ) -> bool:
        """Admit from the head of `queue` within `tokens` (beyond, for its head, `may_exceed`)
        without delaying a reservation; returns whether to stop all admission."""
        used = 0
        bypassed: Sequence | None = None
        for seq in list(queue):
            charge = self._sizes[seq].charge
            if used + charge > tokens and not (may_exceed and not used and bypassed is None):
                break
            if bypassed is not None and not self._may_bypass(seq, running):
                continue
            verdict = self._admit(seq, gate, now, batch, reserved)
            if verdict is None:
                continue  # it would delay a reserved request; a shorter one may not
            if verdict is Verdict.ADMITTED:
                used += charge
                if bypassed is not None:
                    self._bypasses.append((bypassed, seq))
                    self.counters["bypasses"] += 1
            elif verdict is Verdict.BATCH_FULL:
                return True
            elif verdict is Verdict.NO_ROOM:
                break
            elif verdict is Verdict.NO_ADAPTER_MEMORY and bypassed is None:
                bypassed = seq
        return False

    def _admit(
        self, seq: Sequence, gate: Gate, now: float, batch: list[Sequence], reserved: Reservations
    ) -> Verdict | None:
        """Try `seq` unless it would delay a reservation ahead of it (then None)."""
        ahead = reserved.ahead_of(seq)
        if ahead:
            need, steps = gate.need_tokens(seq), _steps_left(seq)
            if not allows(ahead, need, steps):
                return None
        verdict = self._try(seq, gate, now, batch)
        if verdict is Verdict.ADMITTED and ahead:
            take(ahead, need, steps)
            if all(seq is not h for h in reserved.holders):
                self.counters["backfilled"] += 1
        return verdict

    def _try(self, seq: Sequence, gate: Gate, now: float, batch: list[Sequence]) -> Verdict:
        verdict = gate.try_admit(seq)
        if verdict is Verdict.ADMITTED:
            size = self._sizes.pop(seq)
            self._waiting.remove(seq)
            self._queues[self._queue_of(size.wrs)].remove(seq)
            size.admitted = now
            self._running[seq] = size
            batch.append(seq)
        return verdict

    # ---- bypass and squash --------------------------------------------------------------------

    def _may_bypass(self, seq: Sequence, running: list[Sequence]) -> bool:
        params = seq.request.params
        remaining = [
            self._running[s].out_tokens - len(s.output_ids)
            for s in running
            if s.request.adapter is not None and s in self._running
        ]
        deterministic = is_deterministic(params)
        return may_bypass(deterministic, self._sizes[seq].out_tokens, remaining, self._budget)

    def _squash_bypassers(self, gate: Gate) -> None:
        keep = []
        for waiting, bypasser in self._bypasses:
            if waiting not in self._sizes or bypasser not in self._running:
                continue  # the bypassed request got in, or the bypasser ended
            work = bypasser.prompt_len + len(bypasser.output_ids)
            if self._budget.allows(work) and gate.fits_if_released(waiting, bypasser):
                self.squash(bypasser, gate)
            else:
                keep.append((waiting, bypasser))
        self._bypasses = keep

    def squash(self, seq: Sequence, gate: Gate) -> None:
        """Take a running request out of the batch; it waits again in its arrival place and
        runs from its prompt when admitted again (its work so far counts as wasted)."""
        size = self._running.pop(seq)
        self._budget.left(seq.prompt_len + len(seq.output_ids), squashed=True)
        self.counters["squashes"] += 1
        gate.squash(seq)
        self._sizes[seq] = size
        self._insert(seq)
        self._enqueue(seq)

    def _prefetch(self, gate: Gate) -> None:
        names = [s.request.adapter for q in self._queues for s in q if s.request.adapter]
        if names:
            gate.prefetch(list(dict.fromkeys(names)))

    # ---- completions and views ----------------------------------------------------------------

    def finished(self, seq: Sequence, completed: bool, now: float) -> None:
        size = self._running.pop(seq, None)
        if size is None:
            return
        num_out = len(seq.output_ids)
        self._budget.left(seq.prompt_len + num_out)
        if completed:
            self.predictor.observe(seq.request.adapter, num_out, seq.request.params.max_new_tokens)
            self._served.append((size, now - size.admitted, max(num_out, 1)))

    def view(self) -> dict:
        queues = list(self._queues)
        return {
            "policy": self.name,
            "queue_lengths": [len(q) for q in queues],
            "cutoffs": list(self.cutoffs),
            "quotas": list(self.quotas),
            "ttft_slo_ms": self.config.ttft_slo_ms,
            "squashed_work_share": self._budget.share,
            **self.counters,
        }


def _steps_left(seq: Sequence) -> int:
    """Decode steps a request may still run (it may stop earlier)."""
    return seq.request.params.max_new_tokens - len(seq.output_ids)
