"""Which waiting requests the engine admits next (`--queue-policy`): one interface, a table.

The engine hands every new request to its policy (`push`) and, once per iteration, asks it to
`select` a batch. The policy decides the order; the engine's `Gate` decides whether one request
fits now (batch room, KV slots, prefill budget, adapter memory, LoRA mode) and, when it does,
admits it. A policy never touches the model, the KV pool or the adapter cache itself.

- `fcfs`: arrival order; the first request that does not fit stops admission (today's engine).
- `chameleon`: adapter-aware multi-level queues with token quotas (server.sched.chameleon).

Both keep their waiting requests in the order of server.sched.fair_share (`--fair-share`):
start tags that interleave adapters by the tokens each was served, arrival order with one.

With chunked prefill a policy also plans, before any admission, how many tokens of the step each
request being prefilled computes (`plan_chunks`): those requests were admitted before any
waiting one, so they are continued first (a request keeps its place) in every policy.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from toppings.server.sched.fair_share import FairShares

if TYPE_CHECKING:
    from toppings.server.config import SchedulingConfig
    from toppings.server.requests.adapter_ref import AdapterRef
    from toppings.server.requests.sequence import Sequence


class Verdict(enum.Enum):
    """What the gate answered for one request."""

    ADMITTED = "admitted"
    BATCH_FULL = "batch_full"  # no batch row left: nothing else fits this iteration
    NO_ROOM = "no_room"  # its KV slots or prefill tokens do not fit now
    NO_ADAPTER_MEMORY = "no_adapter_memory"  # its adapter finds no device memory until one ends
    NOT_READY = "not_ready"  # its adapter is still loading and the LoRA mode waits for it
    # a prompt no shorter than what the one being prefilled has left, while the step's room is
    # kept for a shorter one (server.sched.scheduler): it waits its turn, the next may go
    WAITS_TURN = "waits_turn"


class Gate(Protocol):
    """The engine's side of admission, for one iteration."""

    def try_admit(self, seq: Sequence, max_chunk: int | None = None) -> Verdict:
        """Admit `seq` into this iteration's batch if it fits now; with chunked prefill, its
        prompt chunk this step is at most `max_chunk` tokens (None: what the step has left)."""

    def holds_adapter(self, seq: Sequence) -> bool:
        """Whether waiting `seq` holds a reference on its adapter already (it was admitted as
        far as its adapter's load, which it waits for: NOT_READY)."""

    def step_budget(self) -> int | None:
        """Tokens one step computes (chunked prefill), or None: steps are not budgeted."""

    def step_left(self) -> int:
        """Tokens of the step's budget not planned yet (chunked prefill)."""

    def planned(self, seq: Sequence) -> int:
        """Tokens a running or just admitted request computes this step as planned so far (1
        for a decode, its chunk for a prompt; 0 when it computes nothing or steps are not
        budgeted)."""

    def squash(self, seq: Sequence) -> None:
        """Take a running request out of the batch for a later re-execution (it must be pushed
        back by the policy)."""

    def fits_if_released(self, waiting: Sequence, running: Sequence) -> bool:
        """Whether `waiting`'s adapter would find device memory if `running` released its own."""

    def adapter_tokens(self, adapter: AdapterRef | None) -> int:
        """Device memory of an adapter, in KV-slot units (0 when adapter memory is unbounded)."""

    def adapter_size(self, adapter: AdapterRef | None) -> float:
        """An adapter's size for the WRS (its weight bytes); max over all: `max_adapter_size`."""

    def max_adapter_size(self) -> float: ...

    def total_tokens(self) -> int:
        """The memory the quotas share, in KV slots: the KV cache plus a bounded adapter budget."""

    def prefetch(self, adapters: list[AdapterRef]) -> None:
        """Start loading these adapters of queued requests while memory is free (best effort)."""

    def free_tokens(self) -> int:
        """Memory admission may still promise now, in KV slots."""

    def free_rows(self) -> int:
        """Batch rows left this iteration."""

    def need_tokens(self, seq: Sequence) -> int:
        """Memory admitting `seq` now would promise (its KV and adapter), in KV slots."""

    def release_tokens(self, seq: Sequence) -> int:
        """Memory a running request gives back when it ends, in KV slots."""


