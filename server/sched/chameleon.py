"""Chameleon's non-preemptive, adapter-aware multi-level queues (MICRO'25, sec. 4.3): which
waiting requests start, from the queues and quotas of server.sched.size_queues.

The paper's quota (sec. 4.3, Algorithm 1): each queue has `PQ_Tokens`, tokens covering a
request's input, output and adapter memory; every iteration's batch formation (phase 1) lets
each queue, smallest first, put requests in while their needs fit its tokens, then (phase 2)
hands what the queues with nothing left to put did not use to the queues still waiting,
smallest first; the quotas come from the M/M/1 bound, recomputed every T_refresh (5 min) over
recent requests. Here the unit is what bounds a step:
- chunked prefill (`--chunked-prefill on`, the default): tokens of each step. A queue's quota
  is its share of the step's token budget; its running requests take it by the tokens they
  compute in the step (a decode one, a prompt being prefilled its chunk: `plan_chunks`, before
  any admission), a new request by its first chunk (at most what is left of the share), and
  the share is whole again at the next step. A large prompt thus takes its queue's share of
  each step, not the whole budget, and a small-request queue gets its share of every step.
  Quotas: sizing.step_quotas, refreshed with the queues (server.sched.size_queues);
- whole-prompt steps: KV slots, a request's charge (prompt plus max_new_tokens plus its adapter
  in KV slots) borrowed from its queue's quota until it ends (sizing.queue_quotas).

Each iteration (`select`; "oldest" and "arrival order" here mean first in the order of
server.sched.fair_share, arrival order with one adapter or with `--fair-share off`):
0. the oldest waiting request goes first if it fits (with chunked prefill: after its queue's
   prompt being prefilled, if any, with a chunk of what its queue's share of the step has left
   and at least min(quota, `MIN_CHUNK`), so that decodes over its queue's share do not hold it
   back until they end); if not, it gets a reservation (server.sched.backfill), as does the
   oldest queue head its quota entitles to start (or whose queue runs nothing) that finds no
   room: the step from which the memory stays free enough for it, kept until it starts. No
   other request starts if that would delay a reservation;
1. Algorithm 1's phase 1: every queue, smallest first, admits from its head within what its
   quota has left; without chunked prefill a queue with nothing running may always admit its
   head (so a request larger than the quota runs; a chunk never is);
2. what phase 1 left (memory, or the step's tokens) goes to the queues in the same order, each
   from its head, while it fits (work-conserving; see below). With chunked prefill a queue
   whose prompt being prefilled this step leaves unfinished admits nothing here: that prompt
   keeps its place, and the scheduler gives it the tokens left at the end.
Deviation (step 0): memory is held for a request's whole run, so a queue's memory lent to the
others comes back only as they end, and the quotas alone let a large request wait for the
memory indefinitely. A reserved request waits at most for the requests running or reserved
before it; backfilling keeps small requests flowing in the memory FCFS leaves idle. Taking
memory back at once by squashing the requests beyond their quota cost more than it gained in
bench/queueing_sim, with either step model (docs/benchmarks.md, "Measurements behind the code").
Deviation in phase 2: the paper hands on only the quota of queues with nothing left to put;
ours hands on everything unused (idle memory or step tokens shorten no one's wait). The quotas
still decide, under contention, which queues go first.
Opportunistic bypass: when a head finds no adapter memory, a younger request of its queue may
go first, and be squashed later, as server.sched.bypass says.
Liveness with adapters loaded on demand: a waiting request told to wait for its adapter's load
(NOT_READY) holds that adapter's memory until it has run. Such a request is always asked again
(behind a head that finds no adapter memory it is no bypasser, and while nothing runs no
reservation holds it back), so memory held by waiting requests never keeps the oldest waiting
with nothing running; holds are never dropped to make room, so a no-cache layout does not load,
drop and reload an adapter.
"""

from __future__ import annotations

