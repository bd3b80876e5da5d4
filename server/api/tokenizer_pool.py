"""Copies of the engine's tokenizer lent to HTTP handler threads, one borrower per copy.

A Hugging Face fast tokenizer wraps one Rust `Tokenizer` whose truncation and padding are state
of the object: a call that asks for them first sets that state, then encodes. Two threads on one
tokenizer race on it (one thread's truncation applied to another's text; older `tokenizers`
raise "RuntimeError: Already borrowed" when the state changes while another thread is inside
`encode`). One shared tokenizer behind a lock avoids that but serializes every request's
tokenization behind the slowest one. Each copy here is used by one thread at a time, so requests
tokenize in parallel whatever they ask of their copy. The engine's own tokenizer is only decoded
with (stop strings, streamed text, logprob token texts), and decoding sets no state.

There are up to `max_copies` copies (by default one per core this process may run on, 4 to 16:
tokenizing is CPU work, and a copy costs memory). MIN_COPIES of them are made with the pool,
before the server answers /health: a copy takes 85 ms for SmolLM2's 49k tokens on a 2-core Xeon
(more for larger vocabularies), holding the interpreter, and made on first use it held up the
first request after start-up (its time to the first token 3.1x a warm one's;
bench/bench_first_request.py). The others, on a machine of more cores, are made on demand: all
of them at start-up would cost seconds there for a concurrency a server may never see. A
borrower past `max_copies` waits for a copy to come back; the prompt's character bound
(server.api.openai.choices) keeps each tokenization short, so that wait is bounded too.

Every copy carries the operator's `--chat-template` (server.chat_template.file) when there is
one. A chat renders on the copy it borrowed under a budget (server.chat_template.sandbox), so a
runaway template fails its own request and its copy comes back, as on any other error.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from toppings.server.settings import process_cores

log = logging.getLogger(__name__)

MIN_COPIES = 4  # even on a small machine: a long tokenization never holds up the next ones
MAX_COPIES = 16  # copies cost memory: 8 MiB each for SmolLM2's 49k tokens, more for larger ones


def default_max_copies() -> int:
    """One copy per core this process may run on, from MIN_COPIES to MAX_COPIES."""
    return min(MAX_COPIES, max(MIN_COPIES, len(process_cores())))


class TokenizerPool:
    """Lends copies (`copy.deepcopy`) of one tokenizer, each to one borrower at a time.
    `chat_template` (None: the tokenizer's own) is the template every copy renders chats with
    (the operator's --chat-template); `ready` copies (None: MIN_COPIES; never past
    `max_copies`) are made now, the others on demand."""

    def __init__(
        self,
        tokenizer: Any,
        max_copies: int | None = None,
        chat_template: str | None = None,
        ready: int | None = None,
    ):
        self.max_copies = max_copies or default_max_copies()
        if self.max_copies < 1:
            raise ValueError("max_copies must be positive")
        self._original = tokenizer
        self._chat_template = chat_template
        self._cond = threading.Condition()
        count = min(self.max_copies, MIN_COPIES if ready is None else ready)
        start = time.perf_counter()
        self._free: list[Any] = [self._copy() for _ in range(count)]
        self._num_made = len(self._free)
        if self._free:
            log.info("tokenizer: %d copies for the HTTP threads in %.2f s", self._num_made,
                     time.perf_counter() - start)  # fmt: skip

    @property
    def num_made(self) -> int:
        """Copies made so far (at most `max_copies`)."""
        return self._num_made

    @property
    def num_lent(self) -> int:
        """Copies a borrower holds now."""
        with self._cond:
            return self._num_made - len(self._free)

    @contextmanager
    def borrow(self) -> Iterator[Any]:
        """A copy nobody else uses until the `with` block ends."""
        tokenizer = self._take()
        try:
            yield tokenizer
        finally:
            with self._cond:
                self._free.append(tokenizer)
                self._cond.notify()

    def _take(self) -> Any:
        with self._cond:
            while not self._free and self._num_made >= self.max_copies:
                self._cond.wait()
            if self._free:
                return self._free.pop()
            self._num_made += 1
        try:  # outside the lock: a copy takes tens of milliseconds
            return self._copy()
        except BaseException:
            with self._cond:
                self._num_made -= 1
                self._cond.notify()
            raise

    def _copy(self) -> Any:
        made = copy.deepcopy(self._original)
        if self._chat_template is not None:
            made.chat_template = self._chat_template  # the copy is this pool's own
        return made
