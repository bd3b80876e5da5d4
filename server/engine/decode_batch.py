"""The rows of a decode step, kept from step to step (vLLM v1's persistent batch).

A decode step of B requests reads per request its input token, position, KV row, KV length and
the slot its new key goes to. Rebuilt from the requests each step, that is a Python loop over B
on the host (and on CUDA a pageable copy per list); `DecodeBatch` keeps them instead in host
buffers of int64 fields [F, R] (R: the KV pool's request rows), updated from each plan's changes:
a request that stays keeps its values and advances (position + 1, length + 1, its input the
token the step before sampled), one that left is taken out (the rows after it move up), one
that joined is read from its request. The rows keep the plan's order: `StepPlan.of` groups a
step's requests by adapter (the LoRA kernels run once per run of one adapter) and keeps the
running order within a group, so a request that joins lands inside its adapter's run, not at
the end; the owner inserts it there (its fields are one numpy move per change, not a loop).
A plan whose staying requests come in another order is read whole, as is the first decode
after a prefill or mixed step (`reset`: those keep the list builder of model_runner.py).

Two sets of buffers alternate: the step on the device lane (step_pipeline.py) reads its set
while the engine thread writes the next step's into the other, which the step before that one
read and is done with (at most one step is on the lane while the next is prepared). On CUDA
the sets are pinned and the runner copies the step's set into one device mirror with one
non-blocking copy, in stream order after the step before (`DecodeBatch.device_fields`; written
for a GPU, not yet run on one); on a CPU the mirror is the set itself, no copy. The continuing
rows' input tokens are known only once the step before has sampled (with async scheduling,
after this step was prepared): `token_dst` and `token_src` say where each comes from, filled on
the lane before the forward (`fill`).

`generation` changes whenever the rows do: a decode step of the same generation has the same
requests in the same order as the last one, so it may run the LoRA batch it built then
(server/adapters/step.py), the one place that tells.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy
import torch

from toppings.server.memory.kv_cache import KVPool
from toppings.server.requests.sequence import Sequence
from toppings.server.sched.plan import StepPlan

# The fields of a set [F, R], one row each: a request's input token, its position, its KV
# length after this step's slot (what attention reads), its KV row and its new key's slot.
IDS, POSITIONS, LENGTHS, KV_ROWS, SLOTS = range(5)
NUM_FIELDS = 5


@dataclass(frozen=True)
class Views:
    """A set's (or the mirror's) first B rows: `host` [F, B] int64, the same as a numpy array
    (`array`; None on a device) and as one [B] tensor per field (`fields`), made once per set
    and B (each view costs a microsecond or two to make, a few per step)."""

    table: torch.Tensor  # the whole set [F, R]
    host: torch.Tensor
    array: numpy.ndarray | None
    fields: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, table: torch.Tensor, b: int) -> Views:
        host = table[:, :b]
        array = host.numpy() if host.device.type == "cpu" else None
        return cls(table, host, array, tuple(host[f] for f in range(NUM_FIELDS)))


@dataclass(slots=True)
class DecodeRows:
    """One decode step's rows (B requests, in `seqs`' order, the plan's), written by its owner
    only. views: the step's set [F, B] (pinned on CUDA), `IDS` of the continuing rows still to
    `fill`; token_dst [C], token_src [C]: the rows whose input is a token of `source` (the
    decode plan before) and its index in that step's tokens (None: no such row); in_flight:
    whether `source` was still on the device when the rows were read; in_order: whether the
    rows are the source's, in its order; entries: each request's adapter cache entry;
    seg_starts: [0, 1, ..., B]; max_length: the longest KV length."""

    seqs: tuple[Sequence, ...]
    views: Views
    generation: int
    source: StepPlan | None
    token_dst: numpy.ndarray | None
    token_src: numpy.ndarray | None
    in_flight: bool
    in_order: bool
    entries: list
    seg_starts: list[int]
    has_constraint: bool
    max_length: int

    @property
    def host(self) -> torch.Tensor:
        """The step's set [F, B] int64."""
        return self.views.host

    def fill(self, tokens: list[int]) -> None:
        """The continuing rows' input tokens from `tokens`, the source step's (every row of it
        sampled and none failed: its tokens are in its rows' order); in place."""
        ids = self.views.array[IDS]
        if self.in_order:  # the source's rows in its order: its tokens as they are
            ids[:] = tokens
        else:
            ids[self.token_dst] = numpy.asarray(tokens, dtype=numpy.int64)[self.token_src]

    def fill_each(self, tokens: dict[Sequence, int] | None) -> None:
        """The continuing rows' input tokens one by one: from `tokens` (the source step's, by
        request; a request it has none of failed there and computes token 0, dropped with it),
        else, the source's outcome unknown, 0 while it was in flight (its requests failed)
        or the request's last token."""
        ids = self.views.array[IDS]
        for j in self.token_dst.tolist():
            seq = self.seqs[j]
            if tokens is not None:
                ids[j] = tokens.get(seq, 0)
            else:
                ids[j] = 0 if self.in_flight else seq.output_ids[-1]


