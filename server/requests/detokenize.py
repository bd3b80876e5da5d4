"""Incremental detokenization with stop strings, for streaming text as tokens arrive."""

from __future__ import annotations

# Decoding restarts from this many tokens back, so each step costs O(window), not O(output).
_WINDOW = 8


class TextStream:
    """Turns a growing list of token ids into text deltas, holding back what may still change.

    Text is held back while it ends in an incomplete UTF-8 character or might be the start of a
    stop string; once a stop string appears the text is cut before it and `stopped` is set.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self._tok = tokenizer
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_idx = 0  # ids before this are decoded into _done_text for good
        self._done_text = ""
        self._text = ""  # all text so far
        self._emitted = 0  # characters of _text already returned
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (possibly empty)."""
        self._ids.append(token_id)
        window = self._ids[self._prefix_idx :]
        tail = self._tok.decode(window, skip_special_tokens=True)
        if tail.endswith("\ufffd"):
            return ""  # a multi-byte character is not complete yet
        self._text = self._done_text + tail
        if len(window) > _WINDOW:
            # Freeze the oldest tokens; decoding them alone must give the same text prefix.
            frozen = self._tok.decode(window[:-_WINDOW], skip_special_tokens=True)
            rest = self._tok.decode(window[-_WINDOW:], skip_special_tokens=True)
            if frozen + rest == tail:
                self._done_text += frozen
                self._prefix_idx += len(window) - _WINDOW
        return self._release()

    def finish(self) -> str:
        """The request ended: return whatever text is still held back."""
        if self.stopped:
            return ""
        out = self._text[self._emitted :]
        self._emitted = len(self._text)
        return out

    def _release(self) -> str:
        for s in self._stop:
            # Only the new part (plus a stop string's length back) can hold a new match.
            pos = self._text.find(s, max(0, self._emitted - len(s)))
            if pos != -1:
                self._text = self._text[:pos]
                self.stopped = True
                out = self._text[self._emitted :]
                self._emitted = len(self._text)
                return out
        safe = len(self._text) - self._hold
        if safe <= self._emitted:
            return ""
        out = self._text[self._emitted : safe]
        self._emitted = safe
        return out
