"""Per-request state the engine thread keeps: tokens so far, text stream, sampler, timings."""

from __future__ import annotations

import time

import torch

from toppings.server.detokenize import TextStream
from toppings.server.request import GenerationRequest, RequestHandle, RequestOutput
from toppings.server.sampling import make_generator, sample_next
from toppings.server.stats_schema import RequestView


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
        self.row: int | None = None  # KV pool row while admitted
        self.cache_entry = None  # gpu_lora.cache.CacheEntry while it holds a reference
        self.finished = False
        self._stream = TextStream(tokenizer, request.params.stop)
        self._generator = make_generator(request.params)
        self._first_token_at: float | None = None
        self._pending_ids: list[int] = []
        self._pending_text = ""

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
    def sample_batch(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """Next token of each sequence from its row of logits [B, V]."""
        return sample_next(logits, [s.request.params for s in seqs], [s._generator for s in seqs])

    def append(self, token: int, eos_ids: set[int], max_model_len: int) -> str | None:
        """Record a new token and stream it; returns a finish reason when the request is done."""
        params = self.request.params
        if self._first_token_at is None:
            self._first_token_at = time.monotonic()
        self.output_ids.append(token)
        self._pending_ids.append(token)
        is_eos = token in eos_ids and not params.ignore_eos
        if not is_eos:
            self._pending_text += self._stream.push(token)
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
            )
        )
        self._pending_ids, self._pending_text = [], ""
