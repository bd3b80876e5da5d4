"""Getting a resolved adapter ready to register, off the adapter thread: `Preparer`.

Registering an adapter is quick; reading it is not: the PEFT files from disk, their parse, the
shape, rank, size and finiteness checks, and the content key that registration's dedupe
needs. A load through /v1/load_lora_adapter does all of it on the one adapter thread
(server.api.admin.lifecycle.AdapterThread), so with a thousand adapters drawn at random every
cold request waited behind the reads of the cold requests before it. Here the reads run on a
pool of their own, as many at once as the resolver resolves (`--lora-resolver-max-loading`),
and hand the adapter thread an adapter that only needs registering, with its content key made
(registration does not make it again). The readers run torch on their own thread alone
(`torch_on_this_thread_only`: no OpenMP team per reader, the reason the adapter thread exists).

A read waits on storage, then on the CPU (the file's copy, its parse and checks), so it runs in
two parts. Its files are first brought into the page cache (`fetch_files`), on as many threads
as names resolve at once: a read that hangs on a slow or stuck store holds one of them and
nothing else. The rest runs on no more threads at once than the cores the engine leaves
(`reader_threads`), one at least: reads beyond the spare cores only take turns, so every read
of a burst ends late and the engine gets its first cold request late too (a burst of 32 cold
adapters on a 2-core server ended sooner with one such thread than with four:
docs/benchmarks.md, session 44).

A read is started, not waited for (`start` gives a future): the resolver makes room for the
adapter (an eviction) while it runs. An adapter the resolver
unloaded and still keeps in its host tier (host_tier.py) is not read at all while its files are
unchanged.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from toppings.gpu_lora.host_memory import ContentKey
from toppings.gpu_lora.peft.adapter import LoraAdapter
from toppings.gpu_lora.peft.config import MAX_FILE_BYTES
from toppings.gpu_lora.peft.directory import file_size, open_dir, open_file
from toppings.server.process.threads import torch_on_this_thread_only
from toppings.server.resolver.host_tier import FileKey, HostTier, Prepared


def reader_threads(max_loading: int, spare_cores: int) -> int:
    """Reads that may use the CPU at once: `max_loading` at most, the engine's spare cores at
    most, and one at least."""
    return max(1, min(max_loading, spare_cores))


def fetch_files(directory: str) -> None:
    """Bring the PEFT files of `directory` into the page cache (a shared mapping populated, then
    dropped: no copy), so that reading them next waits on no storage. Best effort: whatever it
    cannot open or map (missing, a symlink, not a regular file, over its cap) the read that
    follows opens and refuses itself."""
    try:
        dir_fd = open_dir(directory)
    except OSError:
        return
    try:
        for name, max_bytes in MAX_FILE_BYTES.items():
            try:
                with open_file(dir_fd, name, max_bytes) as f:
                    size = file_size(f)
                    if size:
                        mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                  prot=mmap.PROT_READ).close()  # fmt: skip
            except (OSError, ValueError):
                continue
    finally:
        os.close(dir_fd)


class Opener(Protocol):
    """Reads and checks an adapter directory without registering it
    (server.api.admin.lifecycle's AdapterAdmin.open; RequestError on refusal)."""

    def open(self, name: str, path: str) -> LoraAdapter: ...


class Preparer:
    """Adapters ready to register: from the host tier, else read on the reader pool."""

    def __init__(
        self,
        opener: Opener,
        tier: HostTier,
        max_reading: int,
        max_parsing: int,
        fetch: Callable[[str], None] = fetch_files,
    ):
        """max_reading: reads at once (the resolver's bound on resolutions in flight);
        max_parsing: of those, reads past their fetch (`reader_threads`); fetch: what waits on
        storage for a directory's files."""
        if max_reading < 1 or max_parsing < 1:
            raise ValueError("max_reading and max_parsing must be positive")
        self.opener = opener
        self.tier = tier
        self._fetch = fetch
        self._parsing = threading.BoundedSemaphore(max_parsing)
        self._readers = ThreadPoolExecutor(max_workers=max_reading,
                                           thread_name_prefix="adapter-read",
                                           initializer=torch_on_this_thread_only)  # fmt: skip

    def start(self, name: str, directory: str) -> Future[tuple[Prepared, bool]]:
        """Get the adapter in the checked `directory` ready to register as `name`: a future of
        it and whether it came from the host tier (done already then; else read on the pool,
        and the caller does what else it must meanwhile). Its result raises RequestError when
        the read refuses the adapter."""
        key = FileKey.of(directory)  # before the read: a later change makes it stale
        kept = self.tier.take(directory, key)
        if kept is None:
            return self._readers.submit(self._read, name, directory, key)
        done: Future[tuple[Prepared, bool]] = Future()
        adapter = dataclasses.replace(kept.adapter, name=name)
        done.set_result((Prepared(adapter, kept.content, directory, key), True))
        return done

    def _read(self, name: str, directory: str, key: FileKey | None) -> tuple[Prepared, bool]:
        self._fetch(directory)
        with self._parsing:
            adapter = self.opener.open(name, directory)
            return Prepared(adapter, ContentKey(adapter), directory, key), False
