"""What the engine runs next, and what becomes of the requests after it ran: no torch here.

Each iteration `schedule` lets the queue policy admit waiting requests through an
`AdmissionGate`; the admitted ones make a prefill step, else the running batch makes a decode
step. The plan goes to a model runner (or a simulator's step-time model), whose tokens come back
to `update`: the prefilled requests join the running batch, every request appends its token,
and the ones that are done end (`finish`: their KV hold, prefix-tree nodes and adapter
reference are given back, the last output is sent). One request in a step failing fails that
step (`fail`), not the others.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from toppings.server.requests.sequence import Sequence
from toppings.server.sched.admission import Adapters, AdmissionGate, GateLimits, Memory, release
from toppings.server.sched.queueing import QueuePolicy

log = logging.getLogger(__name__)
COMPLETED = ("stop", "length")  # finish reasons of a request that ran to its end


@dataclass(frozen=True)
class StepPlan:
    """One step: its requests (one adapter's side by side, so the LoRA kernels run once per run
    of them) and whether it prefills them (the newly admitted) or decodes (the running batch)."""

    seqs: tuple[Sequence, ...]
    is_prefill: bool


@dataclass(frozen=True)
class StepResult:
    """What running a plan gave: one token per request of the plan, in order, and for the
    memory's prefill-speed estimate the forward's seconds and the prompt tokens it computed."""

    tokens: list[int]
    forward_s: float = 0.0
    num_computed: int = 0


class Scheduler:
    """The waiting queue, the running batch and admission; see the module docstring."""

    def __init__(
        self,
        queue: QueuePolicy,
        memory: Memory,
        adapters: Adapters,
        limits: GateLimits,
        eos_ids: set[int],
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        on_end: Callable[[Sequence], None] = lambda seq: None,
    ):
        """on_end: called once for each request when it ends, on any path."""
        self.queue = queue  # the waiting requests and who goes next
        self.memory, self.adapters, self.limits = memory, adapters, limits
        self.eos_ids, self.max_model_len, self.clock = eos_ids, max_model_len, clock
        self.on_end = on_end
        self.running: list[Sequence] = []
        self.finished: dict[str, int] = {}  # finish reason -> requests

    def add(self, seq: Sequence) -> None:
        self.queue.push(seq, self.clock())

    def has_work(self) -> bool:
        return bool(len(self.queue) or self.running)

    def gate(self) -> AdmissionGate:
        """A fresh gate for one iteration's admissions."""
        return AdmissionGate(
            self.running, self.queue, self.memory, self.adapters, self.limits, self.clock
        )

    def schedule(self) -> StepPlan | None:
        """The next step, or None when nothing can run now (requests may wait for an adapter
        load or for memory)."""
        self.memory.tick(self.clock())
        gate = self.gate()
        try:
            admitted = self.queue.select(gate, self.running, self.clock())
        except Exception as exc:  # one request's admission failing fails that request only
            log.exception("admission failed")
            admitted = self._recover(gate, f"admission error: {exc}")
        step = admitted or list(self.running)
        if not step:
            return None
        return StepPlan(tuple(sorted(step, key=lambda s: s.request.adapter or "")), bool(admitted))

    def _recover(self, gate: AdmissionGate, error: str) -> list[Sequence]:
        """After a queue policy raised: the requests the gate admitted go ahead (they hold their
        memory); the one the policy asked about last fails (every waiting request of the
        adapter it asked about; every waiting request when it asked about none)."""
        asked = gate.asked
        if isinstance(asked, Sequence):
            culprits = [asked]
        else:
            culprits = [s for s in self.queue if asked is None or s.request.adapter == asked]
        for seq in culprits:
            if seq not in gate.admitted:
                self.finish(seq, "error", error=error)
        return [s for s in gate.admitted if not s.finished]

    def update(self, plan: StepPlan, result: StepResult) -> None:
        """Take a step's tokens: prefilled requests start running; finished ones end."""
        seqs = list(plan.seqs)
        if plan.is_prefill:
            self.running.extend(seqs)
            self.memory.after_prefill(seqs, result.forward_s, result.num_computed, self.clock())
        else:
            self.memory.after_decode(len(seqs), self.clock())
        for seq, token in zip(seqs, result.tokens):
            reason = seq.append(token, self.eos_ids, self.max_model_len)
            if reason is not None:
                self.finish(seq, reason)

    def fail(self, plan: StepPlan, error: str) -> None:
        """A step raised: its requests end with an error (the others keep running)."""
        for seq in plan.seqs:
            self.finish(seq, "error", error=error)

    def abort(self, request_id: str) -> None:
        for seq in list(self.queue) + self.running:
            if seq.request.request_id == request_id:
                self.finish(seq, "abort")

    def abort_all(self) -> None:
        for seq in list(self.queue) + list(self.running):
            self.finish(seq, "abort")

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """End a request on any path: free its KV row and reservation, send the last output."""
        if seq.finished:
            return
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.queue:
            self.queue.remove(seq)
        if seq.kv_hold is not None:
            self.queue.finished(seq, reason in COMPLETED, self.clock())
        self.release(seq, keep_kv=reason != "error")
        seq.finish(reason, error)
        self.on_end(seq)

    def release(self, seq: Sequence, keep_kv: bool = True) -> None:
        """Give back what a request holds (see `admission.release`)."""
        release(seq, self.memory, self.adapters, keep_kv, self.clock())
