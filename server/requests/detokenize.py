"""Incremental detokenization with stop strings, for streaming text as tokens arrive.

Each token costs two decodes of a short window, whatever the output's length: the tokens since
the last text was released plus the one before them (TGI's and vLLM's prefix and read offsets).
Decoding the window with and without its new tokens and keeping the difference gives the new
text exactly where a tokenizer's decode of a lone token differs from its decode in context
(SentencePiece's Metaspace drops the leading space of the first token it decodes: a window that
only re-decoded its newest tokens would never agree with the full text there, and an earlier
version of this module then decoded the whole output at every token). A window whose text ends
in an incomplete character waits for the rest of it: tokens that add no text meanwhile are not
kept in it, and it holds at most MAX_HELD tokens (without both, a split character followed by
skipped special tokens, or bytes that never form a character, grew it by a token every step).

A window is decoded by the Rust tokenizer itself where that is all transformers' `decode` would
do (`window_decoder`): its Python wrapper cost several times the decode of a short window, and
this runs for every request at every step on the engine thread.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

# Tokens a window may hold while its text ends in an incomplete character: a UTF-8 character
# is at most 4 bytes and a byte-level token at least one, so a window still ending in U+FFFD
# after this many tokens holds bytes that never form one (they are released as U+FFFD).
MAX_HELD = 8


def window_decoder(tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)` as a function of ids: the backend
    `tokenizers.Tokenizer`'s own decode when the tokenizer is transformers' `TokenizersBackend`
    with its `decode` not overridden and no clean-up of spaces applied after it (what
    `TokenizersBackend._decode` does then); the tokenizer's `decode` otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _decodes_as_backend(tokenizer, backend):
        return functools.partial(backend.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


def _decodes_as_backend(tokenizer, backend) -> bool:
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: its decode, as it is
        return False
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or (cls.decode, cls._decode) != (
        TokenizersBackend.decode,
        TokenizersBackend._decode,
    ):
        return False
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return True
    # transformers skips the clean-up for a BPE model unless told to corrupt its output
    forced = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    return type(backend.model).__name__ == "BPE" and not getattr(tokenizer, forced, False)


class TextStream:
    """Turns a growing list of token ids into text deltas, holding back what may still change.

    Text is held back while it ends in an incomplete UTF-8 character or might be the start of a
    stop string; once a stop string appears the text is cut before it and `stopped` is set.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self._decode_ids = window_decoder(tokenizer)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        # The window: the token whose text was released last (its context), then the tokens
        # not yet turned into text; _read of them are the context.
        self._ids: list[int] = []
        self._read = 0
        self._pending = ""  # text decoded but not yet returned (held back)
        # While the window's text ends in an incomplete character: that text, and its part past
        # the context (what finish() releases if the request ends there)
        self._held = self._held_new = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (possibly empty)."""
        self._ids.append(token_id)
        context = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        if self._held and text == self._held:  # a token with no text after an incomplete one
            self._ids.pop()
            return ""
        if text.endswith("\ufffd") and len(self._ids) - self._read < MAX_HELD:
            self._held, self._held_new = text, text[len(context) :]
            return ""  # a multi-byte character is not complete yet
        self._held = self._held_new = ""
        if len(text) <= len(context):
            del self._ids[self._read :]  # no text (a skipped special token): not kept
            return ""
        self._pending += text[len(context) :]
        self._ids = self._ids[self._read :]  # the new tokens; the last is the next context
        self._read = len(self._ids)
        return self._release()

    def finish(self) -> str:
        """The request ended: return whatever text is still held back."""
        if self.stopped:
            return ""
        out, self._pending, self._held_new = self._pending + self._held_new, "", ""
        return out

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids) if ids else ""

    def _release(self) -> str:
        # Held text is at least a stop string's length less one, so a stop string that the new
        # text completes starts within the pending text.
        found = [pos for s in self._stop if (pos := self._pending.find(s)) != -1]
        if found:  # cut before the earliest stop string
            self.stopped = True
            out, self._pending = self._pending[: min(found)], ""
            return out
        safe = len(self._pending) - self._hold
        if safe <= 0:
            return ""
        out, self._pending = self._pending[:safe], self._pending[safe:]
        return out
