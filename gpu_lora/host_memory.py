"""Host memory of registered adapters: one copy per content, all copies within one budget.

Every registered adapter keeps its weights in host memory (the `LoraAdapter` tensors, and a
block in the CPU workers' shared arena when the server runs workers) for as long as it is
registered, whether or not any request uses it. This ledger charges those bytes and bounds
their sum: a load past the budget is refused (`HostMemoryFull`), and the server keeps serving
the adapters it has.

The same files loaded under several names are one copy: an adapter's content is identified by
the digest of its loaded weights and the values that shape its delta (rank, alpha, scale,
targets; `ContentKey` computes that digest only where a cheap probe cannot tell two contents
apart), so the names share one set of tensors (and one arena block) and the copy is charged
once; it is freed when its last name is unloaded. A copy is held under one adapter id, its
`LoraAdapter.id` (in a server the weights id of the registrations that share it), which keys its
rows on the device, its host tensors and its arena block; the names holding it are known here
by their registrations' ids, never by name. Hashing what was loaded, not the files, means
a file swapped between two reads can never make two different contents share.

A name itself holds almost nothing (its registration and reference: under 1 KB measured,
tests/server/adapters/test_adapter_host_memory.py), but names are not free, so their number is
bounded too: one per NAME_BYTES of the budget (at least MIN_NAMES).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
from dataclasses import dataclass, field

import torch

from toppings.gpu_lora.peft.adapter import LoraAdapter

log = logging.getLogger(__name__)

DEFAULT_BUDGET_FRACTION = 0.25  # of the machine's physical memory, without --adapter-host-bytes
# What the name bound allows each name (many times what one holds): a budget of B bytes takes
# B // NAME_BYTES names at most (about 100,000 at a 6 GiB budget), and never fewer than MIN_NAMES.
NAME_BYTES = 64 << 10
MIN_NAMES = 256


class HostMemoryFull(RuntimeError):
    """A new adapter copy would take the charged host bytes past the budget."""


def default_budget_bytes() -> int:
    """DEFAULT_BUDGET_FRACTION of the machine's physical memory."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(physical * DEFAULT_BUDGET_FRACTION)


def content_digest(adapter: LoraAdapter) -> str:
    """The digest of what an adapter computes: its weights' bytes and the values that scale
    and place them (not its name or path)."""
    h = hashlib.sha256()
    h.update(repr(_head(adapter)).encode())
    for (layer, module), (a, b) in sorted(adapter.weights.items()):
        h.update(f"{layer}.{module}:{tuple(a.shape)}:{tuple(b.shape)}:{a.dtype}".encode())
        for t in (a, b):
            h.update(_bytes(t))
    for (layer, module), m in sorted(adapter.magnitudes.items()):  # DoRA
        h.update(f"{layer}.{module}:magnitude:{tuple(m.shape)}".encode())
        h.update(_bytes(m))
    return h.hexdigest()


class ContentKey:
    """An adapter's content as a dict key: equal keys, equal `content_digest`s.

    The digest hashes every byte of every weight, CPU time on a cold adapter's path beside the
    engine's, yet it only tells apart contents that something far cheaper tells apart too. The
    key's hash is a probe: the head (rank, alpha, scale, targets), every tensor's shape and
    dtype, and the bytes that open and close the first and the last module's tensors. Equal
    contents have equal probes, so two keys whose probes differ are unequal, and only keys of
    equal probes compare their digests, each computed once (held copies keep theirs). A probe
    collision costs the digests' time, never a wrong share."""

    __slots__ = ("probe", "_adapter", "_digest", "_lock")

    def __init__(self, adapter: LoraAdapter):
        self._adapter, self._digest, self._lock = adapter, None, threading.Lock()
        self.probe = _probe(adapter)

    @property
    def digest(self) -> str:
        """The full content digest (computed on first use)."""
        with self._lock:
            if self._digest is None:
                self._digest = content_digest(self._adapter)
            return self._digest

    def __hash__(self) -> int:
        return hash(self.probe)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ContentKey):
            return NotImplemented
        if self is other:
            return True
        return self.probe == other.probe and self.digest == other.digest

    def __repr__(self) -> str:
        return f"ContentKey({self.probe[:16]})"


PROBE_BYTES = 256  # of each end of the sampled tensors


def _head(adapter: LoraAdapter) -> tuple:
    return adapter.rank, adapter.alpha, adapter.scale, adapter.target_modules


