"""Host memory in 2 MiB pages for the weights a decode step streams.

A decode step of a few tokens reads every projection weight once. In Linux's ordinary 4 KiB
pages that is one TLB entry per 4 KiB read, far more entries a step than a TLB holds; in 2 MiB
pages a model of a few GB is a few thousand. `place` copies a weight into memory advised
MADV_HUGEPAGE (transparent huge pages), packed one after another in chunks of CHUNK_BYTES, so
that the native GEMVs read it from 2 MiB pages (what it gained, small at SmolLM2's size and a few
percent at 1B: docs/benchmarks.md, "the GEMVs' weights in 2 MiB pages"). The linear layers place
their GEMV copies at load (linear.py, quant.py).

The kernel grants 2 MiB pages to advised anonymous memory when
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise` (the usual default); with
`never`, or where a 2 MiB page cannot be found, the chunk is served in 4 KiB pages and nothing
else changes. Off Linux (no MADV_HUGEPAGE) `place` returns the tensor as it is.

A chunk lives as long as any tensor placed in it (each holds its buffer); the arena keeps only
the chunk it is filling, so at most CHUNK_BYTES of address space (pages touched only as filled)
outlives the models placed in it.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Iterator

import torch

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20
MIN_BYTES = 256 << 10  # smaller tensors stay where they are (a few pages at most)
ALIGN = 64

_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)
_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


class _Arena:
    """Chunks of private anonymous memory advised MADV_HUGEPAGE, filled front to back."""

    def __init__(self):
        self._lock = threading.Lock()
        self._chunk: torch.Tensor | None = None  # uint8, 2 MiB-aligned, the one being filled
        self._used = 0
        self.enabled = _ADVICE is not None

    def take(self, nbytes: int) -> torch.Tensor:
        """nbytes of advised memory (uint8, ALIGN-aligned), from the current chunk or a new
        one."""
        with self._lock:
            if self._chunk is None or self._used + nbytes > self._chunk.numel():
                self._chunk, self._used = _new_chunk(max(CHUNK_BYTES, nbytes)), 0
            start = self._used
            self._used = -(-(start + nbytes) // ALIGN) * ALIGN
            return self._chunk[start : start + nbytes]


def _new_chunk(nbytes: int) -> torch.Tensor:
    """A fresh chunk of at least nbytes (rounded up to 2 MiB) at a 2 MiB-aligned address."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    buffer = mmap.mmap(-1, size + HUGE_PAGE, flags=_FLAGS)
    whole = torch.frombuffer(buffer, dtype=torch.uint8)  # holds the buffer alive
    skip = -whole.data_ptr() % HUGE_PAGE  # mmap's address is page-aligned: skip is too
    try:
        buffer.madvise(_ADVICE, skip, size)
    except OSError:  # a kernel built without transparent huge pages: 4 KiB pages, as before
        pass
    return whole[skip : skip + size]


_arena = _Arena()


def place(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a CPU tensor in 2 MiB-page memory (same dtype, shape, values; contiguous), or
    the tensor itself where it is smaller than MIN_BYTES, not on the CPU, or placing is off
    (`disabled`, or no MADV_HUGEPAGE here). The copy does not follow the original's later
    writes: place weights once they are final."""
    nbytes = tensor.numel() * tensor.element_size()
    if not _arena.enabled or tensor.device.type != "cpu" or nbytes < MIN_BYTES:
        return tensor
    out = _arena.take(nbytes).view(tensor.dtype).view(tensor.shape)
    out.copy_(tensor)
    return out


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Models built inside keep their weights where they are (bench/pair_steps.py builds one
    so, beside one placed, to pair their steps)."""
    before, _arena.enabled = _arena.enabled, False
    try:
        yield
    finally:
        _arena.enabled = before
