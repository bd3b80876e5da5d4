"""How deep the brackets of client JSON nest, found before the text is parsed, in linear time.

Every JSON body of the server and the scheduler, and JSON text inside a field (a `guided_json`
string, a tool call's arguments), passes through `nests_too_deep` before `json.loads`, so the
scan itself is on the request path of untrusted input: it must cost its own request time
proportional to the text, and never hold the interpreter long enough to stall the process's other
threads. A regex that cut the strings out (`"[^"\\\\]*(?:\\\\.[^"\\\\]*)*"`) was quadratic on an
unterminated string of escaped quotes and froze a whole process for seconds in C holding the GIL
(issue 67).

The scan is one state machine over the bytes (in a string or not, the parity of the backslash run
before each byte, the bracket depth), evaluated with numpy over chunks of `CHUNK_BYTES`: each
chunk's state comes from the one before, so the whole scan is a few linear passes, and the
interpreter can switch threads between chunks (numpy's loops also release the GIL). It stops at
the first chunk that goes past the bound.

It reads escapes and strings as JSON does wherever the text is JSON; past the first byte where the
text stops being JSON (a backslash or an unmatched bracket outside a string), the parser raises
there without recursing further, so a depth counted beyond that point only ever refuses text that
would have been refused anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# How deep JSON a client may send (a body, or JSON text inside one of its fields): deep enough
# for any schema or tool a person writes, far below what would exhaust the parser's recursion.
MAX_JSON_DEPTH = 128
# Bytes scanned between two points where the interpreter may switch threads: a few ms each.
CHUNK_BYTES = 1 << 20

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_BRACKET_STEP = np.zeros(256, dtype=np.int32)
_BRACKET_STEP[list(b"[{")] = 1
_BRACKET_STEP[list(b"]}")] = -1


@dataclass
class _ScanState:
    """What a chunk's scan needs of the bytes before it."""

    depth: int = 0  # bracket depth outside strings at the end of the bytes so far
    in_string: bool = False
    trailing_backslashes: int = 0  # length of the backslash run that ends the bytes so far


def _scan_chunk(chunk: memoryview, state: _ScanState) -> int:
    """The deepest bracket depth reached in `chunk`, `state` advanced past it (in place)."""
    codes = np.frombuffer(chunk, dtype=np.uint8)  # [n]
    n = codes.size
    positions = np.arange(n, dtype=np.int64)
    is_backslash = codes == _BACKSLASH
    # For each byte, the index of the last byte at or before it that is not a backslash
    # (-1: the chunk so far is all backslashes); the run before byte i ends at i - 1.
    last_plain = np.maximum.accumulate(np.where(is_backslash, -1, positions))  # [n]
    before = np.empty(n, dtype=np.int64)
    before[0] = -1
    before[1:] = last_plain[:-1]
    run = positions - 1 - before  # backslashes right before each byte within this chunk
    run[before == -1] += state.trailing_backslashes
    is_quote = (codes == _QUOTE) & (run % 2 == 0)  # a quote after an even run delimits a string
    quotes_so_far = np.cumsum(is_quote, dtype=np.int64)  # [n], inclusive
    # A bracket is outside a string when an even number of delimiters precede it (it is not a
    # quote itself, so the inclusive count is the count before it).
    outside = (quotes_so_far + state.in_string) % 2 == 0
    steps = np.where(outside, _BRACKET_STEP[codes], 0)
    depths = np.cumsum(steps, dtype=np.int64) + state.depth  # [n]
    deepest = int(depths.max())
    state.depth = int(depths[-1])
    state.in_string = bool((int(quotes_so_far[-1]) + state.in_string) % 2)
    tail_run = n - 1 - int(last_plain[-1])
    state.trailing_backslashes = tail_run + (state.trailing_backslashes if tail_run == n else 0)
    return deepest


def nests_too_deep(data: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether the brackets of JSON text nest past `max_depth` outside its strings.

    Valid JSON or not (the parser judges that afterwards): the scan only bounds how deep the
    parser could recurse. Linear in the text, in chunks between which other threads run.
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return False
    state, view = _ScanState(), memoryview(raw)
    for start in range(0, len(raw), CHUNK_BYTES):
        if _scan_chunk(view[start : start + CHUNK_BYTES], state) > max_depth:
            return True
    return False
