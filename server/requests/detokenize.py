"""Incremental detokenization with stop strings, for streaming text as tokens arrive.

Each token costs two decodes of a short window, whatever the output's length: the tokens since
the last text was released plus the ones before them (TGI's and vLLM's prefix and read offsets).
Decoding the window with and without its new tokens and keeping the difference gives the new
text exactly where a tokenizer's decode of a lone token differs from its decode in context
(SentencePiece's Metaspace drops the leading space of the first token it decodes: a window that
only re-decoded its newest tokens would never agree with the full text there, and an earlier
version of this module then decoded the whole output at every token). A window whose text ends
in an incomplete character waits for the rest of it: tokens that decode to nothing on their own
meanwhile (skipped special tokens) are not kept in it, and it holds at most MAX_HELD tokens
(without both, a split character followed by skipped special tokens, or bytes that never form a
character, grew it by a token every step). A continuation byte is kept even though the window's
text still ends in the same U+FFFD: a 3- or 4-byte character (CJK, emoji) spans up to four
byte-level tokens, and an earlier version dropped the middle ones.

Where the tokenizer is a Rust `tokenizers.Tokenizer` that transformers' `decode` only wraps
(`window_decoder`), the windows are the Rust tokenizer's own `DecodeStream` (the same offsets,
one call a token); otherwise `WindowChunks` runs them here through the tokenizer's `decode`.
This runs for every request at every step: on the output processor's thread
(server/engine/output_processor.py), or on the engine thread with `--output-thread off`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from tokenizers.decoders import DecodeStream

# Tokens a window may hold while its text ends in an incomplete character: a UTF-8 character
# is at most 4 bytes and a byte-level token at least one, so a window still ending in U+FFFD
# after this many tokens holds bytes that never form one (they are released as U+FFFD).
MAX_HELD = 8


def window_decoder(tokenizer, skip_special: bool = True) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=skip_special)` as a function of ids: the backend
    `tokenizers.Tokenizer`'s own decode when the tokenizer is transformers' `TokenizersBackend`
    with its `decode` not overridden and no clean-up of spaces applied after it (what
    `TokenizersBackend._decode` does then); the tokenizer's `decode` otherwise."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _decodes_as_backend(tokenizer, backend):
        return functools.partial(backend.decode, skip_special_tokens=skip_special)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special)


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


class WindowChunks:
    """A growing list of token ids -> the text each token makes final, through `decode` (ids ->
    text, special tokens skipped) of a bounded window."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode_ids = decode
        # The window: the tokens whose text was released last (its context), then the tokens
        # not yet turned into text; _read of them are the context.
        self._ids: list[int] = []
        self._read = 0
        # While the window's text ends in an incomplete character: its part past the context
        # (what finish() releases if the request ends there)
        self._held_new = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        if self._held_new and not self._decode([token_id]):
            return ""  # no text of its own (a skipped special token) inside a character
        self._ids.append(token_id)
        context = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        if text.endswith("\ufffd") and len(self._ids) - self._read < MAX_HELD:
            self._held_new = text[len(context) :]
            return ""  # a multi-byte character is not complete yet
        self._held_new = ""
        if len(text) <= len(context):
            del self._ids[self._read :]  # no text (a skipped special token): not kept
            return ""
        self._ids = self._ids[self._read :]  # the new tokens are the next context
        self._read = len(self._ids)
        return text[len(context) :]

    def finish(self) -> str:
        """The text of an incomplete character the output ends in (U+FFFD)."""
        out, self._held_new = self._held_new, ""
        return out

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids) if ids else ""


class RustChunks:
    """`WindowChunks` by the Rust tokenizer's `DecodeStream`, which holds its window itself and
    waits while the text ends in an incomplete character; here only the bound on that wait
    (MAX_HELD) and the skipped tokens inside a character are added, as WindowChunks has them."""

    def __init__(self, backend, skip_special: bool = True):
        self._backend = backend
        self._skip = skip_special
        self._stream = DecodeStream(skip_special_tokens=skip_special)
        self._context: list[int] = []  # the tokens of the last text released (the stream's)
        self._held: list[int] = []  # the tokens since, not yet text

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        if self._held and not self._decode([token_id]):
            return ""  # no text of its own (a skipped special token) inside a character
        self._held.append(token_id)
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception:  # the stream's text no longer extends its context: restart it
            return self._release_held()
        if text is not None:
            self._context, self._held = self._held, []
            return text
        if len(self._held) < MAX_HELD:
            return ""
        return self._release_held()  # bytes that never form a character: out as U+FFFD

    def finish(self) -> str:
        """The text of an incomplete character the output ends in (U+FFFD)."""
        return self._release_held() if self._held else ""

    def _release_held(self) -> str:
        """The held tokens' text as the decode gives it, the stream restarted with them as its
        context (as the stream itself does after a text: its window stays bounded)."""
        context, text = self._decode(self._context), self._decode(self._context + self._held)
        self._stream = DecodeStream(ids=self._held, skip_special_tokens=self._skip)
        self._context, self._held = self._held, []
        return text[len(context) :] if text.startswith(context) else text

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip) if ids else ""


def text_chunks(tokenizer, skip_special: bool = True) -> WindowChunks | RustChunks:
    """The incremental decoder of `tokenizer`'s outputs (special tokens skipped, or kept as
    text): the Rust stream where the window decoder is the Rust tokenizer's own decode, else
    windows through its decode."""
    decode = window_decoder(tokenizer, skip_special)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(decode, functools.partial) and decode.func == getattr(backend, "decode", None):
        return RustChunks(backend, skip_special)
    return WindowChunks(decode)


class TextStream:
    """Turns a growing list of token ids into text deltas, holding back what may still change.

    Text is held back while it ends in an incomplete UTF-8 character or might be the start of a
    stop string; once a stop string appears the text is cut before it (after it with
    `include_stop`), `stopped` is set and `stop_string` names it.
    """

    def __init__(
        self,
        tokenizer,
        stop: tuple[str, ...] = (),
        include_stop: bool = False,
        skip_special: bool = True,
    ):
        self._chunks = text_chunks(tokenizer, skip_special)
        self._stop = stop
        self._include_stop = include_stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._pending = ""  # text decoded but not yet returned (held back)
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended it

    @classmethod
    def of(cls, tokenizer, params) -> TextStream:
        """The stream of a request's `SamplingParams`: its stop strings, kept or not, and its
        special tokens, skipped or not."""
        return cls(tokenizer, params.stop, params.include_stop_str_in_output,
                   params.skip_special_tokens)  # fmt: skip

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (possibly empty)."""
        text = self._chunks.push(token_id)
        if not text:
            return ""
        self._pending += text
        return self._release()

    def finish(self) -> str:
        """The request ended: return whatever text is still held back."""
        if self.stopped:
            return ""
        out, self._pending = self._pending + self._chunks.finish(), ""
        return out

    def _release(self) -> str:
        # Held text is at least a stop string's length less one, so a stop string that the new
        # text completes starts within the pending text.
        found = [(pos, s) for s in self._stop if (pos := self._pending.find(s)) != -1]
        if found:  # cut before the earliest stop string (the longest of those starting there)
            self.stopped = True
            pos, self.stop_string = min(found, key=lambda f: (f[0], -len(f[1])))
            end = pos + len(self.stop_string) * self._include_stop
            out, self._pending = self._pending[:end], ""
            return out
        safe = len(self._pending) - self._hold
        if safe <= 0:
            return ""
        out, self._pending = self._pending[:safe], self._pending[safe:]
        return out
