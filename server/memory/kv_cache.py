"""The KV cache: preallocated key/value slots handed out in blocks of `block_tokens` tokens.

Block b holds the slots [1 + b*bt, 1 + (b+1)*bt) of every layer and kv head (slot 0 is never
handed out). A request row covers its positions with a list of blocks: the first ones may be
borrowed (a cached prefix another request computed, see `prefix_tree`), the rest the row owns
and gives back with `free_row`. `req_to_slot` maps (request row, position) to a slot so a decode
step finds every running request's keys through one index (read in place by
`attention.decode_attention`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy
import torch

from toppings.server import native


def _rows_fit(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor) -> bool:
    """k, v [T, K, D]: contiguous heads, one row stride, the pool's dtype; pool contiguous."""
    return (
        k.dtype == v.dtype == cache.dtype
        and k.stride(2) == v.stride(2) == 1
        and k.stride(1) == v.stride(1) == k.shape[2]
        and k.stride(0) == v.stride(0)
        and cache.is_contiguous()
    )


def _host_index(index):
    """An index into the host table: a host tensor as its array (numpy reads a one-element
    tensor as a scalar, which would drop the batch dimension)."""
    return index.numpy() if isinstance(index, torch.Tensor) else index


class KVPool:
    """KV tensors [L, K, S+1, D], the block free list and the request-to-slot table."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_requests: int,
        max_len: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        block_tokens: int = 16,
    ):
        """A full pool is an error: making room (evicting cached items) is the memory
        manager's, before it asks (server.memory.manager.MemoryManager.allocate)."""
        self.block_tokens = bt = block_tokens
        self.num_blocks = -(-num_slots // bt)
        self.num_slots = self.num_blocks * bt
        # Head-major: one layer's keys of one kv head are a [S+1, D] matrix, which the decode
        # kernel reads by slot and the torch path gathers with one index_select per layer.
        shape = (num_layers, num_kv_heads, self.num_slots + 1, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, K, S+1, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_bytes = 2 * self.k[:, :, :bt].numel() * self.k.element_size()  # K and V
        self.max_len = max_len
        self._free = list(range(self.num_blocks - 1, -1, -1))  # a stack; the top is the end
        self.req_to_slot = torch.zeros(max_requests, max_len, dtype=torch.int64, device=device)
        # On a CPU the same memory as numpy: a decode step's few reads and writes of the table
        # as numpy indexing, not torch ops (each costs several times more, run cold after a
        # step's weights have streamed through the caches: docs/benchmarks.md).
        self._table = self.req_to_slot.numpy() if self.req_to_slot.device.type == "cpu" else None
        # ... and as a flat memoryview: a decode's one write a row as an item assignment, far
        # cheaper run cold than a numpy fancy assignment (docs/benchmarks.md)
        self._cells = None if self._table is None else memoryview(self._table).cast("B").cast("q")
        self.lengths = [0] * max_requests
        self.row_blocks: list[list[int]] = [[] for _ in range(max_requests)]
        self.num_borrowed = [0] * max_requests  # leading blocks of a row it does not own
        self._free_rows = list(range(max_requests - 1, -1, -1))
        self._offsets = torch.arange(bt, dtype=torch.int64, device=device)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_free_slots(self) -> int:
        return len(self._free) * self.block_tokens

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def new_row(self) -> int:
        """Take a request row (its length starts at 0)."""
        if not self._free_rows:
            raise RuntimeError("no free request row")
        row = self._free_rows.pop()
        self.lengths[row] = 0
        self.row_blocks[row] = []
        self.num_borrowed[row] = 0
        return row

    def free_row(self, row: int, keep: Iterable[int] = ()) -> None:
        """Return a request row and the blocks it owns, except those in `keep` (now cached)."""
        kept = set(keep)
        self.free_blocks(b for b in self.row_blocks[row][self.num_borrowed[row] :] if b not in kept)
        self.row_blocks[row] = []
        self.lengths[row] = 0
        self._free_rows.append(row)

    def attach_prefix(self, row: int, blocks: list[int]) -> None:
        """Start an empty row with borrowed full blocks (a cached prefix); not freed with it."""
        if self.lengths[row]:
            raise RuntimeError("a prefix is attached to an empty row only")
        self.row_blocks[row] = list(blocks)
        self.num_borrowed[row] = len(blocks)
        n = len(blocks) * self.block_tokens
        if n:
            self.req_to_slot[row, :n] = self.slots_of(blocks)
        self.lengths[row] = n

    def alloc_blocks(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV cache full: {n} blocks asked, {len(self._free)} free")
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return taken

    def free_blocks(self, blocks: Iterable[int]) -> None:
        self._free.extend(blocks)

    def extend(self, row: int, n: int) -> torch.Tensor:
        """Give n more positions to one request. Returns their slots, int64 [n]."""
        start = self.lengths[row]
        if start + n > self.max_len:
            raise RuntimeError(f"request row {row} would exceed {self.max_len} tokens")
        blocks = self.row_blocks[row]
        missing = -(-(start + n) // self.block_tokens) - len(blocks)
        if missing > 0:
            blocks.extend(self.alloc_blocks(missing))
        slots = self.slots_of(blocks)[start : start + n]
        self.req_to_slot[row, start : start + n] = slots
        self.lengths[row] = start + n
        return slots

    def missing_blocks(self, rows: list[int], counts: list[int]) -> int:
        """Blocks these rows need more to take counts[i] more positions each."""
        bt = self.block_tokens
        return sum(max(-(-(self.lengths[r] + n) // bt) - len(self.row_blocks[r]), 0)
                   for r, n in zip(rows, counts))  # fmt: skip

    def reserve(self, rows: list[int], counts: list[int]) -> list[int]:
        """Give rows[i] counts[i] more positions (a step's slots, all or none: raises before
        taking anything when the free blocks are too few). Returns where each one's new
        positions start; their slots are in `req_to_slot` from there."""
        bt = self.block_tokens
        starts = [self.lengths[r] for r in rows]
        for r, b, n in zip(rows, starts, counts):
            if b + n > self.max_len:
                raise RuntimeError(f"request row {r} would exceed {self.max_len} tokens")
        missing = [max(-(-(b + n) // bt) - len(self.row_blocks[r]), 0)
                   for r, b, n in zip(rows, starts, counts)]  # fmt: skip
        taken = self.alloc_blocks(sum(missing))
        for r, m in zip(rows, missing):
            if m:
                self.row_blocks[r].extend(taken[:m])
                del taken[:m]
        ones = [i for i, n in enumerate(counts) if n == 1]  # decodes: one write for all
        if ones:
            rs, cs = [rows[i] for i in ones], [starts[i] for i in ones]
            slots = [1 + self.row_blocks[r][c // bt] * bt + c % bt for r, c in zip(rs, cs)]
            if self._cells is not None:
                for r, c, slot in zip(rs, cs, slots):
                    self._cells[r * self.max_len + c] = slot
            else:
                self.req_to_slot[rs, cs] = torch.tensor(slots, dtype=torch.int64,
                                                        device=self.req_to_slot.device)  # fmt: skip
        for r, b, n in zip(rows, starts, counts):
            if n > 1:
                first, last = b // bt, -(-(b + n) // bt)
                slots = self.slots_of(self.row_blocks[r][first:last])
                self.req_to_slot[r, b : b + n] = slots[b - first * bt : b - first * bt + n]
        for r, n in zip(rows, counts):
            self.lengths[r] += n
        return starts

    def extend_each(self, rows: list[int]) -> torch.Tensor:
        """One more position for each request (a decode step). Returns int64 [B]."""
        bt = self.block_tokens
        need = [r for r in rows if self.lengths[r] == len(self.row_blocks[r]) * bt]
        if need:
            for r, b in zip(need, self.alloc_blocks(len(need))):
                self.row_blocks[r].append(b)
        cols = [self.lengths[r] for r in rows]
        slots = [1 + self.row_blocks[r][c // bt] * bt + c % bt for r, c in zip(rows, cols)]
        out = torch.tensor(slots, dtype=torch.int64, device=self.req_to_slot.device)
        self.req_to_slot[rows, cols] = out
        for r in rows:
            self.lengths[r] += 1
        return out

    def slots_of(self, blocks: list[int]) -> torch.Tensor:
        """Every slot of these blocks in order, int64 [len(blocks) * bt]."""
        b = torch.tensor(blocks, dtype=torch.int64, device=self.req_to_slot.device)
        return (1 + b[:, None] * self.block_tokens + self._offsets).reshape(-1)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values of T tokens. slots int64 [T]; k, v [T, K, D]; in place.

        On a CPU one native copy per layer (`csrc/elementwise.c`): two `index_copy_` calls
        cost far more in dispatch than the few kilobytes they move in a decode step.
        """
        kc, vc = self.k[layer], self.v[layer]  # [K, S+1, D]
        lib = native.library() if kc.device.type == "cpu" else None
        if lib is not None and _rows_fit(k, v, kc) and slots.dtype == torch.int64:
            slots = slots.contiguous()
            failed = lib.kv_write(  # pointers as ints: the argtypes are c_void_p
                k.data_ptr(), v.data_ptr(), k.stride(0), kc.data_ptr(), vc.data_ptr(),
                slots.data_ptr(), k.shape[0], k.shape[1], k.shape[2],
                kc.shape[1], kc.element_size(), torch.get_num_threads(),
            )  # fmt: skip
            if failed:
                raise IndexError("a KV slot lies outside the pool")
            return
        kc.index_copy_(1, slots, k.transpose(0, 1))
        vc.index_copy_(1, slots, v.transpose(0, 1))

    def decode_index(
        self, rows: list[int], lengths: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot index [B, Lmax] of every position of each request, and lengths [B] int64 (the
        rows' lengths now, or `lengths` read earlier: a step planned before more slots were
        reserved).

        Entries of a row past its length are stale: readers mask them by length.
        """
        if lengths is None:
            lengths = [self.lengths[r] for r in rows]
        index = self.decode_table(rows, max(lengths))  # [B, Lmax], a copy
        if self._table is not None:
            return index, torch.from_numpy(numpy.array(lengths, numpy.int64))
        return index, torch.tensor(lengths, dtype=torch.int64, device=self.k.device)

    def decode_table(self, rows, max_length: int) -> torch.Tensor:
        """The slot index [B, max_length] of every position of each of `rows` (int64: a numpy
        array or list where the table is host memory, else a tensor on the pool's device): a
        decode step's `kv_index`, a copy. Entries of a row past its length are stale: readers
        mask them by length."""
        if self._table is not None:
            return torch.from_numpy(self._table[_host_index(rows), :max_length])  # [B, Lmax]
        return self.req_to_slot[rows, :max_length]  # [B, Lmax]

    def slots_into(self, rows: numpy.ndarray, positions: numpy.ndarray, out: numpy.ndarray) -> None:
        """out[i] = the slot of position positions[i] of rows[i] (int64 arrays [B]; in place),
        where the table is host memory (a decode batch's rows, read on the host)."""
        out[:] = self._table[rows, positions]

    def slots_at(self, rows, positions) -> torch.Tensor:
        """The slots of position positions[i] of rows[i], int64 [B] (rows, positions: lists or
        numpy arrays where the table is host memory, else lists or tensors on its device)."""
        if self._table is not None:
            return torch.from_numpy(self._table[_host_index(rows), _host_index(positions)])
        return self.req_to_slot[rows, positions]
