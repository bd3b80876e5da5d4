"""Per-request state the engine thread keeps: tokens so far, timings, the finishes it knows.

Pure Python (the scheduler runs without torch): sampling and logprobs live with the model
runner (server/sampling/sampler.py). The text side (detokenizing, stop strings, the outputs on
the handle) is text_output.py's: each new token and the finish go there as an `OutputRecord`,
applied at once on this thread or handed to an output sink (the engine's output processor
thread).

A request taken out of the running batch (preempted for KV memory, or squashed by Chameleon)
resumes where it was (`resume`, vLLM's recompute preemption): its prompt and the tokens it has
made are its prefill when it is admitted again (most of their KV still cached, under its
adapter), and its next token is sampled after them. Nothing is computed twice that was sent,
so any request may be taken out: its client sees one stream, whatever ran in between."""

from __future__ import annotations

from typing import Protocol

from toppings.server.requests.errors import CONSTRAINT_FAILED
from toppings.server.requests.request import GenerationRequest, RequestHandle, TokenLogprob
from toppings.server.requests.stats_schema import RequestView
from toppings.server.requests.text_output import OutputRecord, TextOutput


class OutputSink(Protocol):
    """Where a request's records go when they are not applied at once (the output processor,
    server/engine/output_processor.py): applied later, in order, on another thread."""

    def emit(self, record: OutputRecord) -> None: ...