from toppings.server.config import SchedulingConfig
from toppings.server.requests.sequence import Sequence
from toppings.server.sched.backfill import Reservations, allows, reserve, take
from toppings.server.sched.bypass import SquashBudget, may_bypass
from toppings.server.sched.queueing import Gate, Verdict
from toppings.server.sched.size_queues import SizeQueues
from toppings.server.sched.step_budget import MIN_CHUNK

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
        by_step = gate.step_budget() is not None
        batch: list[Sequence] = []
        reserved = self._reserve(gate, by_step)
        stop = False
        for seq in [*reserved.holders, *self._waiting[:1]]:  # step 0
            if seq not in self._sizes:
                continue
            cap = None
            if by_step:  # its chunk comes out of its queue's share of the step
                q = self._queue_of(self._sizes[seq].wrs)
                unfinished = self._capped(gate).get(q)  # its queue's prompt being prefilled
                if unfinished is not None and seq.prefill_len >= unfinished:
                    continue  # goes first, unless it has more left than this whole prompt
                cap = max(self._quota_left(gate)[q], min(self.quotas[q], MIN_CHUNK))
                if cap <= 0:
                    continue
            stop = self._admit(seq, gate, now, batch, reserved, cap) is Verdict.BATCH_FULL
            if stop:
                break
        left, borrowed = self._quota_left(gate), self._borrowed()
        for q, queue in enumerate(self._queues):  # phase 1: each within its quota
            if stop:
                break
            may_exceed = not by_step and not borrowed[q]
            stop = self._put(queue, max(left[q], 0), gate, running, now, batch, reserved,
                             may_exceed, by_step)  # fmt: skip
        capped = self._capped(gate) if by_step else {}
        for q, queue in enumerate(self._queues):  # phase 2: what phase 1 left, smallest first
            if stop:
                break
            if q in capped:
                continue  # its prompt being prefilled takes what is left first (keeps its place)
            # no quota here: the gate refuses what the memory (or the step) does not hold
            everything = gate.step_left() if by_step else gate.total_tokens()
            stop = self._put(queue, everything, gate, running, now, batch, reserved, False,
                             by_step)  # fmt: skip
        self._prefetch(gate)
        return batch

    def plan_chunks(
        self,
        decodes: list[Sequence],
        prefilling: list[Sequence],
        budget: int,
        cap: int | None = None,
    ) -> dict[Sequence, int]:
        """The prompts being prefilled, in admission order, take what their queue's quota of
        the step has left after the queue's decodes, and at least min(quota, `MIN_CHUNK`) tokens
        a queue (so that its oldest prompt advances every step even while its decodes take its
        whole share); what the quotas leave of the step after admission goes to these prompts too,
        oldest first (server.sched.scheduler); each at most `cap` where the scheduler shares the
        room between prompts of different lengths of one queue (`same_share`)."""
        decoding = [0] * len(self.quotas)
        for seq in decodes:
            if seq in self._running:
                decoding[self._queue_of(self._running[seq].wrs)] += 1
        share = [max(quota - n, min(quota, MIN_CHUNK)) for quota, n in zip(self.quotas, decoding)]
        chunks: dict[Sequence, int] = {}
        for seq in prefilling:
            if budget <= 0:
                break
            rest = min(seq.prefill_len - seq.num_prefilled, cap or budget)
            if seq in self._running:
                q = self._queue_of(self._running[seq].wrs)
                rest = min(rest, max(share[q], 0))
                share[q] -= rest
            chunks[seq] = min(rest, budget)
            budget -= chunks[seq]
        return chunks

    def same_share(self, older: Sequence, younger: Sequence) -> bool:
        """Prompts of one queue share the room as the scheduler shares it; the queues' quotas
        share it between queues (a request not yet sized shares nothing)."""
        sizes = [self._running.get(s) or self._sizes.get(s) for s in (older, younger)]
        return None not in sizes and self._queue_of(sizes[0].wrs) == self._queue_of(sizes[1].wrs)

    def _capped(self, gate: Gate) -> dict[int, int]:
        """The queues with a running prompt that this step, as planned, leaves unfinished, and
        the most prompt tokens such a prompt of each has left after it."""
        capped: dict[int, int] = {}
        for seq, size in self._running.items():
            rest = seq.prefill_len - seq.num_prefilled - gate.planned(seq)
            if rest > 0:
                q = self._queue_of(size.wrs)
                capped[q] = max(capped.get(q, 0), rest)
        return capped

    def _reserve(self, gate: Gate, by_step: bool) -> Reservations:
        """This iteration's reservations (step 0); each keeps its place until it starts."""
        self._reserved = [s for s in self._reserved if s in self._sizes]  # still waiting
        free = gate.free_tokens()
        borrowed = self._borrowed()
        idle = [queue[0] for q, queue in enumerate(self._queues) if queue and not borrowed[q]]
        entitled = [*self._entitled(self._quota_left(gate), by_step), *idle]
        need = {s: gate.need_tokens(s) for s in [*self._waiting[:1], *entitled]}
        late = sorted((s for s, n in need.items() if n > free), key=self.shares.order)
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
        by_step: bool,
    ) -> bool:
        """Admit from the head of `queue` within `tokens` (beyond, for its head, `may_exceed`)
        without delaying a reservation; returns whether to stop all admission. `by_step`:
        `tokens` are of this step, and each request takes the chunk of its prompt it computes
        in it (at most what is left of them); else KV slots, each request its whole charge."""
        used = 0
        bypassed: Sequence | None = None
        for seq in list(queue):
            charge, cap = self._sizes[seq].charge, None
            if by_step:
                cap = tokens - used
                if cap <= 0:
                    break
            elif used + charge > tokens and not (may_exceed and not used and bypassed is None):
                break
            # A request holding its adapter already (its load was started while it waited)
            # takes no adapter memory by starting, and its hold ends only once it has run: it
            # is no bypasser, and passing it over could leave the memory the bypassed request
            # waits for held by waiting requests forever.
            holds = bypassed is not None and gate.holds_adapter(seq)
            if bypassed is not None and not holds and not self._may_bypass(seq, running):
                continue
            verdict = self._admit(seq, gate, now, batch, reserved, cap)
            if verdict is None:
                continue  # it would delay a reserved request; a shorter one may not
            if verdict is Verdict.ADMITTED:
                used += gate.planned(seq) if by_step else charge
                if bypassed is not None and not holds:
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
        self,
        seq: Sequence,
        gate: Gate,
        now: float,
        batch: list[Sequence],
        reserved: Reservations,
        cap: int | None = None,
    ) -> Verdict | None:
        """Try `seq` (its chunk of this step at most `cap` tokens) unless it would delay a
        reservation ahead of it (then None). While nothing runs, a request holding its adapter
        is not held back: no memory frees by waiting then, and the adapter memory it holds
        (which a reserved request may need) comes back only once it has run."""
        ahead = reserved.ahead_of(seq)
        if ahead and not self._running and gate.holds_adapter(seq):
            ahead = []
        if ahead:
            need, steps = gate.need_tokens(seq), _steps_left(seq)
            if not allows(ahead, need, steps):
                return None
        verdict = self._try(seq, gate, now, batch, cap)
        if verdict is Verdict.ADMITTED and ahead:
            take(ahead, need, steps)
            if all(seq is not h for h in reserved.holders):
                self.counters["backfilled"] += 1
        return verdict

    def _try(
        self, seq: Sequence, gate: Gate, now: float, batch: list[Sequence], cap: int | None
    ) -> Verdict:
        verdict = gate.try_admit(seq) if cap is None else gate.try_admit(seq, cap)
        if verdict is Verdict.ADMITTED:
            size = self._sizes.pop(seq)
            self._waiting.remove(seq)
            self._queues[self._queue_of(size.wrs)].remove(seq)
            self.shares.admitted(seq)
            size.admitted = now
            self._running[seq] = size
            batch.append(seq)
        return verdict

    # ---- bypass and squash --------------------------------------------------------------------

    def _may_bypass(self, seq: Sequence, running: list[Sequence]) -> bool:
        remaining = [
            self._running[s].out_tokens - len(s.output_ids)
            for s in running
            if s.request.adapter is not None and s in self._running
        ]
        return may_bypass(self._sizes[seq].out_tokens, remaining, self._budget)

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
        resumes where it was when admitted again (its work so far counts as wasted: its
        prefill is computed again, what the prefix cache kept of it excepted)."""
        size = self._running.pop(seq)
        self._budget.left(seq.prompt_len + len(seq.output_ids), squashed=True)
        self.counters["squashes"] += 1
        gate.squash(seq)
        self._sizes[seq] = size
        self._insert(seq)
        self._enqueue(seq)

    def _prefetch(self, gate: Gate) -> None:
        """Start the load of the first waiting adapter not on the device, in arrival order: in
        queue order a younger request's adapter (of a smaller queue) took the memory the oldest
        request's large adapter needed, and being wanted it was not evicted for it (a rank-128
        request waited behind rank-16 ones even at a light load: bench_queueing,
        docs/benchmarks.md, "Measurements behind the code")."""
        adapters = [s.request.adapter for s in self._waiting if s.request.adapter]
        if adapters:
            gate.prefetch(list(dict.fromkeys(adapters)))

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