class DecodeBatch:
    """The owner of the decode step's rows (see the module docstring): `update` from each
    decode plan, `reset` when another kind of step ran or an update failed."""

    def __init__(self, kv: KVPool, device: torch.device, mirror: bool | None = None):
        """device: the model's; mirror: whether the forward reads a device copy of the sets
        (None: on CUDA; a CPU test may ask for one, to run the device's path)."""
        rows, self._kv = kv.req_to_slot.shape[0], kv
        mirror = device.type == "cuda" if mirror is None else mirror
        sets = [torch.zeros(NUM_FIELDS, rows, dtype=torch.int64) for _ in range(2)]
        self._sets = [s.pin_memory() for s in sets] if device.type == "cuda" else sets
        self._mirror = torch.zeros(NUM_FIELDS, rows, dtype=torch.int64, device=device) if mirror \
            else None  # fmt: skip
        self._views: dict[tuple[int, int], Views] = {}  # by (set, B); set -1: the mirror
        self._arange = numpy.arange(rows, dtype=numpy.int64)
        self._seg_starts = [0]
        self._current = 0  # the set of the last update
        self._seqs: tuple[Sequence, ...] = ()
        self._entries: list = []
        self._constrained: list[bool] = []
        self._max_length = 0
        self._plan: StepPlan | None = None  # the last update's (None: none yet)
        self._stale = True  # whether the rows' values are not to be advanced (`reset`)
        self.generation = 0
        self.counts = {"same": 0, "changed": 0, "read": 0}  # updates by path (tests, benches)

    @property
    def on_host(self) -> bool:
        """Whether the forward reads the host sets themselves (a CPU: no mirror, no copy)."""
        return self._mirror is None

    def device_fields(self, rows: DecodeRows) -> tuple[torch.Tensor, ...]:
        """The step's fields where the forward reads them, one [B] tensor each: the set's own on
        a CPU, else the device mirror's after one non-blocking copy of the whole set (in stream
        order after the step before, which read the mirror; the whole set, [F, R], is one
        contiguous block: its first B columns are not, and a strided copy would go through a
        pageable temporary)."""
        if self._mirror is None:
            return rows.views.fields
        self._mirror.copy_(rows.views.table, non_blocking=True)
        return self._view(-1, len(rows.seqs)).fields

    def _view(self, which: int, b: int) -> Views:
        made = self._views.get((which, b))
        if made is None:
            table = self._mirror if which < 0 else self._sets[which]
            made = self._views[(which, b)] = Views.of(table, b)
        return made

    def reset(self) -> None:
        """Forget the rows' values: the next decode step reads every request (a prefill or
        mixed step ran, whose decodes moved on without the owner, or an update failed halfway).
        Which requests the last decode plan had is kept: a step of it may still be on the device
        (an update that failed), its tokens the inputs of the next."""
        self._stale = True
        self.generation += 1

    def update(self, plan: StepPlan, pending: StepPlan | None = None) -> DecodeRows:
        """The rows of decode plan `plan` (every count 1), in its order, written into the set
        the step before did not use; pending: the plan of the step still on the device (its
        tokens are this one's inputs), None when none is."""
        try:
            return self._update(plan, pending)
        except BaseException:
            self.reset()
            raise

    def _update(self, plan: StepPlan, pending: StepPlan | None) -> DecodeRows:
        source, old, seqs = self._plan, self._seqs, plan.seqs
        current, b = 1 - self._current, len(seqs)  # the set the step before did not use
        if b > len(self._arange):
            raise RuntimeError(
                f"a decode step of {b} requests: the KV pool has {len(self._arange)}"
            )
        views = self._view(current, b)
        dst = views.array
        in_order = not self._stale and seqs == old
        if in_order:  # the same rows: each advances
            self.counts["same"] += 1
            dst[...] = self._view(self._current, b).array
            dst[POSITIONS : LENGTHS + 1] += 1
            moved: tuple = (self._arange[:b], self._arange[:b])
            max_length = self._max_length + 1
        else:
            src = self._view(self._current, len(old)).array
            moved = None if self._stale else self._changed(plan, src, dst, old)
            if moved is None:
                moved = self._read(plan, dst, old)
            self.generation += 1
            max_length = int(dst[LENGTHS].max(initial=0))
        if self._mirror is None and b:  # the table is host memory: each row's new slot now
            self._kv.slots_into(dst[KV_ROWS], dst[POSITIONS], dst[SLOTS])
        if len(self._seg_starts) != b + 1:
            self._seg_starts = list(range(b + 1))
        self._plan, self._seqs, self._current, self._stale = plan, seqs, current, False
        self._max_length = max_length
        token_dst, token_src = moved if len(moved[0]) else (None, None)
        return DecodeRows(
            seqs, views, self.generation, source, token_dst, token_src,
            pending is not None and pending is source, in_order, self._entries, self._seg_starts,
            any(self._constrained), max_length,
        )  # fmt: skip

    def _changed(self, plan: StepPlan, src, dst, old: tuple) -> tuple | None:
        """Rows that left taken out and rows that joined put in at their places, the staying
        ones moved (advanced) as one; None where the staying rows come in another order (then
        the plan is read whole). Returns (rows of the staying ones now, their rows before)."""
        seqs, was = plan.seqs, dict(zip(old, range(len(old))))
        left = sorted(was[s] for s in set(old).difference(seqs))
        joined = sorted(seqs.index(s) for s in set(seqs).difference(old))
        order = list(old)
        for i in reversed(left):
            del order[i]
        for j in joined:
            order.insert(j, seqs[j])
        if tuple(order) != seqs:
            return None
        self.counts["changed"] += 1
        b = len(seqs)
        keep = numpy.ones(len(old), dtype=bool)
        keep[left] = False
        stay_old = numpy.flatnonzero(keep)
        is_new = numpy.zeros(b, dtype=bool)
        is_new[joined] = True
        stay_new = numpy.flatnonzero(~is_new)
        dst[:, stay_new] = src[:, stay_old]
        dst[POSITIONS : LENGTHS + 1, stay_new] += 1
        # new lists: the step on the lane may be reading the last ones
        entries, constrained = list(self._entries), list(self._constrained)
        for i in reversed(left):
            del entries[i], constrained[i]
        for j in joined:
            self._write(dst, j, seqs[j], plan.starts[j])
            entries.insert(j, seqs[j].cache_entry)
            constrained.insert(j, seqs[j].request.params.constraint is not None)
        self._entries, self._constrained = entries, constrained
        return stay_new, stay_old

    def _read(self, plan: StepPlan, dst, old: tuple) -> tuple:
        """Every row read from its request; a row of `old` (the last update's rows) takes its
        input from that step's tokens. Returns (those rows, their rows before)."""
        self.counts["read"] += 1
        was = dict(zip(old, range(len(old))))
        stay_new, stay_old = [], []
        for j, (seq, start) in enumerate(zip(plan.seqs, plan.starts)):
            self._write(dst, j, seq, start)
            if seq in was:
                stay_new.append(j)
                stay_old.append(was[seq])
        self._entries = [s.cache_entry for s in plan.seqs]
        self._constrained = [s.request.params.constraint is not None for s in plan.seqs]
        return numpy.array(stay_new, dtype=numpy.int64), numpy.array(stay_old, dtype=numpy.int64)

    def _write(self, dst, j: int, seq: Sequence, start: int) -> None:
        """Row j from its request: its last token (overwritten by `fill` where a step before
        samples it), its position, KV length (the pool's now: this step's slot reserved, the
        next plan's not yet) and row."""
        row = seq.kv_hold.row
        dst[IDS, j] = seq.output_ids[-1] if seq.output_ids else 0
        dst[POSITIONS, j], dst[LENGTHS, j], dst[KV_ROWS, j] = start, self._kv.lengths[row], row
