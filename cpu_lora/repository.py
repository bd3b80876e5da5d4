"""Every LoRA adapter of a node in one POSIX shared memory arena, readable by worker processes.

Binary layout of the arena (little endian; offsets in bytes from the start of the arena):

    0     header   HEADER_FMT: magic b"TOPREPO1", version, dtype code (0 float32, 1 bfloat16),
                   num_layers L, max_adapters, entry size, reserved, table offset, data offset,
                   data bytes, then (H_in, H_out) of each projection in LORA_TARGETS order;
                   padded to 128
    128   table    max_adapters entries of ENTRY_FMT (48 bytes), one per slot: state (0 free,
                   1 writing, 2 ready), rank R, targets bitmask (union over layers), reserved,
                   scale (float64), adapter id, data offset, data bytes
    data  area     one block per adapter at its entry's data offset (first-fit, 64-aligned):
                   L layer records of LAYER_FMT (modules bitmask of that layer, offset of the
                   layer's tensors from the block start), then per layer, per module present in
                   LORA_TARGETS order, 64-aligned: A [R, H_in] then B^T [R, H_out], contiguous.

Tensors are stored in one dtype for the whole arena, chosen at creation. float32 is the
default: the CPU deltas then match the float32 reference (and an engine running in float32) to
rounding. bfloat16 halves the memory and, on a CPU with bf16 matmul units (AVX512-BF16, AMX),
makes the workers several times faster (bench/results/cpu_lora_parallel.json, pool_bf16_vs_fp32)
at about 3 significant digits in the delta: the choice for a bfloat16 model.

The data area is sparse: /dev/shm backs only the header and table at creation, and each
adapter's block when it is added (`shm.reserve_shm` before the block is written), so a large
arena costs what it holds and a full /dev/shm fails that add with `shm.SharedMemoryFull`.

Adapters are keyed by their integer id (`AdapterLike.id`: in a server, the weights id of the
registrations that compute with them), never by name: an adapter unloaded and loaded again under
its name has another id, so a job can never read the first one's block for the second. Names
that share one content share one id (the server keeps one copy), hence one slot and one block.

One process owns the arena (adds, removes); workers attach and only read. The owner removes an
adapter only when no job uses it: a removed slot's data may be overwritten by the next add.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterable

import torch

from toppings.cpu_lora import shm
from toppings.cpu_lora.allocator import FirstFit
from toppings.cpu_lora.arena_header import ArenaHeader, align
from toppings.cpu_lora.shapes import (
    DTYPE_CODES,
    LORA_TARGETS,
    AdapterLike,
    ModelShapes,
    all_shapes,
)

MAGIC = b"TOPREPO1"
VERSION = 2  # 2: entries keyed by adapter id (1 keyed them by name)
HEADER_FMT = "<8sIIIIIIQQQ" + "II" * len(LORA_TARGETS)
HEADER = ArenaHeader(HEADER_FMT, MAGIC, VERSION, "adapter repository")
HEADER_BYTES = 128
ENTRY_FMT = "<IIIIdQQQ"
ENTRY_BYTES = struct.calcsize(ENTRY_FMT)
LAYER_FMT = "<IIQ"
LAYER_BYTES = struct.calcsize(LAYER_FMT)
FREE, WRITING, READY = 0, 1, 2


class RepositoryFullError(RuntimeError):
    """No table slot or no contiguous free range large enough for an adapter."""


class HostRepository:
    """Adapters in shared memory; `tensors()` gives zero-copy torch views of A and B^T."""

    def __init__(self, name: str, mapping, owner: bool) -> None:
        self.name, self._mm, self.is_owner = name, mapping, owner
        self.dtype, fields = HEADER.read(mapping, name)
        self.num_layers, self.max_adapters = fields[0], fields[1]
        self._table_offset, self._data_offset, self._data_bytes = fields[4:7]
        flat = fields[7:]
        self.shapes = {m: (flat[2 * i], flat[2 * i + 1]) for i, m in enumerate(LORA_TARGETS)}
        self._item = torch.empty((), dtype=self.dtype).element_size()
        self._elems = torch.frombuffer(mapping, dtype=self.dtype)  # the whole arena, typed
        self._lock = threading.Lock()
        self._slots: dict[int, int] = {}  # adapter id -> slot (the owner's index of the table)
        self._space = FirstFit(self._data_offset, self._data_bytes)

    @classmethod
    def create(
        cls,
        model: ModelShapes,
        capacity_bytes: int,
        max_adapters: int = 256,
        dtype: torch.dtype = torch.float32,
    ) -> HostRepository:
        """A new arena whose data area holds `capacity_bytes` of adapter blocks."""
        if dtype not in DTYPE_CODES:
            raise ValueError(f"dtype must be one of {list(DTYPE_CODES)}, got {dtype}")
        data_offset = align(HEADER_BYTES + max_adapters * ENTRY_BYTES, 4096)
        capacity = align(capacity_bytes)
        name = shm.new_name("repo")
        mapping = shm.create_shm(name, data_offset + capacity, reserve=data_offset)
        flat = [d for pair in all_shapes(model) for d in pair]
        HEADER.write(
            mapping,
            dtype,
            model.num_layers,
            max_adapters,
            ENTRY_BYTES,
            0,
            HEADER_BYTES,
            data_offset,
            capacity,
            *flat,
        )
        return cls(name, mapping, owner=True)

    @classmethod
    def attach(cls, name: str) -> HostRepository:
        """Map an existing arena read-only in spirit: lookups and tensor views, no add/remove."""
        return cls(name, shm.attach_shm(name), owner=False)

    def block_bytes(self, adapter: AdapterLike) -> int:
        """Bytes of the data block `adapter` takes in this arena."""
        return self.block_bytes_for(adapter.rank, adapter.weights)

    def block_bytes_for(self, rank: int, pairs: Iterable[tuple[int, str]]) -> int:
        """Bytes of the data block of an adapter of `rank` on these (layer_idx, module) pairs:
        what it is charged here, known from its shapes before any tensor is read."""
        size = align(self.num_layers * LAYER_BYTES)
        for _, module in pairs:
            h_in, h_out = self.shapes[module]
            size += align(rank * (h_in + h_out) * self._item)
        return size

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the data area: the most all adapters' blocks together can take."""
        return self._data_bytes

    def add(self, adapter: AdapterLike) -> int:
        """Copy an adapter into the arena under `adapter.id` (converted to the arena dtype);
        returns its slot.

        Raises RepositoryFullError (no slot or range) or shm.SharedMemoryFull (/dev/shm cannot
        back the block); either leaves the arena as it was."""
        self._check_owner()
        if not 0 < adapter.id < 2**64:
            raise ValueError(f"adapter id {adapter.id} is not a positive 64-bit integer")
        self._check_weights(adapter)
        size = self.block_bytes(adapter)
        with self._lock:
            if adapter.id in self._slots:
                raise ValueError(f"adapter id {adapter.id} is already in the repository")
            slot = next((s for s in range(self.max_adapters) if self._state(s) == FREE), None)
            if slot is None:
                raise RepositoryFullError(f"all {self.max_adapters} adapter slots are in use")
            offset = self._space.allocate(size)
            if offset is None:
                raise RepositoryFullError(
                    f"no room for adapter {adapter.name!r} ({size} bytes); {self.free_bytes} "
                    f"bytes free in {self._space.num_ranges} ranges of {self._data_bytes}"
                )
            try:
                shm.reserve_shm(self.name, offset, size)
            except BaseException:
                self._space.release(offset, size)
                raise
            self._write_entry(slot, WRITING, adapter, offset, size, 0)
            targets = self._write_block(adapter, offset)
            self._write_entry(slot, READY, adapter, offset, size, targets)
            self._slots[adapter.id] = slot
        return slot

    def remove(self, adapter_id: int) -> None:
        """Free the slot and the data of the adapter of this id (KeyError if absent)."""
        self._check_owner()
        with self._lock:
            slot = self._slots.pop(adapter_id)
            offset, size = self.entry(slot)["data_offset"], self.entry(slot)["data_bytes"]
            struct.pack_into(ENTRY_FMT, self._mm, self._entry_at(slot), FREE, 0, 0, 0, 0.0, 0, 0, 0)
            self._space.release(offset, size)

    def lookup(self, adapter_id: int) -> int | None:
        """Slot of the ready adapter of this id, or None."""
        if self.is_owner:
            return self._slots.get(adapter_id)
        for slot in range(self.max_adapters):
            e = self.entry(slot)
            if e["state"] == READY and e["adapter_id"] == adapter_id:
                return slot
        return None

    def ids(self) -> list[int]:
        """Ids of the adapters held, by slot."""
        ready = [self.entry(s) for s in range(self.max_adapters) if self._state(s) == READY]
        return [e["adapter_id"] for e in ready]

    def rank(self, slot: int) -> int:
        """Rank of the adapter in a slot (0 when free)."""
        return struct.unpack_from("<I", self._mm, self._entry_at(slot) + 4)[0]

    def entry(self, slot: int) -> dict:
        """The table entry of a slot as a dict (state, rank, targets, scale, adapter_id, ...)."""
        state, rank, targets, _, scale, adapter_id, off, size = struct.unpack_from(
            ENTRY_FMT, self._mm, self._entry_at(slot)
        )
        return {
            "state": state,
            "rank": rank,
            "targets": targets,
            "scale": scale,
            "adapter_id": adapter_id,
            "data_offset": off,
            "data_bytes": size,
        }

    def layer_tensors(self, slot: int, layer: int) -> tuple[int, float, dict]:
        """(rank, scale, {module: (A [R, H_in], B^T [R, H_out])}) of one layer: shared views.

        Raises KeyError when the slot holds no ready adapter.
        """
        state, rank, _, _, scale, _, offset, _ = struct.unpack_from(
            ENTRY_FMT, self._mm, self._entry_at(slot)
        )
        if state != READY:
            raise KeyError(f"adapter slot {slot} holds no adapter")
        mask, _, rel = struct.unpack_from(LAYER_FMT, self._mm, offset + layer * LAYER_BYTES)
        at, views = offset + rel, {}
        for i, module in enumerate(LORA_TARGETS):
            if mask >> i & 1:
                h_in, h_out = self.shapes[module]
                e = at // self._item
                a = self._elems[e : e + rank * h_in].view(rank, h_in)
                bt = self._elems[e + rank * h_in : e + rank * (h_in + h_out)].view(rank, h_out)
                views[module] = (a, bt)
                at += align(rank * (h_in + h_out) * self._item)
        return rank, scale, views

    def tensors(self, slot: int, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [R, H_in], B^T [R, H_out]) views over the shared arena, in the arena dtype.

        The views stay valid until the arena is unlinked and the last view is dropped.
        Raises KeyError when the adapter does not target that (layer, module).
        """
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        views = self.layer_tensors(slot, layer)[2]
        if module not in views:
            raise KeyError(f"adapter slot {slot} has no LoRA on layer {layer} {module}")
        return views[module]

    @property
    def free_bytes(self) -> int:
        return self._space.free_bytes

    def close(self) -> None:
        """Drop this process's mapping (the owner also unlinks the name)."""
        if self.is_owner:
            self.unlink()
        # The mapping is not closed by hand: views handed out keep it alive until they go.
        self._elems = None
        self._mm = None

    def unlink(self) -> None:
        shm.unlink_shm(self.name)

    def _check_owner(self) -> None:
        if not self.is_owner:
            raise PermissionError("only the process that created the repository may change it")

    def _check_weights(self, adapter: AdapterLike) -> None:
        if adapter.rank <= 0 or not adapter.weights:
            raise ValueError(f"adapter {adapter.name!r} has no LoRA weights")
        for (layer, module), (a, b) in adapter.weights.items():
            h_in, h_out = self.shapes[module]
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"adapter {adapter.name!r}: layer {layer} out of range")
            want = ((adapter.rank, h_in), (h_out, adapter.rank))
            if (tuple(a.shape), tuple(b.shape)) != want:
                raise ValueError(
                    f"adapter {adapter.name!r} layer {layer} {module}: A {list(a.shape)} and "
                    f"B {list(b.shape)}, expected {list(want[0])} and {list(want[1])}"
                )

    def _write_block(self, adapter: AdapterLike, offset: int) -> int:
        """Write the layer records and tensors at `offset`; returns the union targets bitmask."""
        rank, union = adapter.rank, 0
        at = offset + align(self.num_layers * LAYER_BYTES)
        for layer in range(self.num_layers):
            mask = 0
            for i, module in enumerate(LORA_TARGETS):
                if (layer, module) in adapter.weights:
                    mask |= 1 << i
            struct.pack_into(
                LAYER_FMT, self._mm, offset + layer * LAYER_BYTES, mask, 0, at - offset
            )
            union |= mask
            for module in LORA_TARGETS:
                if (layer, module) not in adapter.weights:
                    continue
                a, b = adapter.weights[(layer, module)]
                h_in, h_out = self.shapes[module]
                e = at // self._item
                self._elems[e : e + rank * h_in].view(rank, h_in).copy_(a)
                self._elems[e + rank * h_in : e + rank * (h_in + h_out)].view(rank, h_out).copy_(
                    b.T
                )
                at += align(rank * (h_in + h_out) * self._item)
        return union

    def _write_entry(self, slot, state, adapter, offset, size, targets) -> None:
        struct.pack_into(
            ENTRY_FMT,
            self._mm,
            self._entry_at(slot),
            state,
            adapter.rank,
            targets,
            0,
            float(adapter.scale),
            adapter.id,
            offset,
            size,
        )

    def _entry_at(self, slot: int) -> int:
        if not 0 <= slot < self.max_adapters:
            raise IndexError(f"slot {slot} out of range [0, {self.max_adapters})")
        return self._table_offset + slot * ENTRY_BYTES

    def _state(self, slot: int) -> int:
        return struct.unpack_from("<I", self._mm, self._entry_at(slot))[0]
