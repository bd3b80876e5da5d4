"""Per-request state the engine thread keeps: tokens so far, text stream, timings, finish.

Pure Python (the scheduler runs without torch): sampling and logprobs live with the model
runner (server/sampling/sampler.py), which keys each request's random generator on
`num_restarts` so that a restarted request samples its tokens again from the seed."""

from __future__ import annotations

import time

from toppings.server.requests.detokenize import TextStream
from toppings.server.requests.errors import CONSTRAINT_FAILED, SERVER_ERROR
from toppings.server.requests.request import (
    GenerationRequest,
    RequestHandle,
    RequestOutput,
    TokenLogprob,
)
from toppings.server.requests.stats_schema import RequestView


class Sequence:
    """One request inside the engine, from queueing to its final output."""

    def __init__(
        self, request: GenerationRequest, handle: RequestHandle, tokenizer, arrival: float
    ):
        self.request = request
        self.handle = handle
        self.arrival = arrival
        self.prompt_len = len(request.prompt_ids)
        self.kv_need = self.prompt_len + request.params.max_new_tokens
        self.output_ids: list[int] = []
        self._kv_hold = None
        self.num_cached_tokens = 0  # of the latest admission (usage.prompt_tokens_details)
        # Prompt tokens whose KV the row holds (a reused prefix, then computed chunks); the
        # prompt is prefilled once this reaches prompt_len (chunked prefill spreads it over steps).
        self.num_prefilled = 0
        self.cache_entry = None  # gpu_lora.cache.CacheEntry while it holds a reference
        # The first prompt position its adapter applies to: 0, or past an activated LoRA's
        # invocation (set by the engine at submission, server/adapters/step.py lora_start).
        self.lora_start = 0
        # Whether its adapter is an activated LoRA: its KV before lora_start is the base
        # model's, cached and matched as such (server/memory/manager.py).
        self.is_activated = False
        self.finished = False
        self._tokenizer = tokenizer
        self._stream = TextStream(tokenizer, request.params.stop)
        self.num_restarts = 0  # a sampler re-creates the request's generator when this moves
        # Set by the sampler when the request's grammar is complete with the token append()
        # records next and allows nothing after it: the request stops there.
        self.step_ends_grammar = False
        # Set by the sampler when the request's grammar matcher failed on the token append()
        # records next: the request ends there with this error (answered 422).
        self.step_grammar_error: str | None = None
        self._grammar_failure: str | None = None
        self._first_token_at: float | None = None
        self._pending_ids: list[int] = []
        self._pending_text = ""
        self._pending_logprobs: list[TokenLogprob] = []
        self._prompt_logprobs: list[TokenLogprob | None] | None = None  # sent once, first
        self._num_sent = 0  # tokens streamed before a restart, not sent again when replayed

    @property
    def kv_hold(self):
        """server.memory.KVHold while admitted: its KV row and blocks; None otherwise."""
        return self._kv_hold

    @kv_hold.setter
    def kv_hold(self, hold) -> None:
        # The cached prompt tokens are kept past the release, for the final output.
        self._kv_hold = hold
        if hold is not None:
            self.num_cached_tokens = hold.cached_tokens

    def restart(self) -> None:
        """Run again from the prompt after a squash: the tokens already streamed are computed
        again (the same ones: only greedy or seeded requests are squashed) but not resent."""
        self._num_sent = len(self.output_ids)
        self.output_ids = []
        self.num_prefilled = 0
        self._stream = TextStream(self._tokenizer, self.request.params.stop)
        self.num_restarts += 1
        self._pending_ids, self._pending_text, self._pending_logprobs = [], "", []
        self.step_ends_grammar = False
        self.step_grammar_error = None

    @property
    def is_prefilled(self) -> bool:
        """Whether the whole prompt's KV is computed (the request decodes from here on)."""
        return self.num_prefilled >= self.prompt_len

    def describe(self) -> RequestView:
        """The /stats view of this request."""
        adapter = self.request.adapter
        return RequestView(
            id=self.request.request_id,
            adapter=adapter.name if adapter is not None else None,
            rank=adapter.rank if adapter is not None else 0,
            prompt_tokens=self.prompt_len,
            output_tokens=len(self.output_ids),
            max_new_tokens=self.request.params.max_new_tokens,
        )

    def set_prompt_logprobs(self, scored: list[TokenLogprob]) -> None:
        """The prompt's token logprobs (the first token has none); sent with the next output."""
        self._prompt_logprobs = [None, *scored]

    def append(
        self,
        token: int,
        eos_ids: set[int],
        max_model_len: int,
        logprob: TokenLogprob | None = None,
    ) -> str | None:
        """Record a new token (with its logprob, where the request asked for them) and stream
        it; returns a finish reason when the request is done."""
        params = self.request.params
        if params.max_new_tokens == 0:
            return "length"  # the prompt was only scored
        replayed = len(self.output_ids) < self._num_sent
        if logprob is not None and not replayed:
            self._pending_logprobs.append(logprob)
        ends_grammar, self.step_ends_grammar = self.step_ends_grammar, False
        grammar_error, self.step_grammar_error = self.step_grammar_error, None
        if self._first_token_at is None:
            self._first_token_at = time.monotonic()
        self.output_ids.append(token)
        is_eos = token in eos_ids and not params.ignore_eos
        text = "" if is_eos else self._stream.push(token)
        if replayed:
            return None  # sent before the restart (it was running, so no stop was hit then)
        self._pending_ids.append(token)
        self._pending_text += text
        if grammar_error is not None:
            self._grammar_failure = grammar_error
            return "error"
        if is_eos or self._stream.stopped or ends_grammar:
            return "stop"
        if len(self.output_ids) >= params.max_new_tokens:
            return "length"
        if self.prompt_len + len(self.output_ids) >= max_model_len:
            return "length"
        self._flush(None, None)
        return None

    def finish(self, reason: str, error: str | None = None) -> None:
        """Send the final output (with any held-back text) exactly once."""
        if self.finished:
            return
        self.finished = True
        if reason in ("stop", "length"):
            self._pending_text += self._stream.finish()
        if reason == "error" and self._grammar_failure is not None:
            self._flush(reason, self._grammar_failure, 422, CONSTRAINT_FAILED)
            return
        self._flush(reason, error)

    def _flush(
        self,
        reason: str | None,
        error: str | None,
        error_code: int = 500,
        error_type: str = SERVER_ERROR,
    ) -> None:
        if not (self._pending_ids or self._pending_text or reason):
            return
        wants_logprobs = self.request.params.logprobs is not None
        now = time.monotonic()
        ttft = None if self._first_token_at is None else self._first_token_at - self.arrival
        self.handle.put(
            RequestOutput(
                request_id=self.request.request_id,
                new_token_ids=self._pending_ids,
                new_text=self._pending_text,
                finish_reason=reason,
                error=error,
                error_code=error_code,
                error_type=error_type,
                prompt_tokens=self.prompt_len,
                cached_tokens=self.num_cached_tokens,
                output_tokens=len(self.output_ids),
                ttft_s=ttft,
                e2e_s=now - self.arrival if reason else None,
                logprobs=self._pending_logprobs if wants_logprobs else None,
                prompt_logprobs=self._prompt_logprobs,
            )
        )
        self._pending_ids, self._pending_text, self._pending_logprobs = [], "", []
        self._prompt_logprobs = None
