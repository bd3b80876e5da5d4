"""Resolved adapters kept in host memory after the resolver unloaded them: `HostTier`.

The resolver registers at most `--lora-resolver-max-adapters` adapters and unloads the least
recently used one to make room for another; with a thousand adapters in use, a name unloaded a
minute ago is often asked for again. Without this tier, that request reads its PEFT files from
disk, parses and checks them and hashes the weights again, all on its way to the first token.
Here the unloaded adapter's tensors (as the engine held them, checked) and their content key
stay in host memory, least recently kept first out, within `max_bytes`; the next resolution of
that directory registers them again without a read.

An entry is keyed by the adapter's real directory and is taken only while its files are the
ones it was read from: `FileKey` is the identity and change time of both files, taken before
the read (a file changed during or after that read has a newer change time, so its entry is
never taken; the read is done afresh). The source's path checks run before any look-up, so a
name whose directory was removed is a 404 whatever the tier holds.

Bytes are charged before they are kept: the resolver `reserve`s an adapter's bytes (making room
by dropping the oldest entries) before it unloads it, then `fill`s the place with what the
unload returned, or `cancel`s it when the unload was refused. `take` hands an entry back to a
registration (which charges the adapter to the engine's host budget) and uncharges it here.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

from toppings.gpu_lora.host_memory import ContentKey
from toppings.gpu_lora.peft.adapter import LoraAdapter
from toppings.gpu_lora.peft.config import CONFIG_FILE, WEIGHTS_FILE


@dataclass(frozen=True)
class FileKey:
    """What identifies the content of an adapter directory's two files without reading them:
    device, inode, size, modification and change times of each (st_ctime_ns moves on any
    write, rename over or attribute change, and no one can set it back)."""

    stats: tuple[tuple[int, int, int, int, int], ...]

    @classmethod
    def of(cls, directory: str) -> FileKey | None:
        """The key of `directory`'s files now; None when one cannot be read (no key, no hit)."""
        stats = []
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            try:
                st = os.stat(os.path.join(directory, name), follow_symlinks=False)
            except OSError:
                return None
            stats.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        return cls(tuple(stats))


@dataclass
class Prepared:
    """An adapter read and checked, ready to register: its content key, and the directory and
    file key it was read from."""

    adapter: LoraAdapter
    content: ContentKey
    directory: str
    key: FileKey | None  # None: its files could not be keyed; never kept

    @property
    def host_bytes(self) -> int:
        return host_bytes(self.adapter)


def host_bytes(adapter: LoraAdapter) -> int:
    """Bytes of an adapter's host tensors (weights and DoRA magnitudes)."""
    tensors = [t for pair in adapter.weights.values() for t in pair]
    tensors += list(adapter.magnitudes.values())
    return sum(t.numel() * t.element_size() for t in tensors)


class HostTier:
    """Unloaded resolved adapters by directory, within `max_bytes` (thread-safe)."""

    def __init__(self, max_bytes: int):
        """max_bytes: the most the kept adapters' tensors take, reserved places included; 0
        keeps nothing."""
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Prepared] = OrderedDict()  # oldest kept first
        self._charged = 0  # bytes of entries and of reserved places

    @property
    def charged_bytes(self) -> int:
        return self._charged

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, directory: str, key: FileKey | None) -> Prepared | None:
        """The entry for `directory` when its files still have `key` (taken out and uncharged:
        the caller registers it); None otherwise, and a stale entry is dropped."""
        with self._lock:
            entry = self._entries.pop(directory, None)
            if entry is None:
                return None
            self._charged -= entry.host_bytes
        return entry if key is not None and entry.key == key else None

    def reserve(self, num_bytes: int) -> bool:
        """Charge a place of `num_bytes`, dropping the oldest entries to make room; False (and
        nothing dropped) when it is larger than the whole tier."""
        if num_bytes > self.max_bytes:
            return False
        with self._lock:
            while self._charged + num_bytes > self.max_bytes and self._entries:
                _, oldest = self._entries.popitem(last=False)
                self._charged -= oldest.host_bytes
            if self._charged + num_bytes > self.max_bytes:  # other places reserved meanwhile
                return False
            self._charged += num_bytes
            return True

    def fill(self, num_bytes: int, prepared: Prepared) -> None:
        """Keep `prepared` in a place `reserve(num_bytes)` charged; the charge becomes its
        size (never more than the place: a larger adapter is not kept)."""
        size = prepared.host_bytes
        with self._lock:
            if prepared.key is None or size > num_bytes:
                self._charged -= num_bytes
                return
            old = self._entries.pop(prepared.directory, None)
            if old is not None:
                self._charged -= old.host_bytes
            self._entries[prepared.directory] = prepared
            self._charged += size - num_bytes

    def cancel(self, num_bytes: int) -> None:
        """Give back a place `reserve(num_bytes)` charged and that nothing filled."""
        with self._lock:
            self._charged -= num_bytes
