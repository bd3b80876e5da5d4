"""What the engine runs next, and what becomes of the requests after it ran: no torch here.

One plan shape (vLLM v1's): every request carries its computed-token count, and each step gives
each scheduled request a token count (a decode 1, a prompt its chunk, an unchunked prompt all
of it) and whether it samples. Each iteration `schedule` plans the running decodes, then the
prompts being prefilled, then lets the queue policy admit waiting requests through an
`AdmissionGate`, within the step's token budget (chunked prefill, `GateLimits.max_step_tokens`;
a prompt longer than the budget is spread over steps, and its request samples its first token
in the step that computes its last chunk) or, with chunked prefill off, whole prompts up to
`max_prefill_tokens` beside the decodes (the same path, the prompt budget not bounded by a
step). It then reserves every planned request's KV slots through the memory, before the step.

The plan goes to a model runner (or a simulator's step-time model), whose tokens come back to
`update`: each prompt advances by its chunk, every sampling request appends its token, and the
ones that are done end (`finish`: their KV hold, prefix-tree nodes and adapter reference are
given back, the last output is sent). One request in a step failing fails that step (`fail`),
not the others.

With async scheduling (server/engine/step_pipeline.py) the engine plans the next step while the
device runs a decode step: `launched` and `returned` bracket each step on the device. A request
with a token in flight is planned as a decode (its input is that token, which the runner takes
from the step before), except where that token is its last by length; a request that ends while
a step of its is on the device (a stop, an abort) ends for its client at once, and gives back
its KV and adapter when the step is back (a step computed for it then is dropped: vLLM's "one
step late"). A plan made ahead takes nothing back: where the slots cannot be had, there is no
plan until the device's step is back.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from toppings.server.requests.sequence import Sequence
from toppings.server.sched.admission import (
    Adapters,
    AdmissionGate,
    Memory,
    queued_adapters,
    release,
)
from toppings.server.sched.gate_limits import GateLimits
from toppings.server.sched.plan import StepPlan, StepResult
from toppings.server.sched.queueing import QueuePolicy
from toppings.server.sched.step_budget import MIN_CHUNK, StepBudget
from toppings.server.sched.tiles import in_tiles

log = logging.getLogger(__name__)
COMPLETED = ("stop", "length")  # finish reasons of a request that ran to its end


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
        self.preemptions = 0  # running requests taken back for memory (`_reserve`)
        # Requests in steps launched and not yet returned (async scheduling), with how many
        self._on_device: Counter[Sequence] = Counter()
        # Requests that ended while on the device, with whether their KV stays cached: given
        # back when their last step is returned
        self._ended_on_device: dict[Sequence, bool] = {}

    def add(self, seq: Sequence) -> None:
        """A new request waits. With `expected_kv` (--kv-admission expected) its KV is
        reserved for its prompt and the output its adapter's history expects
        (`OutputPredictor.bound`), not for all of max_new_tokens: where requests stop well
        before their max_tokens, more of them run at once. One that runs longer takes the
        blocks it needs as it goes (its reservation grows), and when the pool runs out the
        youngest running request is preempted and resumes later (`_reserve`)."""
        if self.limits.expected_kv:
            params = seq.request.params
            output = self.queue.shares.predictor.bound(seq.request.adapter, params)
            seq.kv_need = seq.prompt_len + output
        self.queue.push(seq, self.clock())

    def set_step_budget(self, budget: StepBudget) -> None:
        """Resize chunked prefill's steps from the next one on (the engine's refit of its step
        model: server.sched.step_refit)."""
        self.limits = self.limits.with_budget(budget)

    def has_work(self) -> bool:
        return bool(len(self.queue) or self.running)

    def gate(
        self,
        planned: dict[Sequence, int] | None = None,
        limits: GateLimits | None = None,
        waits_turn: Callable[[Sequence], bool] | None = None,
    ) -> AdmissionGate:
        """A fresh gate for one iteration's admissions (with chunked prefill, the step's tokens
        planned so far per request, and which waiting prompts the step's room is not kept for:
        see AdmissionGate; `limits`: this step's, with its budget)."""
        return AdmissionGate(
            self.running, self.queue, self.memory, self.adapters, limits or self.limits,
            self.clock, planned, waits_turn,
        )  # fmt: skip

    def schedule(self) -> StepPlan | None:
        """The next step, or None when nothing can run now (requests may wait for an adapter
        load or for memory).

        One path for both settings: the running decodes (one token each), then chunks of the
        prompts being prefilled as the queue policy plans them (before any admission: a request
        being prefilled keeps its place), then newly admitted prompts, which join `running` at
        once. With chunked prefill the step holds the budget of a step of that many decodes
        (GateLimits.step_tokens), and what the policy's quotas leave of it at the end goes to
        the prompts being prefilled, oldest first; without (`max_step_tokens` None) the prompt
        budget is unbounded by the step: each admitted prompt is computed whole, up to
        `max_prefill_tokens` of prompts a step (the first one always).

        Partial prefills (as vLLM's `--max-num-partial-prefills`): a prompt is not held for the
        whole of an older, longer prompt's prefill (one tenant's long prompts do not set
        another's time to first token). While the oldest prompt being prefilled has more left
        than a younger prompt being prefilled, or than a waiting request's prompt, the room is
        shared: each of those prompts (the waiting one counting as one) is planned
        within an equal share, so the shorter ones finish in a few steps and the long one still
        advances every step; what admission leaves goes back to the prompts being prefilled,
        oldest first. A share is at least `MIN_CHUNK` only where that is at most half the room:
        the floor alone gave the oldest prompt all of a small room (16 prompt tokens beside 2
        decodes, where a busy machine's refit put the budget), and the short prompts behind it
        waited for its whole prefill. The waiting request that counts is the first one shorter
        than what the oldest has left, not only the first in line: a second long prompt waiting
        behind the first held every short one behind it for the first one's whole prefill.
        The share is kept for such a prompt: a waiting one no shorter than what the oldest has
        left waits its turn (`Verdict.WAITS_TURN`; FCFS passes over it), as it would get no
        token before the oldest's last chunk anyway. It is not starved: a prompt that passes it
        is shorter than what the oldest has left, so each one that passes it while the next is
        prefilled is shorter than the last, and the chain ends within a few prompts. Prompts of
        equal or greater length keep their order (FCFS). Under chameleon only prompts of one
        queue share so (its quotas share a step between queues).

        The prompt chunks are then made whole tiles of the blocked attention kernel, a chunk
        cut below a tile raised to one within a stall bound (server.sched.tiles).

        Each planned request's KV slots are reserved here (`Memory.allocate`), before the step
        runs; see `_reserve`. A step of decodes alone with nothing waiting is that plan with
        neither the queue policy nor the gate asked (they would plan and admit nothing).
        """
        self.memory.tick(self.clock())
        # requests served on the host, to the device where room is there
        self.adapters.promote(lambda: queued_adapters(self.queue))
        if not len(self.queue) and all(s.is_prefilled for s in self.running):
            # Decodes alone, nothing waiting: nothing to plan nor admit, so the gate and the
            # queue policy are left out (what it saves: docs/benchmarks.md).
            chunks = {s: 1 for s in self.running if not self._ends_in_flight(s)}
            starts = self._reserve(chunks)
            return StepPlan.of(chunks, starts) if chunks and starts is not None else None
        decodes = [s for s in self.running if s.is_prefilled and not self._ends_in_flight(s)]
        prefilling = [s for s in self.running if not s.is_prefilled]
        planned: dict[Sequence, int] = {s: 1 for s in decodes}
        limits, budget, waits_turn = self.limits, None, None
        if limits.max_step_tokens is not None:
            limits = limits.for_step(len(decodes))
            budget = limits.max_step_tokens
            left = budget - len(decodes)
            sharers, num_shares = self._sharers(prefilling)
            share = None
            if num_shares > 1:
                prefilling, share = sharers, max(left // num_shares, min(MIN_CHUNK, left // 2), 1)
            if num_shares > len(sharers):  # a share kept for a shorter waiting prompt
                waits_turn = self._waits_turn(sharers[0])
            for seq, n in self.queue.plan_chunks(decodes, prefilling, left, share).items():
                if n > 0:  # the policy plans budget tokens: a chunk after a long past gets fewer
                    within = limits.chunk_within(n, seq.num_prefilled, seq.scores_prompt)
                    planned[seq] = min(n, within)
        gate = self.gate(planned, limits, waits_turn)
        admitted = self._admit(gate)
        self.running.extend(admitted)
        still = set(self.running)  # the policy may have squashed some: they wait again
        chunks = {s: n for s, n in gate.chunks.items() if s in still}
        if budget is not None:
            self._fill(chunks, limits, budget - sum(gate.cost(s, n) for s, n in chunks.items()))
            in_tiles(chunks, self.running, gate.cost, budget * limits.tile_stall)
        starts = self._reserve(chunks)
        if not chunks or starts is None:
            return None
        return StepPlan.of(chunks, starts)

    def _ends_in_flight(self, seq: Sequence) -> bool:
        """Whether a token of the request in flight on the device is its last by length (async
        scheduling: it is not planned again)."""
        if not self._on_device:
            return False
        num_tokens = len(seq.output_ids) + self._on_device[seq]
        return (num_tokens >= seq.request.params.max_new_tokens
                or seq.prompt_len + num_tokens >= self.max_model_len)  # fmt: skip

    @property
    def has_steps_on_device(self) -> bool:
        """Whether a launched step is not yet returned (async scheduling)."""
        return bool(self._on_device)

    def launched(self, plan: StepPlan) -> None:
        """A plan went to the device (async scheduling): its requests are on it until
        `returned`."""
        self._on_device.update(plan.seqs)

    def returned(self, plan: StepPlan) -> None:
        """A launched plan's step is done on the device: the requests that ended meanwhile and
        have no other step there give back what they hold."""
        self._on_device.subtract(plan.seqs)
        for seq in plan.seqs:
            if self._on_device[seq] <= 0:
                del self._on_device[seq]
                if seq in self._ended_on_device:
                    self.release(seq, keep_kv=self._ended_on_device.pop(seq))
                    self.on_end(seq)

    def _admit(self, gate: AdmissionGate) -> list[Sequence]:
        try:
            return self.queue.select(gate, self.running, self.clock())
        except Exception as exc:  # one request's admission failing fails that request only
            log.exception("admission failed")
            return self._recover(gate, f"admission error: {exc}")

    def _fill(self, chunks: dict[Sequence, int], limits: GateLimits, left: int) -> None:
        """Give what the step's budget has `left` to the prompts being prefilled: first to
        those it finishes (a short prompt's last tokens, which a queue's quota or a chunk's
        rounding left over, wait no step more for an older long prompt), then oldest first
        (chunked prefill)."""
        prompts = [s for s in self.running if not s.is_prefilled]

        def rest_cost(seq: Sequence) -> int:  # what finishing its prompt costs more
            past, had, scored = seq.num_prefilled, chunks.get(seq, 0), seq.scores_prompt
            rest = limits.chunk_cost(seq.prefill_len - past, past, scored)
            return rest - limits.chunk_cost(had, past, scored)

        finishing = [s for s in prompts if rest_cost(s) <= left]
        for seq in [*finishing, *(s for s in prompts if s not in finishing)]:
            if left <= 0:
                break
            had, past, scored = chunks.get(seq, 0), seq.num_prefilled, seq.scores_prompt
            cost = limits.chunk_cost(had, past, scored)
            within = limits.chunk_within(cost + left, past, scored)
            more = min(seq.prefill_len - past - had, within - had)
            if more > 0:
                chunks[seq] = had + more
                left -= limits.chunk_cost(had + more, past, scored) - cost

    def _reserve(self, chunks: dict[Sequence, int]) -> dict[Sequence, int] | None:
        """Reserve the planned requests' slots for their tokens of this step through the memory
        (before the step: the runner only writes them); returns where each one's tokens start.
        When they cannot be had, the youngest running request is preempted (it waits again and
        resumes where it was: `Sequence.resume`) and the rest tried again; with one request
        left, it fails alone. With worst-case reservations (--kv-admission worst-case) this is
        a fault path: an admitted request always finds its blocks, once cached items have
        left; with expected ones, it is how a request that outgrew its reservation gets room.
        While a step is on the device (a plan made ahead) nothing is taken back: None, no plan
        now."""
        while chunks:
            seqs = [s for s in self.running if s in chunks]  # the oldest first
            starts = self.memory.allocate(seqs, [chunks[s] for s in seqs])
            if starts is not None:
                return dict(zip(seqs, starts))
            if self._on_device:
                return None
            if len(self.running) == 1:
                chunks.pop(seqs[-1])
                self.finish(seqs[-1], "error", error="no KV memory left for this request")
            else:
                victim = self.running[-1]
                log.warning("preempting request %s for KV memory (it resumes later)",
                            victim.request.request_id)  # fmt: skip
                chunks.pop(victim, None)
                self.preempt(victim)
        return {}

    def preempt(self, seq: Sequence) -> None:
        """Take a running request back to the queue: its memory and adapter go back (its
        computed blocks stay cached), and it resumes where it was when admitted again."""
        self.running.remove(seq)
        self.queue.finished(seq, False, self.clock())
        self.release(seq, keep_kv=True)
        seq.resume()
        if self.limits.expected_kv:  # its next reservation: twice the output it has made
            made = seq.prompt_len + 2 * len(seq.output_ids)
            worst = seq.prompt_len + seq.request.params.max_new_tokens
            seq.kv_need = min(max(seq.kv_need, made), worst)
        self.queue.push(seq, self.clock())
        self.preemptions += 1

    def _sharers(self, prefilling: list[Sequence]) -> tuple[list[Sequence], int]:
        """The prompts being prefilled that share this step's room (the oldest, and the
        younger ones with less left than it), and the number of shares: one more when a
        waiting request's prompt is shorter than what the oldest has left."""
        if not prefilling:
            return [], 0
        oldest, policy = prefilling[0], self.queue
        longest = oldest.prefill_len - oldest.num_prefilled
        sharers = [oldest, *(s for s in prefilling[1:] if s.prefill_len - s.num_prefilled < longest
                             and policy.same_share(oldest, s))]  # fmt: skip
        shorter = any(s.prefill_len < longest and policy.same_share(oldest, s) for s in policy)
        return sharers, len(sharers) + shorter

    def _waits_turn(self, oldest: Sequence) -> Callable[[Sequence], bool]:
        """Whether a waiting prompt waits its turn behind `oldest` (it is no shorter than what
        `oldest` has left, and shares with it): the share kept for a shorter one is not its."""
        longest, policy = oldest.prefill_len - oldest.num_prefilled, self.queue
        return lambda seq: seq.prefill_len >= longest and policy.same_share(oldest, seq)

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
        """Take a step's tokens: each prompt advances by its chunk (its full blocks are cached
        at once), the sampling requests append their token, and finished ones end."""
        prompted = []
        for seq, n in zip(plan.seqs, plan.tokens):
            if not seq.is_prefilled and not seq.finished:
                seq.num_prefilled = min(seq.num_prefilled + n, seq.prefill_len)
                prompted.append(seq)
        now = self.clock()
        if prompted:
            self.memory.after_prefill(prompted, result.forward_s, result.num_computed, now)
        else:
            self.memory.after_decode(len(plan.seqs), now)
        logprobs = result.logprobs or [None] * len(result.tokens)
        for seq, token, logprob in zip(plan.sampled, result.tokens, logprobs):
            if seq.finished:
                continue  # it ended while its step ran (async scheduling): the token is dropped
            reason = seq.append(token, self.eos_ids, self.max_model_len, logprob)
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
        if seq in self._on_device:  # a step of it still runs: given back when it returns
            self._ended_on_device[seq] = reason != "error"
            seq.finish(reason, error)
            return
        self.release(seq, keep_kv=reason != "error")
        seq.finish(reason, error)
        self.on_end(seq)

    def recount(self, seq: Sequence, reason: str) -> None:
        """Count an ended request under `reason`, the one its client saw: the output thread
        found a stop string (or a text failure) in tokens the engine had already ended it
        after, by its length or an abort."""
        if seq.finished and seq.finish_reason != reason:
            self.finished[seq.finish_reason] -= 1
            self.finished[reason] = self.finished.get(reason, 0) + 1
            seq.finish_reason = reason

    def release(self, seq: Sequence, keep_kv: bool = True) -> None:
        """Give back what a request holds (see `admission.release`)."""
        release(seq, self.memory, self.adapters, keep_kv, self.clock())
