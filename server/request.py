"""What crosses between the HTTP layer and the engine: a request in, a stream of outputs back.

The engine thread owns every request's state; handlers only submit, read `RequestHandle.events()`
and `abort()`. Validation that needs the model (prompt length, adapter names) happens in
`Engine.submit`, which raises `RequestError` with a message fit for the client.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

MAX_STOP_STRINGS = 16


class RequestError(ValueError):
    """The client asked for something invalid; `code` is the HTTP status to answer with, and
    `retry_after_s` (if set) its Retry-After header."""

    def __init__(
        self,
        message: str,
        code: int = 400,
        error_type: str = "invalid_request_error",
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.error_type = error_type
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings; temperature 0 means greedy."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool):
            raise RequestError("max_new_tokens must be an integer")
        if self.max_new_tokens < 1:
            raise RequestError("max_new_tokens must be at least 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError("temperature must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise RequestError("top_k must be >= 0")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise RequestError(f"stop must hold 1 to {MAX_STOP_STRINGS} non-empty strings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


_ids = itertools.count(1)


@dataclass
class GenerationRequest:
    """One generation: token ids in (already templated and tokenized), an adapter name or None."""

    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")


@dataclass(frozen=True)
class RequestOutput:
    """One step of a request's stream: the new tokens and text since the previous output.

    `finish_reason` is set on the last output only: "stop" (EOS or a stop string), "length"
    (max_new_tokens or the context), "abort", or "error" (then `error` says why).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None


class RequestHandle:
    """The client side of a submitted request: a queue the engine writes and a handler reads."""

    def __init__(self, request: GenerationRequest, abort_fn):
        self.request = request
        self._outputs: queue.Queue[RequestOutput] = queue.Queue()
        self._abort_fn = abort_fn
        self._finished = threading.Event()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def put(self, output: RequestOutput) -> None:
        """Engine side: deliver one output (the last one carries finish_reason)."""
        self._outputs.put(output)

    def events(self, timeout_s: float | None = None) -> Iterator[RequestOutput]:
        """Yield outputs as the engine produces them, up to and including the final one."""
        while True:
            out = self._outputs.get(timeout=timeout_s)
            yield out
            if out.finish_reason is not None:
                self._finished.set()
                return

    def result(self, timeout_s: float | None = None) -> RequestOutput:
        """Wait for the end and merge every output into one."""
        return merge_outputs(self.events(timeout_s))

    def abort(self) -> None:
        """Ask the engine to stop this request (a client that went away); idempotent."""
        if not self._finished.is_set():
            self._abort_fn(self.request_id)


def merge_outputs(outputs: Iterable[RequestOutput]) -> RequestOutput:
    """One output with all the token ids and text of a request's stream, and its final fields."""
    ids: list[int] = []
    text: list[str] = []
    last = None
    for out in outputs:
        ids.extend(out.new_token_ids)
        text.append(out.new_text)
        last = out
    if last is None:
        raise RuntimeError("the engine ended a request without a final output")
    return dataclasses.replace(last, new_token_ids=ids, new_text="".join(text))
