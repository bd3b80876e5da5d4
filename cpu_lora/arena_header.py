"""The header at offset 0 of every shared-memory arena of this package, and the alignment rule.

Each arena (the adapter repository, the workers' I/O arena) starts with its own struct format
that begins `<8sII`: an 8-byte magic, a u32 layout version and a u32 dtype code (`DTYPES`), then
the arena's own fields. A process that attaches checks the magic and version before it reads
anything else, so a stale or foreign segment is refused with its name.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from toppings.cpu_lora.shapes import DTYPE_CODES, DTYPES


def align(n: int, to: int = 64) -> int:
    """n rounded up to a multiple of `to`."""
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class ArenaHeader:
    """One arena kind's header: fmt (starting "<8sII"), magic, version, what it is (for errors)."""

    fmt: str
    magic: bytes
    version: int
    kind: str

    def write(self, mapping, dtype: torch.dtype, *fields: int) -> None:
        """Pack magic, version, dtype code and the arena's fields at offset 0 of mapping."""
        struct.pack_into(
            self.fmt, mapping, 0, self.magic, self.version, DTYPE_CODES[dtype], *fields
        )

    def read(self, mapping, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """(dtype, the arena's fields) of the header at offset 0; ValueError naming the segment
        when its magic or version is not this kind's."""
        head = struct.unpack_from(self.fmt, mapping, 0)
        if head[0] != self.magic or head[1] != self.version:
            raise ValueError(f"{name} is not a version-{self.version} {self.kind}")
        return DTYPES[head[2]], head[3:]
