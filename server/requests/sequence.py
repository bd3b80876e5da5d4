"""Per-request state the engine thread keeps: tokens so far, text stream, sampler, timings."""

from __future__ import annotations

import time

import torch

from toppings.server.engine.logits import process_row, token_logprobs
from toppings.server.engine.sampling import make_generator, sample_next
from toppings.server.requests.detokenize import TextStream
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
        self.kv_hold = None  # server.memory.KVHold while admitted: its KV row and blocks
        self.cache_entry = None  # gpu_lora.cache.CacheEntry while it holds a reference
        self.finished = False
        self._tokenizer = tokenizer
        self._stream = TextStream(tokenizer, request.params.stop)
        self._generator = make_generator(request.params)
        self._first_token_at: float | None = None
        self._pending_ids: list[int] = []
        self._pending_text = ""
        self._pending_logprobs: list[TokenLogprob] = []
        self._step_logprob: TokenLogprob | None = None  # of the token append() records next
        self._prompt_logprobs: list[TokenLogprob | None] | None = None  # sent once, first
        self._num_sent = 0  # tokens streamed before a restart, not sent again when replayed

    def restart(self) -> None:
        """Run again from the prompt after a squash: the tokens already streamed are computed
        again (the same ones: only greedy or seeded requests are squashed) but not resent."""
        self._num_sent = len(self.output_ids)
        self.output_ids = []
        self._stream = TextStream(self._tokenizer, self.request.params.stop)
        self._generator = make_generator(self.request.params)
        self._pending_ids, self._pending_text, self._pending_logprobs = [], "", []
        self._step_logprob = None

    def describe(self, adapters: dict) -> RequestView:
        """The /stats view of this request."""
        name = self.request.adapter
        return RequestView(
            id=self.request.request_id,
            adapter=name,
            rank=adapters[name].rank if name in adapters else 0,
            prompt_tokens=self.prompt_len,
            output_tokens=len(self.output_ids),
            max_new_tokens=self.request.params.max_new_tokens,
        )

    @staticmethod
    def logit_rows(seqs: list[Sequence], seg_starts: list[int]) -> list[int] | None:
        """Prefill: the token rows whose logits the step needs, when a sequence wants its
        prompt scored (every row of its segment); None: each segment's last row only."""
        if all(s.request.params.prompt_logprobs is None for s in seqs):
            return None
        rows: list[int] = []
        for seq, start, end in zip(seqs, seg_starts[:-1], seg_starts[1:]):
            whole = seq.request.params.prompt_logprobs is not None
            rows.extend(range(start if whole else end - 1, end))
        return rows

    @staticmethod
    def score_prompts(
        seqs: list[Sequence], logits: torch.Tensor, seg_starts: list[int]
    ) -> torch.Tensor:
        """Keep the prompt logprobs of the sequences that asked (logits of `logit_rows`,
        [R, V]); returns the logits of each sequence's last prompt token, [B, V]."""
        if logits.shape[0] == len(seqs):
            return logits
        last, offset = [], 0
        for seq, start, end in zip(seqs, seg_starts[:-1], seg_starts[1:]):
            k = seq.request.params.prompt_logprobs
            if k is not None:
                ids = seq.request.prompt_ids
                if end - start != len(ids):  # e.g. a reused prefix was not computed again
                    raise RuntimeError("prompt logprobs need the whole prompt in the prefill")
                scored = token_logprobs(logits[offset : offset + len(ids) - 1], ids[1:], k)
                seq._prompt_logprobs = [None, *scored]
                offset += len(ids) - 1
            last.append(offset)
            offset += 1
        return logits[last]

    @staticmethod
    def sample_batch(seqs: list[Sequence], logits: torch.Tensor, eos_ids: set[int]) -> list[int]:
        """Next token of each sequence from its row of logits [B, V] float32.

        Rows with penalties, a logit bias or min_tokens are processed first; the logprobs asked
        for are taken from the unprocessed rows (see server.logits)."""
        params = [s.request.params for s in seqs]
        chosen_from = logits
        if any(p.has_processors for p in params):
            chosen_from = logits.clone()
            for i, (seq, p) in enumerate(zip(seqs, params)):
                if p.has_processors:
                    prompt = seq.request.prompt_ids
                    chosen_from[i] = process_row(logits[i], p, prompt, seq.output_ids, eos_ids)
        tokens = sample_next(chosen_from, params, [s._generator for s in seqs])
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            k = max(params[i].logprobs for i in want)
            scored = token_logprobs(logits[want], [tokens[i] for i in want], k)
            for i, lp in zip(want, scored):
                top = lp.top[: params[i].logprobs]
                seqs[i]._step_logprob = TokenLogprob(lp.token_id, lp.logprob, top)
        return tokens

    def append(self, token: int, eos_ids: set[int], max_model_len: int) -> str | None:
        """Record a new token and stream it; returns a finish reason when the request is done."""
        params = self.request.params
        if params.max_new_tokens == 0:
            return "length"  # the prompt was only scored
        replayed = len(self.output_ids) < self._num_sent
        if self._step_logprob is not None and not replayed:
            self._pending_logprobs.append(self._step_logprob)
        self._step_logprob = None
        if self._first_token_at is None:
            self._first_token_at = time.monotonic()
        self.output_ids.append(token)
        is_eos = token in eos_ids and not params.ignore_eos
        text = "" if is_eos else self._stream.push(token)
        if replayed:
            return None  # sent before the restart (it was running, so no stop was hit then)
        self._pending_ids.append(token)
        self._pending_text += text
        if is_eos or self._stream.stopped:
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
        self._flush(reason, error)

    def _flush(self, reason: str | None, error: str | None) -> None:
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
                prompt_tokens=self.prompt_len,
                output_tokens=len(self.output_ids),
                ttft_s=ttft,
                e2e_s=now - self.arrival if reason else None,
                logprobs=self._pending_logprobs if wants_logprobs else None,
                prompt_logprobs=self._prompt_logprobs,
            )
        )
        self._pending_ids, self._pending_text, self._pending_logprobs = [], "", []
        self._prompt_logprobs = None
