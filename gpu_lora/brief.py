"""Values from an adapter's files shown briefly in error messages.

An error answers the request that caused it; a message that repeats a field as given can be far
larger than that request (a 100,000-id `alora_invocation_tokens` made each 400 about it 689 KB).
A list shows its first MAX_SHOWN_ITEMS and its length, any other value at most MAX_SHOWN_CHARS
of its repr.
"""

from __future__ import annotations

from typing import Any

MAX_SHOWN_ITEMS = 8
MAX_SHOWN_CHARS = 120


def brief(value: Any) -> str:
    """`value`'s repr when short; else a list's first MAX_SHOWN_ITEMS items and "... (N in
    all)", or any other repr cut to MAX_SHOWN_CHARS with "...". [3, 4] -> "[3, 4]"."""
    if isinstance(value, (list, tuple)) and len(value) > MAX_SHOWN_ITEMS:
        head = ", ".join(
            _cut(repr(v), MAX_SHOWN_CHARS // MAX_SHOWN_ITEMS) for v in value[:MAX_SHOWN_ITEMS]
        )
        return f"[{head}, ... ({len(value)} in all)]"
    if isinstance(value, (list, tuple)):
        return _cut("[" + ", ".join(repr(v) for v in value) + "]", MAX_SHOWN_CHARS)
    return _cut(repr(value), MAX_SHOWN_CHARS)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(limit - 3, 1)] + "..."
