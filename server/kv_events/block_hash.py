"""The hash a KV block is announced under: chained from its parent's, salted by its adapter.

Part of the HTTP contract (it imports nothing of toppings): the scheduler's KV index hashes a
prompt with `prompt_hashes` to match what servers announce.

A router that keeps an index of blocks per server must never take one adapter's KV for
another's (vllm#44250: a key without the adapter made adapter B hit adapter A's KV), so the
adapter's name is part of every block's hash, as vLLM puts `lora_name` in its block keys, and is
announced in `lora_name`, never as a bare string in `extra_keys` (llm-d-router#2927 parsed one
there as a multimodal hash, and LoRA prefixes never matched).

The hash is the first 8 bytes (big-endian, unsigned) of SHA-256 over a fixed encoding:

    b"toppings-kv-v1"
    parent:  b"\\x00" (the first block of a prompt) or b"\\x01" + the parent's hash, 8 bytes BE
    adapter: b"\\x00" (the base model) or b"\\x01" + len(name) as 4 bytes BE + name in UTF-8
    tokens:  len(tokens) as 4 bytes BE, then each token id as 4 bytes BE

so it is stable across processes and Python versions (no `hash()`, no pickle), and a router
can compute a prompt's hashes itself from its token ids, the block size and the adapter's name.
The salt is the name, not the registration: an adapter unloaded and loaded again under its name
hashes as before, and its earlier blocks were announced removed when it was unloaded.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DOMAIN = b"toppings-kv-v1"


def block_hash(parent: int | None, tokens: Sequence[int], adapter_name: str | None) -> int:
    """The 64-bit hash of one full block of `tokens` after the block hashed `parent` (None:
    the first block of a prompt), computed under `adapter_name` (None: the base model)."""
    h = hashlib.sha256(DOMAIN)
    h.update(b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "big"))
    if adapter_name is None:
        h.update(b"\x00")
    else:
        name = adapter_name.encode("utf-8")
        h.update(b"\x01" + len(name).to_bytes(4, "big") + name)
    h.update(struct.pack(f">I{len(tokens)}I", len(tokens), *tokens))
    return int.from_bytes(h.digest()[:8], "big")


def prompt_hashes(tokens: Sequence[int], block_size: int, adapter_name: str | None) -> list[int]:
    """The hashes of the full blocks of a prompt, first block first."""
    out: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        out.append(block_hash(out[-1] if out else None, tokens[start : start + block_size],
                              adapter_name))  # fmt: skip
    return out
