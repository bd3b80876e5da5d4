"""The engine thread's side of the events: prefix-tree changes become events in a bounded queue.

The prefix tree calls `stored` / `removed` as blocks enter or leave a medium; nothing here
waits, encodes or touches a socket (the publisher thread does, publisher.py), so publishing
never slows a step. When the queue is full the change is dropped and counted, and the index a
consumer keeps would be wrong from then on: the next change that finds room first puts a resync
(`AllBlocksCleared`, then one `BlockStored` for every block the tree holds now, from `snapshot`),
after which the stream is exact again. A resync may repeat a change it already contains; every
event is idempotent for an index (a set of hashes per medium), so that does no harm.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from toppings.server.kv_events.schema import (
    MEDIUM_DEVICE,
    MEDIUM_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
)

log = logging.getLogger(__name__)

MAX_QUEUED = 10_000  # tree changes (each a few events) waiting for the publisher thread


class AdapterName(Protocol):
    id: int
    name: str


class Block(Protocol):
    """What an event says of a prefix-tree node (server/memory/prefix_tree.py's KVNode)."""

    key: tuple[int, ...]  # its token ids
    adapter: AdapterName | None  # None: the base model's KV
    block_hash: int | None  # None for an adapter's root
    on_device: bool

    @property
    def parent(self) -> Block | None: ...


class KVEventRecorder:
    """Queues the events of prefix-tree changes; see the module docstring."""

    def __init__(
        self,
        block_size: int,
        snapshot: Callable[[], Iterable[Block]],
        max_queued: int = MAX_QUEUED,
    ):
        """snapshot: every block the tree holds, parents before children (called on the engine
        thread, for a resync)."""
        self.block_size = block_size
        self.snapshot = snapshot
        self.queue: queue.Queue[list[Event]] = queue.Queue(maxsize=max_queued)
        self.num_dropped = 0  # changes lost to a full queue (each followed by a resync)
        self.num_resyncs_asked = 0  # replays that asked for batches no longer kept
        self._lost = False
        self._lock = threading.Lock()  # the tree's changes come from the engine thread only;
        # this guards the resync flag against `reset`, called at start-up

    def reset(self) -> None:
        """Announce that this server holds nothing (start-up): consumers drop what an earlier
        process of the same endpoint announced."""
        self._put([AllBlocksCleared()])

    def request_resync(self) -> None:
        """Have the next change be preceded by a resync, as after a loss: a consumer asked the
        replay for batches no longer kept (it joined late), and only a resync makes its index
        exact. From the publisher thread; the snapshot is still taken on the engine thread."""
        with self._lock:
            self._lost = True
            self.num_resyncs_asked += 1

    def stored(self, blocks: Sequence[Block], medium: str) -> None:
        """A chain of blocks (each the parent of the next) now held in `medium`."""
        if blocks:
            self._put([self._stored(blocks, medium)])

    def removed(self, blocks: Sequence[Block], medium: str) -> None:
        if blocks:
            self._put([BlockRemoved([b.block_hash for b in blocks], medium)])

    def moved(self, block: Block, source: str, target: str) -> None:
        """A block swapped between the device pool and the host tier."""
        self._put([BlockRemoved([block.block_hash], source), self._stored([block], target)])

    def _stored(self, blocks: Sequence[Block], medium: str) -> BlockStored:
        first = blocks[0]
        parent = first.parent.block_hash if first.parent is not None else None
        adapter = first.adapter
        return BlockStored(
            block_hashes=[b.block_hash for b in blocks],
            parent_block_hash=parent,
            token_ids=[t for b in blocks for t in b.key],
            block_size=self.block_size,
            lora_id=adapter.id if adapter is not None else None,
            medium=medium,
            lora_name=adapter.name if adapter is not None else None,
        )

    def _resync_events(self) -> list[Event]:
        events: list[Event] = [AllBlocksCleared()]
        for block in self.snapshot():
            events.append(self._stored([block], MEDIUM_DEVICE if block.on_device else MEDIUM_HOST))
        return events

    def _put(self, events: list[Event]) -> None:
        with self._lock:
            try:
                if self._lost:
                    self.queue.put_nowait(self._resync_events())
                    self._lost = False
                self.queue.put_nowait(events)
            except queue.Full:
                if not self._lost:
                    log.warning("KV events queue full: events dropped, a resync will follow")
                self._lost = True
                self.num_dropped += 1
