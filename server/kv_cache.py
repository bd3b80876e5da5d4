"""Token-level KV cache in the style of LightLLM: one preallocated slot per token, per layer.

Slots are handed out per token and returned when a request ends; a request's slots need not be
contiguous. `req_to_slot` maps (request row, position) to a slot so a decode step finds every
running request's keys through one index (read in place by `attention.decode_attention`). Slot 0
is never handed out.
"""

from __future__ import annotations

import torch


class KVPool:
    """KV tensors [L, K, S, D] plus the slot allocator and the request-to-slot table."""

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
    ):
        # Head-major: one layer's keys of one kv head are a [S+1, D] matrix, which the decode
        # kernel reads by slot and the torch path gathers with one index_select per layer.
        shape = (num_layers, num_kv_heads, num_slots + 1, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, K, S+1, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_len = max_len
        # A stack of free slots; the top of the stack is _free[:_num_free][-1].
        self._free = torch.arange(num_slots, 0, -1, dtype=torch.int64, device=device)
        self._num_free = num_slots
        self.req_to_slot = torch.zeros(max_requests, max_len, dtype=torch.int64, device=device)
        self.lengths = [0] * max_requests
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return self._num_free

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def new_row(self) -> int:
        """Take a request row (its length starts at 0)."""
        if not self._free_rows:
            raise RuntimeError("no free request row")
        row = self._free_rows.pop()
        self.lengths[row] = 0
        return row

    def free_row(self, row: int) -> None:
        """Return a request row and every slot it holds."""
        n = self.lengths[row]
        if n:
            self._push(self.req_to_slot[row, :n])
        self.lengths[row] = 0
        self._free_rows.append(row)

    def extend(self, row: int, n: int) -> torch.Tensor:
        """Allocate n slots at the end of one request. Returns the slots, int64 [n]."""
        start = self.lengths[row]
        if start + n > self.max_len:
            raise RuntimeError(f"request row {row} would exceed {self.max_len} tokens")
        slots = self._pop(n)
        self.req_to_slot[row, start : start + n] = slots
        self.lengths[row] = start + n
        return slots

    def extend_each(self, rows: list[int]) -> torch.Tensor:
        """Allocate one slot at the end of each request (a decode step). Returns int64 [B]."""
        slots = self._pop(len(rows))
        cols = [self.lengths[r] for r in rows]
        self.req_to_slot[rows, cols] = slots
        for r in rows:
            self.lengths[r] += 1
        return slots

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values of T tokens. slots int64 [T]; k, v [T, K, D]; in place."""
        self.k[layer].index_copy_(1, slots, k.transpose(0, 1))
        self.v[layer].index_copy_(1, slots, v.transpose(0, 1))

    def decode_index(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot index [B, Lmax] of every position of each request, and lengths [B] int64.

        Entries of a row past its length are stale: readers mask them by length.
        """
        lengths = torch.tensor([self.lengths[r] for r in rows], dtype=torch.int64)
        index = self.req_to_slot[rows, : int(lengths.max())]  # [B, Lmax]
        return index, lengths.to(self.k.device)

    def _pop(self, n: int) -> torch.Tensor:
        if n > self._num_free:
            raise RuntimeError(f"KV cache full: {n} slots asked, {self._num_free} free")
        self._num_free -= n
        return self._free[self._num_free : self._num_free + n].clone()

    def _push(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        self._free[self._num_free : self._num_free + n] = slots
        self._num_free += n