class QueuePolicy:
    """Holds the waiting requests and picks, each iteration, which of them to admit."""

    name = "base"

    def __init__(self, config: SchedulingConfig, max_total_tokens: int):
        """config: the scheduling part of the engine's configuration; max_total_tokens: the KV
        cache's size in tokens (the memory part's), which a policy with quotas starts from."""
        self.config = config
        # The order of waiting requests: each policy keeps them sorted by `shares.order`, their
        # start tags (arrival order with one tenant, or with --fair-share off)
        self.shares = FairShares(config.fair_share)

    def push(self, seq: Sequence, now: float) -> None:
        raise NotImplementedError

    def remove(self, seq: Sequence) -> None:
        """An aborted or failed waiting request leaves the queue."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[Sequence]:
        """The waiting requests, in order (`shares.order`)."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, seq: object) -> bool:
        return any(s is seq for s in self)

    def select(self, gate: Gate, running: list[Sequence], now: float) -> list[Sequence]:
        """Admit requests through `gate`; returns them in admission order."""
        raise NotImplementedError

    def plan_chunks(
        self,
        decodes: list[Sequence],
        prefilling: list[Sequence],
        budget: int,
        cap: int | None = None,
    ) -> dict[Sequence, int]:
        """Chunked prefill: the tokens each request being prefilled (`prefilling`, in admission
        order) computes this step, out of the `budget` the step's `decodes` leave, planned
        before any admission; each at most `cap` (None: no bound) where the scheduler shares
        the room between prompts of different lengths (server.sched.scheduler). Here: in
        admission order, each as much of its prompt as is left, so an older prompt is slowed
        by no younger one but a shorter one sharing the room."""
        chunks: dict[Sequence, int] = {}
        for seq in prefilling:
            if budget <= 0:
                break
            chunks[seq] = min(seq.prefill_len - seq.num_prefilled, budget, cap or budget)
            budget -= chunks[seq]
        return chunks

    def head(self) -> Sequence | None:
        """The first waiting request in order (None: none waits)."""
        return next(iter(self), None)

    def same_share(self, older: Sequence, younger: Sequence) -> bool:
        """Whether a shorter `younger` prompt shares a step's prompt room with the `older` one
        being prefilled (partial prefills: server.sched.scheduler); a policy with quotas of
        each step may share it its own way between some requests."""
        return True

    def finished(self, seq: Sequence, completed: bool, now: float) -> None:
        """An admitted request left the batch; `completed`: it stopped or hit its length."""
        self.shares.finished(seq, completed)

    def forget_adapter(self, adapter: AdapterRef) -> None:
        """`adapter` was unloaded (none of its requests is waiting or running): drop whatever
        the policy keeps of it, so that what it holds does not grow with every reload."""
        self.shares.forget_adapter(adapter)

    def view(self) -> dict:
        """Queue lengths, cutoffs, quotas and counters for /stats and /metrics."""
        return {"policy": self.name, "queue_lengths": [len(self)], **self.shares.view()}


class FcfsQueue(QueuePolicy):
    """First come, first served (in arrival order, or in fair-share order across adapters);
    the first request that does not fit blocks the ones behind it (only a request whose adapter
    is still loading, or a long prompt waiting its turn behind the one being prefilled, lets
    the next ones go)."""

    name = "fcfs"

    def __init__(self, config: SchedulingConfig, max_total_tokens: int):
        super().__init__(config, max_total_tokens)
        self._waiting: list[Sequence] = []

    def push(self, seq: Sequence, now: float) -> None:
        self.shares.claim(seq, not self._waiting)
        bisect.insort(self._waiting, seq, key=self.shares.order)

    def remove(self, seq: Sequence) -> None:
        self._waiting.remove(seq)
        self.shares.removed(seq)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self._waiting))

    def __len__(self) -> int:
        return len(self._waiting)

    def head(self) -> Sequence | None:
        return self._waiting[0] if self._waiting else None

    def select(self, gate: Gate, running: list[Sequence], now: float) -> list[Sequence]:
        admitted: list[Sequence] = []
        for seq in list(self._waiting):
            verdict = gate.try_admit(seq)
            if verdict in (Verdict.NOT_READY, Verdict.WAITS_TURN):
                continue
            if verdict is not Verdict.ADMITTED:
                break
            self._waiting.remove(seq)
            self.shares.admitted(seq)
            admitted.append(seq)
        return admitted
