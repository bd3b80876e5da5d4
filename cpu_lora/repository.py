"""Every LoRA adapter of a node in one POSIX shared memory arena, readable by worker processes.

Binary layout of the arena (little endian; offsets in bytes from the start of the arena):

    0     header   HEADER_FMT: magic b"TOPREPO1", version, dtype code (0 float32, 1 bfloat16),
                   num_layers L, max_adapters, entry size, reserved, table offset, data offset,
                   data bytes, then (H_in, H_out) of each projection in LORA_TARGETS order;
                   padded to 128
    128   table    max_adapters entries of ENTRY_FMT (128 bytes), one per slot: state (0 free,
                   1 writing, 2 ready), rank R, targets bitmask (union over layers), name length,
                   scale (float64), name hash (blake2b-64), data offset, data bytes, name (utf-8)
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

One process owns the arena (adds, removes); workers attach and only read. The owner removes an
adapter only when no job uses it: a removed slot's data may be overwritten by the next add.
Names of the same content share one block (`add_alias`): their slots point at the same data,
which is freed with the last of them.
"""

from __future__ import annotations

import hashlib
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
VERSION = 1
HEADER_FMT = "<8sIIIIIIQQQ" + "II" * len(LORA_TARGETS)
HEADER = ArenaHeader(HEADER_FMT, MAGIC, VERSION, "adapter repository")
HEADER_BYTES = 128
ENTRY_FMT = "<IIIIdQQQ80s"
ENTRY_BYTES = struct.calcsize(ENTRY_FMT)
LAYER_FMT = "<IIQ"
LAYER_BYTES = struct.calcsize(LAYER_FMT)
MAX_NAME_BYTES = 80
FREE, WRITING, READY = 0, 1, 2


class RepositoryFullError(RuntimeError):
    """No table slot or no contiguous free range large enough for an adapter."""


def name_hash(name: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little")


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
        self._slots: dict[str, int] = {}
        self._space = FirstFit(self._data_offset, self._data_bytes)
        self._block_users: dict[int, int] = {}  # data offset -> slots reading that block

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
        """Copy an adapter into the arena (converted to the arena dtype); returns its slot.

        Raises RepositoryFullError (no slot or range) or shm.SharedMemoryFull (/dev/shm cannot
        back the block); either leaves the arena as it was."""
        self._check_owner()
        encoded = adapter.name.encode()
        if not 0 < len(encoded) <= MAX_NAME_BYTES:
            raise ValueError(f"adapter name must be 1..{MAX_NAME_BYTES} utf-8 bytes")
        self._check_weights(adapter)
        size = self.block_bytes(adapter)
        with self._lock:
            if adapter.name in self._slots:
                raise ValueError(f"adapter {adapter.name!r} is already in the repository")
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
            self._write_entry(slot, WRITING, adapter, encoded, offset, size, 0)
            targets = self._write_block(adapter, offset)
            self._write_entry(slot, READY, adapter, encoded, offset, size, targets)
            self._slots[adapter.name] = slot
            self._block_users[offset] = 1
        return slot

    def add_alias(self, adapter: AdapterLike, of: str) -> int:
        """Serve `adapter` (the same content as adapter `of`, under another name) from `of`'s
        block: a new slot, no new data. The block is freed when its last name is removed.
        Raises KeyError when `of` is absent, RepositoryFullError when no slot is free."""
        self._check_owner()
        encoded = adapter.name.encode()
        if not 0 < len(encoded) <= MAX_NAME_BYTES:
            raise ValueError(f"adapter name must be 1..{MAX_NAME_BYTES} utf-8 bytes")
        with self._lock:
            if adapter.name in self._slots:
                raise ValueError(f"adapter {adapter.name!r} is already in the repository")
            source = self.entry(self._slots[of])
            slot = next((s for s in range(self.max_adapters) if self._state(s) == FREE), None)
            if slot is None:
                raise RepositoryFullError(f"all {self.max_adapters} adapter slots are in use")
            offset, size = source["data_offset"], source["data_bytes"]
            self._write_entry(slot, READY, adapter, encoded, offset, size, source["targets"])
            self._slots[adapter.name] = slot
            self._block_users[offset] += 1
        return slot

    def remove(self, name: str) -> None:
        """Free an adapter's slot, and its data unless another name shares it (KeyError if
        absent)."""
        self._check_owner()
        with self._lock:
            slot = self._slots.pop(name)
            offset, size = self.entry(slot)["data_offset"], self.entry(slot)["data_bytes"]
            struct.pack_into(
                ENTRY_FMT, self._mm, self._entry_at(slot), FREE, 0, 0, 0, 0.0, 0, 0, 0, b""
            )
            self._block_users[offset] -= 1
            if not self._block_users[offset]:
                del self._block_users[offset]
                self._space.release(offset, size)

    def lookup(self, name: str) -> int | None:
        """Slot of a ready adapter, or None."""
        if self.is_owner:
            return self._slots.get(name)
        encoded = name.encode()
        wanted = name_hash(encoded)
        for slot in range(self.max_adapters):
            e = self.entry(slot)
            if e["state"] == READY and e["name_hash"] == wanted and e["name"] == name:
                return slot
        return None

    def names(self) -> list[str]:
        """Names of the adapters held, by slot."""
        ready = [self.entry(s) for s in range(self.max_adapters) if self._state(s) == READY]
        return [e["name"] for e in ready]

    def rank(self, slot: int) -> int:
        """Rank of the adapter in a slot (0 when free)."""
        return struct.unpack_from("<I", self._mm, self._entry_at(slot) + 4)[0]

    def entry(self, slot: int) -> dict:
        """The table entry of a slot as a dict (state, rank, targets, scale, name, ...)."""
        state, rank, targets, name_len, scale, h, off, size, raw = struct.unpack_from(
            ENTRY_FMT, self._mm, self._entry_at(slot)
        )
        return {
            "state": state,
            "rank": rank,
            "targets": targets,
            "scale": scale,
            "name_hash": h,
            "data_offset": off,
            "data_bytes": size,
            "name": raw[:name_len].decode(),
        }

    def layer_tensors(self, slot: int, layer: int) -> tuple[int, float, dict]:
        """(rank, scale, {module: (A [R, H_in], B^T [R, H_out])}) of one layer: shared views.

        Raises KeyError when the slot holds no ready adapter.
        """
        state, rank, _, _, scale, _, offset, _, _ = struct.unpack_from(
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

    def _write_entry(self, slot, state, adapter, encoded, offset, size, targets) -> None:
        struct.pack_into(
            ENTRY_FMT,
            self._mm,
            self._entry_at(slot),
            state,
            adapter.rank,
            targets,
            len(encoded),
            float(adapter.scale),
            name_hash(encoded),
            offset,
            size,
            encoded,
        )

    def _entry_at(self, slot: int) -> int:
        if not 0 <= slot < self.max_adapters:
            raise IndexError(f"slot {slot} out of range [0, {self.max_adapters})")
        return self._table_offset + slot * ENTRY_BYTES

    def _state(self, slot: int) -> int:
        return struct.unpack_from("<I", self._mm, self._entry_at(slot))[0]
