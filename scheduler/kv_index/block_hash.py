"""A prompt's block hashes as servers announce them (docs/production.md, "KV cache events"):
the first 8 bytes, big-endian, of SHA-256 over b"toppings-kv-v1", the parent's hash
(b"\\x00", or b"\\x01" and 8 bytes), the adapter's name (b"\\x00" for the base model, or b"\\x01",
its UTF-8 length in 4 bytes and the bytes) and the block's token ids (their count, then each,
4 bytes big-endian). Written from that description: the scheduler knows servers only through
their published protocols (a test checks that both sides agree)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

_DOMAIN = b"toppings-kv-v1"


def _hash(parent: int | None, tokens: Sequence[int], adapter_name: str | None) -> int:
    parts = [_DOMAIN, b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "big")]
    if adapter_name is None:
        parts.append(b"\x00")
    else:
        name = adapter_name.encode("utf-8")
        parts.append(b"\x01" + len(name).to_bytes(4, "big") + name)
    parts.append(len(tokens).to_bytes(4, "big"))
    parts.extend(t.to_bytes(4, "big") for t in tokens)
    return int.from_bytes(hashlib.sha256(b"".join(parts)).digest()[:8], "big")


def request_block_hashes(
    tokens: Sequence[int], block_size: int, adapter_name: str | None
) -> list[int]:
    """The hashes of a prompt's full blocks under `adapter_name` (None: the base model; an
    activated LoRA's blocks before its invocation are the base model's)."""
    hashes: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        hashes.append(_hash(hashes[-1] if hashes else None, block, adapter_name))
    return hashes
