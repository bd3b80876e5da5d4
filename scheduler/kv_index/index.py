"""The index: per server, the block hashes it holds and in which medium, kept from its event
batches applied in sequence order.

A batch is applied only when its number is the next one expected from that server; an older
one (a replay overlapping what arrived live) is skipped, a newer one is a gap: `apply` returns
the first number missing, for the subscriber to ask the server's replay socket. When the
server no longer keeps the missing batches, `skip_to` accepts the loss: that server's blocks
are forgotten (the index then under-counts it, never over-counts) and the stream resumes at
what is there; the server's next resync or restart (AllBlocksCleared) makes it exact again.
`exact` says which: a server's entry is exact from its first AllBlocksCleared (every server
sends one first, and again with each resync) until a loss. `forget` drops a server (removed,
or restarted: its numbering starts again).

Decodes both wire layouts vLLM has used (docs/production.md): events as positional arrays
with the tag first, or as maps with the tag under "type".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack

DEFAULT_MEDIUM = "GPU"
_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
           "medium", "lora_name")  # fmt: skip
_REMOVED = ("block_hashes", "medium")


@dataclass
class ServerBlocks:
    """What one server holds: hash -> the media it is in; `next_seq`: the batch expected;
    `exact`: whether blocks are all it holds (see the module docstring); `applied_at`: the
    time.monotonic() of the last batch applied (0: none yet)."""

    blocks: dict[int, set[str]] = field(default_factory=dict)
    next_seq: int = 0
    exact: bool = False
    applied_at: float = 0.0


def _fields(event: list | dict, names: tuple[str, ...]) -> tuple[str, dict]:
    if isinstance(event, dict):
        return event["type"], event
    tag, values = event[0], event[1:]
    return tag, dict(zip(names, values))


def decode_batch(payload: bytes) -> list[tuple[str, dict]]:
    """(tag, fields) of each event of one KVEventBatch payload."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    events = batch["events"] if isinstance(batch, dict) else batch[1]
    out = []
    for event in events:
        tag = event["type"] if isinstance(event, dict) else event[0]
        out.append(_fields(event, _STORED if tag == "BlockStored" else _REMOVED))
    return out


class KVIndex:
    """See the module docstring. Thread-safe: subscribers apply, a router reads."""

    def __init__(self) -> None:
        self.servers: dict[str, ServerBlocks] = {}
        self._lock = threading.Lock()

    def apply(self, server: str, seq: int, payload: bytes) -> int | None:
        """Apply batch `seq` of `server` if it is the next one; returns the first missing
        sequence number when batches were skipped (nothing applied), else None."""
        with self._lock:
            state = self.servers.setdefault(server, ServerBlocks())
            if seq < state.next_seq:
                return None  # seen already
            if seq > state.next_seq:
                return state.next_seq
            for tag, fields in decode_batch(payload):
                self._apply_event(state, tag, fields)
            state.next_seq = seq + 1
            state.applied_at = time.monotonic()
            return None

    def skip_to(self, server: str, seq: int) -> None:
        """Batches before `seq` are lost: forget the server's blocks and expect `seq` next."""
        with self._lock:
            self.servers[server] = ServerBlocks(next_seq=seq)

    def forget(self, server: str) -> None:
        """Drop everything of `server` (removed, or a new process whose batches number from 0)."""
        with self._lock:
            self.servers.pop(server, None)

    def status(self, server: str) -> tuple[int, bool, float]:
        """(next_seq, exact, applied_at) of `server`; (0, False, 0.0) when nothing is known."""
        with self._lock:
            state = self.servers.get(server)
            if state is None:
                return 0, False, 0.0
            return state.next_seq, state.exact, state.applied_at

    @staticmethod
    def _apply_event(state: ServerBlocks, tag: str, fields: dict) -> None:
        if tag == "AllBlocksCleared":
            state.blocks.clear()
            state.exact = True
            return
        medium = fields.get("medium") or DEFAULT_MEDIUM
        for h in fields["block_hashes"]:
            if tag == "BlockStored":
                state.blocks.setdefault(h, set()).add(medium)
            elif tag == "BlockRemoved" and h in state.blocks:
                state.blocks[h].discard(medium)
                if not state.blocks[h]:
                    del state.blocks[h]

    def blocks(self, server: str) -> dict[int, frozenset[str]]:
        """A copy of what `server` holds: hash -> media."""
        with self._lock:
            state = self.servers.get(server)
            return {h: frozenset(m) for h, m in state.blocks.items()} if state else {}

    def longest_prefix(self, server: str, hashes: Sequence[int], medium: str | None = None) -> int:
        """How many of a request's leading block hashes `server` holds (in `medium`; None:
        in any)."""
        with self._lock:
            state = self.servers.get(server)
            if state is None:
                return 0
            for i, h in enumerate(hashes):
                media = state.blocks.get(h)
                if not media or (medium is not None and medium not in media):
                    return i
            return len(hashes)

    def matches(self, hashes: Sequence[int]) -> dict[str, int]:
        """Every known server's longest prefix of `hashes`."""
        return {s: self.longest_prefix(s, hashes) for s in list(self.servers)}
