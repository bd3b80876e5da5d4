"""Chameleon's non-preemptive, adapter-aware multi-level queues (MICRO'25, sec. 4.3): which
waiting requests start, from the queues and quotas of server.size_queues.

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
Deviation (step 0): the paper's quotas are tokens per iteration; ours are memory held for a
request's whole run, so a queue's quota lent to the others by phase 2 comes back only as they
end, and the quotas alone let a large request wait for the memory indefinitely (sessions 9-12).
A reserved request waits at most for the requests running or reserved before it; backfilling
keeps small requests flowing in the memory FCFS leaves idle. Taking a quota back at once by
squashing the requests beyond theirs (session 13) cost more than it gained in bench/queueing_sim
(P99 TTFT at FCFS's highest load within the SLO / sustained load vs FCFS, with it and without:
CPU step model 1.19x / 0.95x and 0.95x / 1.03x; flat-decode model 0.75x / 1.04x and 0.65x / 1.06x).
Deviation in phase 2: the paper redistributes only what queues left of their quotas, which are
tokens per iteration (capacity kept back shortens every iteration). Ours reserve memory, and idle
memory shortens nothing: it made the large queue's requests wait for each other while memory
sat unused. The quotas still decide, under contention, which queues memory goes to first.
With chunked prefill (`--chunked-prefill on`) the paper's per-iteration token limit is the
step's token budget, which the admission gate enforces for every policy: once the running
decodes and the prompt chunks fill a step, every queue's head finds no room until the next one,
and a request admitted with part of the budget computes a chunk of its prompt and keeps its
place while the rest is prefilled. The quotas stay shares of memory (the deviation above).
Opportunistic bypass: when a head finds no adapter memory, a younger request of its queue may
go first, and be squashed later, as server.bypass says.
"""

from __future__ import annotations

from toppings.server.config import SchedulingConfig
from toppings.server.requests.sequence import Sequence
from toppings.server.sched.backfill import Reservations, allows, reserve, take
from toppings.server.sched.bypass import SquashBudget, is_deterministic, may_bypass
from toppings.server.sched.queueing import Gate, Verdict
from toppings.server.sched.size_queues import SizeQueues

MAX_RESERVATIONS = 2  # requests that hold a reservation at once (the oldest, a queue head)


class ChameleonQueue(SizeQueues):
    """See the module docstring."""

    name = "chameleon"

    def __init__(self, config: SchedulingConfig, max_total_tokens: int):
        super().__init__(config, max_total_tokens)
        self._bypasses: list[tuple[Sequence, Sequence]] = []  # (bypassed, bypasser)
        self._reserved: list[Sequence] = []  # waiting requests with a reservation, in order
        self.counters.update(bypasses=0, squashes=0, reserved=0, backfilled=0)
        self._budget = SquashBudget()

    # ---- batch formation ----------------------------------------------------------------------

    def select(self, gate: Gate, running: list[Sequence], now: float) -> list[Sequence]:
        self._take_fresh(gate, now)
        self._squash_bypassers(gate)
        batch: list[Sequence] = []
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

    def _reserve(self, gate: Gate, borrowed: list[int]) -> Reservations:
        """This iteration's reservations (step 0); each keeps its place until it starts."""
        self._reserved = [s for s in self._reserved if s in self._sizes]  # still waiting
        free = gate.free_tokens()
        idle = [queue[0] for q, queue in enumerate(self._queues) if queue and not borrowed[q]]
        entitled = [*self._entitled(borrowed), *idle]
        need = {s: gate.need_tokens(s) for s in [*self._waiting[:1], *entitled]}
        late = sorted((s for s, n in need.items() if n > free), key=lambda s: s.arrival)
        for seq in late[:MAX_RESERVATIONS]:
            if len(self._reserved) < MAX_RESERVATIONS and all(seq is not r for r in self._reserved):
                self._reserved.append(seq)
                self.counters["reserved"] += 1
        if not self._reserved:
            return Reservations([], [])
        ends = [(_steps_left(s), gate.release_tokens(s)) for s in self._running]
        needs = [
            (need[s] if s in need else gate.need_tokens(s), _steps_left(s)) for s in self._reserved
        ]
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
        if seq in self._running:
            self._budget.left(seq.prompt_len + len(seq.output_ids))
        super().finished(seq, completed, now)

    def view(self) -> dict:
        return {**super().view(), "squashed_work_share": self._budget.share}


def _steps_left(seq: Sequence) -> int:
    """Decode steps a request may still run (it may stop earlier)."""
    return seq.request.params.max_new_tokens - len(seq.output_ids)
