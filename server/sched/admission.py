"""The scheduler's side of admission: what a queue policy may ask while it forms one batch.

One `AdmissionGate` per iteration. `try_admit` checks a request against what is free now (batch
rows, the memory not yet promised (memory/manager.py), the prefill token budget, adapter memory,
the LoRA mode) and, when it fits, takes its adapter reference (room made first, by the node's
one owner of eviction; the adapter's allocation then only allocates), its KV row, its cached
prefix and the reservation of the rest. `squash` undoes all of that for a running request,
which then waits again (Chameleon's squash of a bypasser).

The gate sees its collaborators through the `Memory` and `Adapters` protocols below (the
engine's MemoryManager and AdapterManager, or a simulator's pure-Python stand-ins) and the few
numbers of `GateLimits` (gate_limits.py); it imports nothing of the model. Adapters are the
requests' `AdapterRef`s, which the gate only passes on and keys on (by id).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.request import GenerationRequest, RequestError
from toppings.server.requests.sequence import Sequence
from toppings.server.sched.gate_limits import GateLimits
from toppings.server.sched.queueing import Verdict

if TYPE_CHECKING:
    from toppings.server.memory.manager import MemoryManager


class KVShape(Protocol):
    """The sizes of the KV pool admission counts in."""

    block_tokens: int
    block_bytes: int
    num_blocks: int
    num_slots: int


class Memory(Protocol):
    """The node's memory as admission and release use it (server/memory/manager.py)."""

    kv: KVShape

    def match(self, seq: Sequence) -> list:
        """The cached prefix (tree nodes) `seq` would reuse."""

    def kv_need(self, seq: Sequence, path: list) -> int:
        """Blocks admitting `seq` with this prefix adds to the committed count."""

    def adapter_need(self, adapter: AdapterRef | None, num_bytes: int) -> int:
        """Blocks admitting a request of `adapter` adds to the committed count."""

    def fits(self, extra_blocks: int) -> bool: ...

    def committed(self) -> int:
        """Blocks that cannot be reclaimed now."""

    def adapter_tokens(self, num_bytes: int) -> int:
        """KV tokens' worth of memory an adapter of num_bytes takes (0: adapter memory is not
        scarce under this layout)."""

    def total_tokens(self) -> int:
        """All the memory requests compete for, in KV tokens."""

    def free_tokens(self) -> int:
        """KV tokens not yet promised."""

    def admit(self, seq: Sequence, path: list, now: float) -> Any:
        """Take a row, the prefix and the reservation; returns the hold (`.reserved` blocks)."""

    def release(self, seq: Sequence, keep_kv: bool, now: float) -> None:
        """Give back what `seq.kv_hold` holds and clear it."""

    def allocate(self, seqs: list[Sequence], tokens: list[int]) -> list[int] | None:
        """Reserve the KV slots of a step, seqs[i]'s next tokens[i] tokens, all or none;
        returns where each one's tokens start (its computed-token count), or None when the
        blocks cannot be had."""

    def tick(self, now: float) -> None: ...

    def after_prefill(self, seqs: list, seconds: float, num_tokens: int, now: float) -> None: ...

    def after_decode(self, batch_size: int, now: float) -> None: ...


class Adapters(Protocol):
    """The adapters as admission and release use them (server/adapters/manager.py)."""

    def registered(self) -> list[AdapterRef]:
        """Every registered adapter."""

    def make_room(self, adapter: AdapterRef, queued: frozenset[AdapterRef]) -> bool:
        """Evict (the one owner of eviction) until the adapter fits, `queued` ones last."""

    def acquire(self, adapter: AdapterRef) -> Any | None:
        """A reference on the adapter (its cache entry), or None; only allocates."""

    def release(self, adapter: AdapterRef, entry: Any) -> None:
        """Drop a request's reference `entry` (from `acquire` or `serve_on_host`)."""

    def serve_on_host(self, adapter: AdapterRef) -> Any | None:
        """A reference that computes the adapter on the host, for a request that found no
        device room (server/adapters/host_served.py); None where the LoRA mode waits for room."""

    def promote(self, queued: Callable[[], frozenset[AdapterRef]]) -> None:
        """Move requests served on the host to the device where room is there."""

    def may_start(self, entry: Any | None) -> bool: ...

    def bytes_of(self, adapter: AdapterRef | None) -> int: ...

    def prefetch(self, adapters: list[AdapterRef], queued: frozenset[AdapterRef]) -> None: ...

    def fits_if_released(self, adapter: AdapterRef | None, held: AdapterRef | None) -> bool: ...


