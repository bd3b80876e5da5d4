"""A request's text side: its tokens' text, its stop strings and the outputs its client reads.

vLLM v1's split between the engine core and its output processor. The engine thread keeps a
request's token-level state (sequence.py: its output ids and the finishes it knows, EOS, length,
a grammar's end or failure) and describes what happened to it in `OutputRecord`s: a new token,
the finish. A `TextOutput` takes the records in order, turns the tokens into text
(detokenize.py's `TextStream`), cuts it at a stop string and puts each `RequestOutput` on the
request's handle. The records are applied either at once on the engine thread (a token's
fields then go to `take` without a record) or on the output processor's thread
(server/engine/output_processor.py), which takes this work off the step's critical path where
the engine thread waits on a device.

A stop string is known only here. Applied at once, the engine ends the request on the token
that completed it, as before the split. Applied on the output thread, the engine has moved on by
then: the request is `stopped` (nothing after the stop string is sent; its token ids and counts
end at the token that completed it), the processor asks the engine to end it, and the final
output goes out with the engine's finish record, a step or a few later. So on every path the
final output follows the engine's release of the request's KV, as before the split (with async
scheduling: its release when its step returns), and on the output thread its adapter
reference's release too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from toppings.server.requests.detokenize import TextStream
from toppings.server.requests.errors import SERVER_ERROR
from toppings.server.requests.request import (
    GenerationRequest,
    RequestHandle,
    RequestOutput,
    TokenLogprob,
)


@dataclass(slots=True)
class OutputRecord:
    """What the engine thread tells a request's text side: a new token (token not None) or the
    finish (finish not None, the last record of the request)."""

    seq: object  # the Sequence (sequence.py, which imports this module): what a stop ends
    output: TextOutput
    token: int | None = None
    logprob: TokenLogprob | None = None
    is_eos: bool = False  # an EOS token: no text of its own
    # The finish this token brings, as the engine knows it ("stop" by EOS or a grammar's end,
    # "length", "error" by a grammar failure): its finish record follows.
    ends: str | None = None
    finish: str | None = None
    error: str | None = None
    error_code: int = 500
    error_type: str = SERVER_ERROR
    prompt_logprobs: list[TokenLogprob | None] | None = None  # sent with the next output
    cached_tokens: int = 0  # its prompt tokens found cached at its latest admission


class TextOutput:
    """One request's text stream and outputs; its records are applied on one thread at a time,
    in the order the engine made them."""

    def __init__(
        self, request: GenerationRequest, handle: RequestHandle, tokenizer, arrival: float
    ):
        self._request = request
        self._handle = handle
        self._arrival = arrival
        self._stream = TextStream.of(tokenizer, request.params)
        self._num_tokens = 0  # tokens taken: usage's output_tokens
        self._first_token_at: float | None = None
        self._pending_ids: list[int] = []
        self._pending_text = ""
        self._pending_logprobs: list[TokenLogprob] = []
        self._prompt_logprobs: list[TokenLogprob | None] | None = None
        self._cached_tokens = 0
        # The finish its tokens decided ("stop", "length", "error"); tokens past it are dropped
        self._ends: str | None = None
        self._stop_reason: str | int | None = None  # RequestOutput.stop_reason, once it ends
        self.finished = False  # its final output was put on the handle

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended it (its final output waits for the finish record)."""
        return self._stream.stopped

    def apply(self, record: OutputRecord) -> bool:
        """Take one record; True when its token completed a stop string (the engine, which
        does not know it yet, should end the request)."""
        if self.finished:
            return False
        if record.prompt_logprobs is not None:
            self._prompt_logprobs = record.prompt_logprobs
        if record.finish is not None:
            self._cached_tokens = record.cached_tokens
            self._finish(record)
            return False
        return self.take(
            record.token, record.logprob, record.is_eos, record.ends, record.cached_tokens
        )

    def take(
        self,
        token: int,
        logprob: TokenLogprob | None,
        is_eos: bool,
        ends: str | None,
        cached_tokens: int,
    ) -> bool:
        """A token record's fields (`OutputRecord`), without the record: how the engine thread
        applies a token at once. True when it completed a stop string."""
        if self._ends is not None or self.finished:
            return False  # the engine made it past its end (a stop it did not know yet)
        self._cached_tokens = cached_tokens
        if logprob is not None:
            self._pending_logprobs.append(logprob)
        if self._first_token_at is None:
            self._first_token_at = time.monotonic()
        self._num_tokens += 1
        text = "" if is_eos else self._stream.push(token)
        self._pending_ids.append(token)
        self._pending_text += text
        if ends == "error":  # a grammar failure: it wins over a stop on the same token
            self._ends = "error"
        elif self._stream.stopped:
            self._ends, self._stop_reason = "stop", self._stream.stop_string
            return True
        elif ends is not None:
            self._ends = ends
            if ends == "stop" and is_eos and token in self._request.params.stop_token_ids:
                self._stop_reason = token
        else:
            self._flush(None, None)
        return False

    def add_prompt_logprobs(self, scored: list[TokenLogprob | None]) -> None:
        """The prompt's logprobs, sent with the next output (the engine thread, at once)."""
        self._prompt_logprobs = scored

    def fail(self, error: str) -> None:
        """End it with an error now (its text could not be made); later records are dropped."""
        self.finished = True
        self._flush("error", error)

    def _finish(self, record: OutputRecord) -> None:
        """The final output, exactly once: the finish its tokens decided, else the engine's."""
        self.finished = True
        reason = self._ends or record.finish
        if reason in ("stop", "length"):
            self._pending_text += self._stream.finish()
        if reason == record.finish:
            self._flush(reason, record.error, record.error_code, record.error_type)
        else:
            self._flush(reason, None)

    def _flush(
        self,
        reason: str | None,
        error: str | None,
        error_code: int = 500,
        error_type: str = SERVER_ERROR,
    ) -> None:
        if not (self._pending_ids or self._pending_text or reason):
            return
        wants_logprobs = self._request.params.logprobs is not None
        now = time.monotonic()
        ttft = None if self._first_token_at is None else self._first_token_at - self._arrival
        self._handle.put(
            RequestOutput(
                request_id=self._request.request_id,
                new_token_ids=self._pending_ids,
                new_text=self._pending_text,
                finish_reason=reason,
                stop_reason=self._stop_reason if reason == "stop" else None,
                error=error,
                error_code=error_code,
                error_type=error_type,
                prompt_tokens=len(self._request.prompt_ids),
                cached_tokens=self._cached_tokens,
                output_tokens=self._num_tokens,
                ttft_s=ttft,
                e2e_s=now - self._arrival if reason else None,
                logprobs=self._pending_logprobs if wants_logprobs else None,
                prompt_logprobs=self._prompt_logprobs,
            )
        )
        self._pending_ids, self._pending_text, self._pending_logprobs = [], "", []
        self._prompt_logprobs = None
