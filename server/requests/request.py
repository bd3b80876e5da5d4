"""What crosses between the HTTP layer and the engine: a request in, a stream of outputs back.

The engine thread owns every request's state; handlers only submit, read `RequestHandle.events()`
and `abort()`. A request names its adapter by reference (adapter_ref.py), resolved from the
client's name by the API. Validation that needs the model (prompt length, an adapter unloaded
since it was resolved) happens in `Engine.submit`, which raises `RequestError` with a message fit
for the client.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum

from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.errors import SERVER_ERROR

MAX_STOP_STRINGS = 16
# Characters of one stop string: the detokenizer holds back that much text and searches it at
# every token, so an unbounded stop string made each token cost the whole output so far.
MAX_STOP_CHARS = 1024
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's limit for top_logprobs)
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
MAX_STOP_TOKEN_IDS = 64  # entries of stop_token_ids (a set looked up at every token)
MAX_ALLOWED_TOKEN_IDS = 4096  # entries of allowed_token_ids (held while the request runs)


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


class ConstraintKind(Enum):
    """What a constraint's `spec` is written in."""

    JSON_SCHEMA = "json_schema"  # a JSON schema, as JSON text
    REGEX = "regex"  # a regular expression the whole output matches
    CHOICE = "choice"  # a JSON array of strings: the output is exactly one of them
    GRAMMAR = "grammar"  # a context-free grammar (GBNF/EBNF or Lark)


MAX_CONSTRAINT_CHARS = 100_000  # the text of one schema, regex or grammar


