"""First-fit allocation of byte ranges in the repository's data area."""

from __future__ import annotations


class FirstFit:
    """Free ranges of [start, start + size), kept sorted and merged."""

    def __init__(self, start: int, size: int) -> None:
        self.size = size
        self._free = [(start, size)]  # (offset, size), sorted by offset, never adjacent

    def allocate(self, size: int) -> int | None:
        """Offset of the first free range that fits `size` bytes, or None."""
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                return offset
        return None

    def release(self, offset: int, size: int) -> None:
        """Return a range, merging it with free neighbours."""
        ranges = sorted([*self._free, (offset, size)])
        merged = [ranges[0]]
        for off, sz in ranges[1:]:
            last_off, last_sz = merged[-1]
            if last_off + last_sz == off:
                merged[-1] = (last_off, last_sz + sz)
            else:
                merged.append((off, sz))
        self._free = merged

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    @property
    def num_ranges(self) -> int:
        return len(self._free)