def _bytes(t: torch.Tensor):
    """A tensor's bytes as a flat buffer, without a copy where it is contiguous (flattened
    first: a rank-1 B [out, 1] is contiguous with a last stride of `out`, which a dtype view
    refuses)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _probe(adapter: LoraAdapter) -> str:
    h = hashlib.sha256(repr(_head(adapter)).encode())
    pairs = sorted(adapter.weights)
    shapes = [(p, tuple(a.shape), tuple(b.shape), a.dtype)
              for p, (a, b) in sorted(adapter.weights.items())]  # fmt: skip
    magnitudes = sorted((p, tuple(m.shape)) for p, m in adapter.magnitudes.items())
    h.update(repr((shapes, magnitudes)).encode())
    for pair in dict.fromkeys(pairs[:1] + pairs[-1:]):
        for t in adapter.weights[pair]:
            data = _bytes(t).reshape(-1)
            h.update(data[:PROBE_BYTES])
            h.update(data[-PROBE_BYTES:])
    return h.hexdigest()


@dataclass
class HostCopy:
    """One content held in host memory and the registrations (by id) that share it."""

    adapter: LoraAdapter  # the first registration's; later ones share its tensors and its id
    key: ContentKey  # of `adapter`
    num_bytes: int  # what the copy is charged
    holders: set[int] = field(default_factory=set)


class HostAdapterMemory:
    """Charged host bytes of adapters by content, within `budget_bytes` (thread-safe)."""

    def __init__(self, budget_bytes: int):
        if budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive")
        self.budget_bytes = budget_bytes
        self.max_names = max(MIN_NAMES, budget_bytes // NAME_BYTES)
        self._copies: dict[ContentKey, HostCopy] = {}
        self._key_of: dict[int, ContentKey] = {}  # registration id -> its copy's key
        self._lock = threading.Lock()

    @property
    def charged_bytes(self) -> int:
        return sum(c.num_bytes for c in list(self._copies.values()))

    def shared(
        self, adapter: LoraAdapter, key: ContentKey | None = None
    ) -> tuple[LoraAdapter, ContentKey]:
        """`adapter` as it will be held, and its content key: under its own name but with the
        tensors of the copy of the same content already held, when there is one (then the
        tensors just loaded are dropped, and the key is the copy's). What is per name stays its
        own: the same weights may be served as plain LoRA under one name and as an activated
        LoRA under another. `key`: the adapter's `ContentKey` when the caller made it."""
        key = key or ContentKey(adapter)
        with self._lock:
            copy = self._copies.get(key)
        if copy is None:
            return adapter, key
        own = {"name": adapter.name, "path": adapter.path,
               "invocation_tokens": adapter.invocation_tokens}  # fmt: skip
        return dataclasses.replace(copy.adapter, **own), copy.key

    def held_id(self, key: ContentKey) -> int | None:
        """The id the copy of this content is held under (`LoraAdapter.id` of its first
        registration), None when no registration holds it."""
        with self._lock:
            copy = self._copies.get(key)
            return None if copy is None else copy.adapter.id

    def charge(self, holder: int, adapter: LoraAdapter, key: ContentKey, num_bytes: int) -> bool:
        """Record registration `holder` as holding `adapter` (from `shared`; a new content is
        held under `adapter.id`); returns whether it is a new copy. A new content is charged
        `num_bytes` and refused with HostMemoryFull past the budget, a held one costs nothing
        more; a name past `max_names` is refused alike."""
        with self._lock:
            if holder in self._key_of:
                raise ValueError(f"registration {holder} of {adapter.name!r} is already charged")
            if len(self._key_of) >= self.max_names:
                raise HostMemoryFull(
                    f"adapter {adapter.name!r} would be name {len(self._key_of) + 1}; the "
                    f"{self.budget_bytes} bytes for adapters (--adapter-host-bytes) take "
                    f"{self.max_names} names"
                )
            copy = self._copies.get(key)
            if copy is None:
                charged = sum(c.num_bytes for c in self._copies.values())
                if charged + num_bytes > self.budget_bytes:
                    raise HostMemoryFull(
                        f"adapter {adapter.name!r} needs {num_bytes} bytes of host memory; "
                        f"{charged} of the {self.budget_bytes} bytes for adapters are held "
                        f"(--adapter-host-bytes)"
                    )
                copy = self._copies[key] = HostCopy(adapter, key, num_bytes)
            is_new = not copy.holders
            copy.holders.add(holder)
            self._key_of[holder] = copy.key
            return is_new

    def release(self, holder: int) -> bool:
        """Forget registration `holder`; returns whether its copy is freed (it was the last
        one holding it)."""
        with self._lock:
            key = self._key_of.pop(holder, None)
            if key is None:
                return False
            copy = self._copies[key]
            copy.holders.discard(holder)
            if copy.holders:
                return False
            del self._copies[key]
            return True

    def view(self) -> dict:
        """For /stats: the budget, the bytes charged, the copies held and the names on them."""
        with self._lock:
            copies = list(self._copies.values())
        return {
            "budget_bytes": self.budget_bytes,
            "charged_bytes": sum(c.num_bytes for c in copies),
            "copies": len(copies),
            "names": sum(len(c.holders) for c in copies),  # one registration per name
            "max_names": self.max_names,
        }