@dataclass(frozen=True)
class Constraint:
    """Structured output: the request's text must be derivable from `spec` (see
    server/sampling/grammar.py, which compiles it and masks the request's logits)."""

    kind: ConstraintKind
    spec: str
    # The request field it came from ("guided_json", ...), for messages; not part of its identity
    source: str = dataclasses.field(default="", compare=False)

    @property
    def what(self) -> str:
        """How a message names it: the field and the kind, or the kind alone."""
        return f"'{self.source}' ({self.kind.value})" if self.source else self.kind.value

    def __post_init__(self) -> None:
        if len(self.spec) > MAX_CONSTRAINT_CHARS:
            raise RequestError(
                f"the {self.what} is {len(self.spec)} characters; this server takes at "
                f"most {MAX_CONSTRAINT_CHARS}"
            )


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings; temperature 0 means greedy.

    Penalties follow vLLM: `repetition_penalty` (1: off) divides positive and multiplies
    negative logits of every token seen in the prompt or the output; `frequency_penalty` and
    `presence_penalty` (0: off) subtract count * f and [count > 0] * p for output tokens;
    `logit_bias` adds to the named tokens' logits; EOS is masked until `min_tokens` tokens.
    `logprobs` asks for each output token's log-probability and that many top alternatives
    (None: none), `prompt_logprobs` the same for every prompt token after the first.
    `constraint` (None: free text) limits every sampled token to those its grammar allows.
    `max_new_tokens` 0 (only with prompt_logprobs) scores the prompt and generates nothing.
    `stop_token_ids` end the request as EOS does, `ignore_eos` or not (vLLM's): finish reason
    "stop", no text of their own, masked with EOS until `min_tokens`. `include_stop_str_in_output`
    keeps the stop string that ended the text at its end. `skip_special_tokens` False writes the
    special tokens' text too (EOS and stop tokens still end without theirs).
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    min_p: float = 0.0  # 0: off; else drop tokens under min_p x the top token's probability
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    stop_token_ids: frozenset[int] = frozenset()
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: the only tokens it may sample (): all
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool):
            raise RequestError("max_new_tokens must be an integer")
        if self.max_new_tokens < 0 or (self.max_new_tokens == 0 and self.prompt_logprobs is None):
            raise RequestError("max_new_tokens must be at least 1 (0 only to score the prompt)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise RequestError("repetition_penalty must be in (0, 10]")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise RequestError("min_tokens must be in [0, max_new_tokens]")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens")
        if any(not -100.0 <= bias <= 100.0 for _, bias in self.logit_bias):
            raise RequestError("logit_bias values must be in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise RequestError(f"{name} must be in [0, {MAX_LOGPROBS}]")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError("temperature must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise RequestError("top_k must be >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestError("min_p must be in [0, 1]")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise RequestError(f"stop must hold 1 to {MAX_STOP_STRINGS} non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise RequestError(f"a stop string may hold at most {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids")
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
            raise RequestError(f"allowed_token_ids may hold at most {MAX_ALLOWED_TOKEN_IDS} ids")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @functools.cached_property
    def takes_argmax(self) -> bool:
        """Whether the token is the raw logits' argmax and nothing else is read from them: greedy,
        no processors, no grammar, no logprobs (the sampler's fast path; computed once)."""
        return (
            self.is_greedy
            and not self.has_processors
            and self.constraint is None
            and self.logprobs is None
        )

    @property
    def has_processors(self) -> bool:
        """Whether the logits are changed before the token is chosen."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
            or self.logit_bias
            or self.allowed_token_ids
        )


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model and the `top` most likely tokens there.

    Log-softmax in float32 of the model's logits at that position, before penalties, logit bias
    and temperature (vLLM's default, "raw logprobs"). `top` is (token id, logprob), best first;
    `rank` the token's place in the vocabulary by logprob (1: none above it; None: not known).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


_ids = itertools.count(1)


@dataclass
class GenerationRequest:
    """One generation: token ids in (already templated and tokenized), an adapter (None: the
    base model)."""

    prompt_ids: list[int]
    params: SamplingParams
    adapter: AdapterRef | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")


@dataclass(slots=True)  # not frozen: that sets each field through object.__setattr__, and the
class RequestOutput:  # engine makes one per request and step (read-only by convention)
    """One step of a request's stream: the new tokens and text since the previous output.

    `finish_reason` is set on the last output only: "stop" (EOS or a stop string), "length"
    (max_new_tokens or the context), "abort", or "error" (then `error` says why); with "stop",
    `stop_reason` is the stop string that ended it or the token id of `stop_token_ids` that
    did, as vLLM reports it (None: EOS, or a grammar's end).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    # With finish_reason "error": the HTTP status and error type the client is answered with
    error_code: int = 500
    error_type: str = SERVER_ERROR
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output only; [0] is None


class RequestHandle:
    """The client side of a submitted request: a queue the engine writes and a handler reads."""

    def __init__(self, request: GenerationRequest, abort_fn):
        self.request = request
        # SimpleQueue: the engine puts one output per request and step, and Queue's put (a
        # condition, its lock and notify in Python) cost more than the rest of it
        self._outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        # Called after each put: lets one reader wait on many handles (server.request_group).
        self.on_put: Callable[[], None] | None = None
        self._abort_fn = abort_fn
        self._finished = threading.Event()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def put(self, output: RequestOutput) -> None:
        """Engine side: deliver one output (the last one carries finish_reason)."""
        self._outputs.put(output)
        if self.on_put is not None:
            self.on_put()

    def events(self, timeout_s: float | None = None) -> Iterator[RequestOutput]:
        """Yield outputs as the engine produces them, up to and including the final one."""
        while True:
            out = self._outputs.get(timeout=timeout_s)
            yield out
            if out.finish_reason is not None:
                self._finished.set()
                return

    def poll(self) -> list[RequestOutput]:
        """The outputs delivered so far and not read yet, without waiting."""
        outs = []
        while True:
            try:
                out = self._outputs.get_nowait()
            except queue.Empty:
                return outs
            outs.append(out)
            if out.finish_reason is not None:
                self._finished.set()

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
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs = None
    last = None
    for out in outputs:
        ids.extend(out.new_token_ids)
        text.append(out.new_text)
        if out.logprobs is not None:
            logprobs = logprobs or []
            logprobs.extend(out.logprobs)
        prompt_logprobs = prompt_logprobs or out.prompt_logprobs
        last = out
    if last is None:
        raise RuntimeError("the engine ended a request without a final output")
    return dataclasses.replace(
        last,
        new_token_ids=ids,
        new_text="".join(text),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