def check_request(
    request: GenerationRequest,
    vocab_size: int,
    max_model_len: int,
    memory: MemoryManager,
    adapters: Adapters,
) -> None:
    """Raise RequestError when `request` can never be served: an empty prompt, a token outside
    the vocabulary, a prompt plus max_new_tokens beyond the context, or more memory blocks (its
    worst-case KV and, where adapters take pool blocks, its adapter) than the whole pool has,
    the most admission could ever promise it. (An adapter unloaded since the request was
    resolved is the engine's 404: its registry counts the request in flight atomically.)"""
    ids = request.prompt_ids
    if not ids:
        raise RequestError("the prompt is empty")
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in ids):
        raise RequestError(f"token ids must be integers in [0, {vocab_size})")
    need = len(ids) + request.params.max_new_tokens
    if need > max_model_len:
        raise RequestError(
            f"prompt ({len(ids)} tokens) plus max_new_tokens "
            f"({request.params.max_new_tokens}) exceeds the context of {max_model_len} tokens"
        )
    blocks = memory.blocks_for(need)
    if memory.shared and request.adapter is not None:
        blocks += memory.blocks_for_bytes(adapters.bytes_of(request.adapter))
    kv = memory.kv
    if blocks > kv.num_blocks:
        raise RequestError(
            f"request needs {blocks} memory blocks of {kv.block_tokens} tokens (KV for "
            f"{need} tokens and its adapter); the server has {kv.num_blocks}"
        )


def release(seq: Sequence, memory: Memory, adapters: Adapters, keep_kv: bool, now: float) -> None:
    """Give back a request's KV row, reservation and prefix-tree nodes (its computed blocks stay
    cached unless keep_kv is False: after an error) and its adapter reference."""
    if seq.kv_hold is not None:
        memory.release(seq, keep_kv, now)
    if seq.cache_entry is not None:
        adapters.release(seq.request.adapter, seq.cache_entry)
        seq.cache_entry = None


def queued_adapters(waiting: Iterable[Sequence]) -> frozenset[AdapterRef]:
    """The adapters the waiting requests name (eviction spares them while it can)."""
    return frozenset(s.request.adapter for s in waiting if s.request.adapter is not None)