class Sequence:
    """One request inside the engine, from queueing to its final output."""

    def __init__(
        self,
        request: GenerationRequest,
        handle: RequestHandle,
        tokenizer,
        arrival: float,
        outputs: OutputSink | None = None,
    ):
        """outputs: where its records go (None: applied at once, on the caller's thread)."""
        self.request = request
        self.handle = handle
        self.arrival = arrival
        self.prompt_len = len(request.prompt_ids)
        # What its next admission prefills: the prompt, and after a resume the tokens made too
        self.prefill_ids: list[int] = request.prompt_ids
        self.kv_need = self.prompt_len + request.params.max_new_tokens
        self.output_ids: list[int] = []
        self._kv_hold = None
        self.num_cached_tokens = 0  # of the latest admission (usage.prompt_tokens_details)
        # Prefill tokens whose KV the row holds (a reused prefix, then computed chunks); it is
        # prefilled once this reaches prefill_len (chunked prefill spreads it over steps).
        self.num_prefilled = 0
        self.cache_entry = None  # gpu_lora.cache.CacheEntry while it holds a reference
        # The first prompt position its adapter applies to: 0, or past an activated LoRA's
        # invocation (set by the engine at submission, server/adapters/step.py lora_start).
        self.lora_start = 0
        # Whether its adapter is an activated LoRA: its KV before lora_start is the base
        # model's, cached and matched as such (server/memory/manager.py).
        self.is_activated = False
        self.finish_reason: str | None = None  # as the engine ended it (None: running)
        self.output = TextOutput(request, handle, tokenizer, arrival)
        self._outputs = outputs
        # Set by the sampler when the request's grammar is complete with the token append()
        # records next and allows nothing after it: the request stops there.
        self.step_ends_grammar = False
        # Set by the sampler when the request's grammar matcher failed on the token append()
        # records next: the request ends there with this error (answered 422).
        self.step_grammar_error: str | None = None
        self._grammar_failure: str | None = None
        self._prompt_logprobs: list[TokenLogprob | None] | None = None  # sent once, first
        self._scored: list[TokenLogprob | None] | None = None  # the chunks' so far

    @property
    def kv_hold(self):
        """server.memory.KVHold while admitted: its KV row and blocks; None otherwise."""
        return self._kv_hold

    @kv_hold.setter
    def kv_hold(self, hold) -> None:
        # The cached prompt tokens are kept past the release, for the final output (those of
        # its first admission: a resumed request finds its own blocks again).
        self._kv_hold = hold
        if hold is not None and self.prefill_len == self.prompt_len:
            self.num_cached_tokens = hold.cached_tokens

    @property
    def prefill_len(self) -> int:
        """Tokens its admission prefills: the prompt's, and the outputs' after a resume."""
        return len(self.prefill_ids)

    def resume(self) -> None:
        """It left the batch (its KV given back, cached): it waits again, and its next
        admission prefills its prompt and the tokens it has made, then samples the next one.
        Its sampler state (random generator, grammar matcher) is kept: it goes on."""
        if self.output_ids:
            self.prefill_ids = self.request.prompt_ids + self.output_ids
        self.num_prefilled = 0

    @property
    def scores_prompt(self) -> bool:
        """Whether its prompt's logprobs are asked and not yet sent: each prompt row goes
        through the LM head (a resumed request sent them with its first token)."""
        return self.request.params.prompt_logprobs is not None and not self.output_ids

    @property
    def is_prefilled(self) -> bool:
        """Whether the whole prefill's KV is computed (the request decodes from here on)."""
        return self.num_prefilled >= self.prefill_len

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

    def add_prompt_logprobs(self, start: int, end: int, scored: list[TokenLogprob]) -> None:
        """The logprobs a prefill chunk of prompt positions start .. end - 1 scored: of the
        prompt tokens start + 1 .. start + len(scored) (the first token has none, the last
        position predicts the output). Once a chunk reaches the prompt's end, all of them are
        sent with the next output. A chunk from 0 starts over (after a resume)."""
        if start == 0:
            self._scored = [None]
        elif self._scored is None or len(self._scored) != start + 1:
            raise RuntimeError("prompt logprobs need every prompt position computed in order")
        self._scored.extend(scored)
        if end >= self.prompt_len:
            self._prompt_logprobs, self._scored = self._scored, None

    def append(
        self,
        token: int,
        eos_ids: set[int],
        max_model_len: int,
        logprob: TokenLogprob | None = None,
    ) -> str | None:
        """Record a new token (with its logprob, where the request asked for them) and send it
        to the text side; returns a finish reason when the request is done (a stop string's
        only where the records are applied at once)."""
        params = self.request.params
        if params.max_new_tokens == 0:
            return "length"  # the prompt was only scored
        ends_grammar, self.step_ends_grammar = self.step_ends_grammar, False
        grammar_error, self.step_grammar_error = self.step_grammar_error, None
        self.output_ids.append(token)
        is_eos = (token in eos_ids and not params.ignore_eos) or token in params.stop_token_ids
        reason = None
        if grammar_error is not None:
            self._grammar_failure = grammar_error
            reason = "error"
        elif is_eos or ends_grammar:
            reason = "stop"
        elif (len(self.output_ids) >= params.max_new_tokens
              or self.prompt_len + len(self.output_ids) >= max_model_len):  # fmt: skip
            reason = "length"
        if self._outputs is not None:
            self._emit(OutputRecord(self, self.output, token, logprob, is_eos, reason))
            return reason
        # At once, on this thread, without a record (the engine thread's hot path)
        if self._prompt_logprobs is not None:
            self.output.add_prompt_logprobs(self._prompt_logprobs)
            self._prompt_logprobs = None
        hit = self.output.take(token, logprob, is_eos, reason, self.num_cached_tokens)
        return "stop" if hit else reason  # a stop string, found at once (never over an error)

    @property
    def finished(self) -> bool:
        """Whether the engine ended it (its final output sent or on its way)."""
        return self.finish_reason is not None

    def finish(self, reason: str, error: str | None = None) -> None:
        """Send the final output (with any held-back text) exactly once."""
        if self.finished:
            return
        self.finish_reason = reason
        record = OutputRecord(self, self.output, finish=reason, error=error)
        if reason == "error" and self._grammar_failure is not None:
            record.error, record.error_code = self._grammar_failure, 422
            record.error_type = CONSTRAINT_FAILED
        self._emit(record)

    def _emit(self, record: OutputRecord) -> None:
        """Hand a finish or (with the output thread) token record to the text side."""
        record.cached_tokens = self.num_cached_tokens
        record.prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, None
        if self._outputs is None:
            self.output.apply(record)
        else:
            self._outputs.emit(record)
