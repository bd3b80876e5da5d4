"""The events and their wire form: vLLM's `KVEventBatch` of `BlockStored` / `BlockRemoved` /
`AllBlocksCleared` (vllm/distributed/kv_events.py), msgpack-encoded as msgspec encodes vLLM's
structs (tagged by class name, fields left out where they hold their default).

Two layouts, `--kv-events-encoding`:
- `array` (default): every struct positional, the tag first in an event (`array_like=True`, the
  layout vLLM sent before vllm#42892 and that every consumer decodes):
  batch `[ts, [event, ...], data_parallel_rank]`, event `["BlockStored", block_hashes, ...]`.
- `map`: the batch positional, each event a map with its tag under "type" (vLLM since #42892).

Field order is vLLM's: BlockStored(block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name, extra_keys=None, ...), BlockRemoved(block_hashes, medium, ...).
We never send `extra_keys`: the adapter is in `lora_name` (and in the hash, block_hash.py).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import msgpack

MEDIUM_DEVICE = "GPU"  # vLLM's name of the engine's own KV pool (ours on any --device)
MEDIUM_HOST = "CPU"  # the host tier (vLLM's offloading connector's name for host memory)


class EventEncoding(enum.Enum):
    """How events are laid out on the wire (see the module docstring)."""

    ARRAY = "array"
    MAP = "map"


ENCODINGS = tuple(e.value for e in EventEncoding)


@dataclass(frozen=True)
class BlockStored:
    """Full blocks, in prompt order, now held in `medium`; the first one follows the block
    hashed `parent_block_hash` (None: a prompt's first block)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # vLLM keeps it for old consumers; the hash uses lora_name
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks no longer held in `medium`."""

    block_hashes: list[int]
    medium: str | None


@dataclass(frozen=True)
class AllBlocksCleared:
    """Forget every block of this server (sent at start and when events were lost)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


def _fields(event: Event) -> list[tuple[str, object, object]]:
    """(name, value, default) of each field, in declaration order."""
    out = []
    for f in dataclasses.fields(event):
        default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
        out.append((f.name, getattr(event, f.name), default))
    return out


def _event_wire(event: Event, encoding: EventEncoding) -> list | dict:
    fields = _fields(event)
    tag = type(event).__name__
    if encoding is EventEncoding.MAP:
        return {"type": tag, **{n: v for n, v, d in fields if v != d}}
    # Positional: only trailing fields at their default may be left out.
    while fields and fields[-1][1] == fields[-1][2]:
        fields.pop()
    return [tag, *(v for _, v, _ in fields)]


def encode_batch(
    ts: float, events: list[Event], data_parallel_rank: int, encoding: EventEncoding
) -> bytes:
    """One `KVEventBatch` as msgpack bytes (the payload frame of a published message)."""
    wire = [ts, [_event_wire(e, encoding) for e in events], data_parallel_rank]
    return msgpack.packb(wire, use_bin_type=True)