class AdmissionGate:
    """Admission checks of one scheduler iteration (the engine thread, under its lock)."""

    def __init__(
        self,
        running: list[Sequence],
        waiting: Iterable[Sequence],
        memory: Memory,
        adapters: Adapters,
        limits: GateLimits,
        clock: Callable[[], float],
        planned: Mapping[Sequence, int] | None = None,
        waits_turn: Callable[[Sequence], bool] | None = None,
    ):
        """planned: the tokens of the step already planned per request (1 for each running
        decode, with chunked prefill a chunk for each prompt being prefilled); waits_turn:
        whether a waiting prompt is one the step's room is not kept for (chunked prefill's
        partial prefills: server.sched.scheduler), refused `Verdict.WAITS_TURN` before it
        takes anything."""
        self.running, self.waiting = running, waiting
        self.waits_turn = waits_turn
        self.memory, self.adapters, self.limits, self.clock = memory, adapters, limits, clock
        self.admitted: list[Sequence] = []
        self.prefill_tokens = 0
        # every request computing in this step -> its tokens (planned, then admitted)
        self.chunks: dict[Sequence, int] = dict(planned or {})
        self.step_tokens = sum(self.cost(s, n) for s, n in self.chunks.items())  # of the budget
        self._queued: frozenset[AdapterRef] | None = None
        # What the policy asked about last, a request or an adapter: when forming the batch
        # raises, the scheduler fails that one alone (Scheduler.schedule).
        self.asked: Sequence | AdapterRef | None = None

    def try_admit(self, seq: Sequence, max_chunk: int | None = None) -> Verdict:
        self.asked = seq
        mem, lora, limits = self.memory, self.adapters, self.limits
        if len(self.running) + len(self.admitted) >= limits.max_batch_size:
            return Verdict.BATCH_FULL
        if self.waits_turn is not None and self.waits_turn(seq):
            return Verdict.WAITS_TURN
        adapter = seq.request.adapter
        path = mem.match(seq)
        computed = seq.prefill_len - len(path) * mem.kv.block_tokens
        need = mem.kv_need(seq, path)
        if seq.cache_entry is None:
            need += mem.adapter_need(adapter, lora.bytes_of(adapter))
        if not mem.fits(need) or not self._budget_allows(seq, computed, max_chunk):
            return Verdict.NO_ROOM
        if adapter is not None and seq.cache_entry is None:
            # Admission makes room (one owner decides what leaves), then the cache allocates.
            if lora.make_room(adapter, self.queued()):
                seq.cache_entry = lora.acquire(adapter)
            else:  # none while the running requests hold what is there (or a load runs)
                seq.cache_entry = lora.serve_on_host(adapter)  # cpu-assisted: no wait
            if seq.cache_entry is None:
                return Verdict.NO_ADAPTER_MEMORY  # none until a running request ends
            path = mem.match(seq)  # the load may have taken cached blocks
            computed = seq.prefill_len - len(path) * mem.kv.block_tokens
            if not mem.fits(mem.kv_need(seq, path)):
                # Holding the adapter while waiting for KV room could pin the pool full of
                # adapters no one runs: let it go (it stays cached while memory allows).
                lora.release(adapter, seq.cache_entry)
                seq.cache_entry = None
                return Verdict.NO_ROOM
        if not lora.may_start(seq.cache_entry):
            return Verdict.NOT_READY
        seq.kv_hold = mem.admit(seq, path, self.clock())
        seq.num_prefilled = seq.prefill_len - computed
        self.prefill_tokens += computed
        chunk = computed  # chunked prefill off: the whole prompt, in one step
        if limits.max_step_tokens is not None:
            left = limits.chunk_within(
                self._chunk_left(max_chunk), seq.num_prefilled, seq.scores_prompt
            )
            chunk = min(computed, left)
        self.chunks[seq] = chunk
        self.step_tokens += self.cost(seq, chunk)
        self.admitted.append(seq)
        return Verdict.ADMITTED

    def cost(self, seq: Sequence, tokens: int) -> int:
        """Budget tokens of `seq` computing `tokens` this step (a decode: one)."""
        if seq.is_prefilled:
            return tokens
        return self.limits.chunk_cost(tokens, seq.num_prefilled, seq.scores_prompt)

    def holds_adapter(self, seq: Sequence) -> bool:
        return seq.cache_entry is not None

    def _step_left(self) -> int:
        return self.limits.max_step_tokens - self.step_tokens

    def _chunk_left(self, max_chunk: int | None) -> int:
        left = self._step_left()
        return left if max_chunk is None else min(left, max_chunk)

    def step_budget(self) -> int | None:
        return self.limits.max_step_tokens

    def step_left(self) -> int:
        return 0 if self.limits.max_step_tokens is None else self._step_left()

    def planned(self, seq: Sequence) -> int:
        return self.chunks.get(seq, 0)

    def _budget_allows(self, seq: Sequence, computed: int, max_chunk: int | None = None) -> bool:
        """Whether the step's token budget takes `seq`'s prompt (its `computed` tokens): without
        chunking, whole prompts up to max_prefill_tokens (the first one always); with it, any
        chunk while the budget lasts (a request scoring its prompt too: its chunks are scored
        one by one). `max_chunk` (a policy's quota) bounds the chunk further."""
        limits = self.limits
        if limits.max_step_tokens is None:
            return not self.admitted or self.prefill_tokens + computed <= limits.max_prefill_tokens
        return self._chunk_left(max_chunk) > 0

    def queued(self) -> frozenset[AdapterRef]:
        """Adapters of the waiting requests (eviction spares them while it can)."""
        if self._queued is None:
            self._queued = queued_adapters(self.waiting)
        return self._queued

    def squash(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.step_tokens -= self.cost(seq, self.chunks.pop(seq, 0))  # it computes nothing now
        release(seq, self.memory, self.adapters, True, self.clock())
        seq.resume()

    def fits_if_released(self, waiting: Sequence, running: Sequence) -> bool:
        self.asked = waiting
        return self.adapters.fits_if_released(waiting.request.adapter, running.request.adapter)

    def adapter_tokens(self, adapter: AdapterRef | None) -> int:
        """KV tokens' worth of memory the adapter takes (0 while adapter memory is not scarce:
        a static layout without an adapter budget, or a pool that does not charge adapters)."""
        self.asked = adapter
        if adapter is None:
            return 0
        return self.memory.adapter_tokens(self.adapters.bytes_of(adapter))

    def adapter_size(self, adapter: AdapterRef | None) -> float:
        """The adapter's bytes; the base model counts as the smallest adapter (its requests
        are sized by their lengths, not put all in the first queue)."""
        self.asked = adapter
        if adapter is not None:
            return float(self.adapters.bytes_of(adapter))
        sizes = [self.adapters.bytes_of(a) for a in self.adapters.registered()]
        return float(min(sizes, default=1))

    def max_adapter_size(self) -> float:
        sizes = [self.adapters.bytes_of(a) for a in self.adapters.registered()]
        return float(max(sizes, default=1))

    def total_tokens(self) -> int:
        return self.memory.total_tokens()

    def prefetch(self, adapters: list[AdapterRef]) -> None:
        self.adapters.prefetch(adapters, self.queued())

    def free_tokens(self) -> int:
        return self.memory.free_tokens()

    def free_rows(self) -> int:
        return self.limits.max_batch_size - len(self.running) - len(self.admitted)

    def need_tokens(self, seq: Sequence) -> int:
        self.asked = seq
        mem, adapter = self.memory, seq.request.adapter
        need = mem.kv_need(seq, mem.match(seq))
        if seq.cache_entry is None:
            need += mem.adapter_need(adapter, self.adapters.bytes_of(adapter))
        return need * mem.kv.block_tokens

    def release_tokens(self, seq: Sequence) -> int:
        hold = seq.kv_hold
        return hold.reserved * self.memory.kv.block_tokens if hold is not None else 0
