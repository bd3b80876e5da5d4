"""Response bodies and server-sent-event streams for the generation endpoints.

OpenAI responses follow the OpenAI schema (`text_completion`, `chat.completion` and their
`.chunk` stream forms, `usage` on every response), with one choice per prompt x n, numbered
prompt-major; logprobs in the shapes of `server.openai_logprobs`. `usage.prompt_tokens` counts
each prompt once (not n times), `completion_tokens` every choice's tokens (as vLLM does), and
`prompt_tokens_details.cached_tokens` the prompt tokens whose KV came from the prefix cache
(each prompt's first choice). A stream with `stream_options.include_usage` has `"usage": null`
on every chunk and ends with a usage-only chunk; with `continuous_usage_stats` too, every chunk
carries instead the usage of its own choice so far (its prompt's tokens, its tokens; vLLM's form).
With `echo`, a completion choice's text (its first chunk, streamed) starts with the prompt's.
A chat choice that is a tool call (server.api.openai.tool_calls) has `tool_calls` instead of
content; streamed, the call goes out as OpenAI's deltas (the id and name, then fragments of the
arguments as they are generated) and its last chunk carries the finish reason.
The native `/generate` response is
`{"text", "token_ids", "prompt_tokens", "output_tokens", "ttft_s", "e2e_s", "finish_reason"}`;
its stream sends `{"text", "token_ids"}` deltas, then one final object with the same keys as the
response (text and token ids of that last delta only). Every stream ends with `data: [DONE]`. A
generation that fails mid-stream sends one `{"error": {...}}` event before `[DONE]`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from toppings.server.api.openai.logprobs import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from toppings.server.api.openai.schema import ParsedBody
from toppings.server.api.openai.tool_calls import CallStream, reply_call
from toppings.server.requests.errors import error_body
from toppings.server.requests.request import RequestOutput

SSE_DONE = "data: [DONE]\n\n"
ID_PREFIX = {"completion": "cmpl", "chat": "chatcmpl", "native": "gen"}
OBJECT = {"completion": "text_completion", "chat": "chat.completion"}


def sse(obj: dict) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


@dataclass(frozen=True)
class ResponseMeta:
    """What every response and chunk of one request repeats, and what echo and logprobs need:
    each prompt's token ids and (with echo) text, and the token-text decoder."""

    id: str
    created: int
    model: str
    prompt_tokens: int
    prompt_ids: tuple[tuple[int, ...], ...] = ()
    echo_texts: tuple[str, ...] = ()
    token_text: TokenText | None = field(default=None, compare=False)

    @classmethod
    def new(
        cls,
        parsed: ParsedBody,
        prompt_ids: list[list[int]],
        token_text: TokenText | None = None,
        echo_texts: tuple[str, ...] = (),
    ) -> ResponseMeta:
        rid = f"{ID_PREFIX[parsed.kind]}-{uuid.uuid4().hex[:24]}"
        ids = tuple(tuple(p) for p in prompt_ids)
        num = sum(len(p) for p in ids)
        return cls(rid, int(time.time()), parsed.model, num, ids, echo_texts, token_text)


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def _native(meta: ResponseMeta, out: RequestOutput, output_tokens: int) -> dict:
    return {
        "text": out.new_text,
        "token_ids": out.new_token_ids,
        "prompt_tokens": meta.prompt_tokens,
        "output_tokens": output_tokens,
        "ttft_s": out.ttft_s,
        "e2e_s": out.e2e_s,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
    }


class _Choice:
    """One choice's text and logprobs as its outputs arrive (whole, or delta by delta)."""

    def __init__(self, parsed: ParsedBody, meta: ResponseMeta, index: int):
        self.parsed, self.meta, self.index = parsed, meta, index
        self.prompt_idx = index // parsed.n
        self.started = False
        self.offset = 0  # characters of this choice's text so far (completions text_offset)
        self.num_tokens = 0  # output tokens of this choice so far (continuous usage)
        tools = parsed.tools if parsed.kind == "chat" else None
        # The deltas of a reply that may be a tool call.
        self.calls = CallStream(tools) if tools is not None and tools.calls_expected else None

    def usage(self) -> dict | None:
        """This choice's usage so far, for a chunk of a continuous-usage stream; else None."""
        if not (self.parsed.include_usage and self.parsed.continuous_usage):
            return None
        prompt = self.meta.prompt_ids[self.prompt_idx] if self.meta.prompt_ids else ()
        return _usage(len(prompt), self.num_tokens)

    def delta(self, out: RequestOutput) -> tuple[str, dict | None]:
        """The text and logprobs object of one output (the first carries the echo)."""
        parsed, meta = self.parsed, self.meta
        text, tokens = out.new_text, list(zip(out.new_token_ids, out.logprobs or ()))
        if not self.started and parsed.echo:
            prompt = meta.prompt_ids[self.prompt_idx]
            text = meta.echo_texts[self.prompt_idx] + text
            if parsed.logprobs is not None:
                tokens = list(zip(prompt, out.prompt_logprobs or [None] * len(prompt))) + tokens
        self.started = True
        if parsed.logprobs is None:
            return text, None
        if parsed.kind == "chat":
            return text, chat_logprobs((lp for _, lp in tokens), meta.token_text)
        logprobs, self.offset = completion_logprobs(tokens, meta.token_text, self.offset)
        return text, logprobs


def final_response(parsed: ParsedBody, meta: ResponseMeta, outs: list[RequestOutput]) -> dict:
    """The whole response of a non-streaming request; `outs`: each choice's merged output."""
    num_out = sum(out.output_tokens or len(out.new_token_ids) for out in outs)
    if parsed.kind == "native":
        return _native(meta, outs[0], num_out)
    choices = []
    for idx, out in enumerate(outs):
        text, logprobs = _Choice(parsed, meta, idx).delta(out)
        finish = out.finish_reason
        if parsed.kind == "chat":
            message = {"role": "assistant", "content": text}
            call = None
            if parsed.tools is not None:
                call, finish = reply_call(parsed.tools, text, finish)
            if call is not None:
                message = {"role": "assistant", "content": None, "tool_calls": [call.openai()]}
            choice = {"index": idx, "message": message}
        else:
            choice = {"index": idx, "text": text}
        choice.update(logprobs=logprobs, finish_reason=finish, stop_reason=out.stop_reason)
        if parsed.prompt_logprobs is not None and parsed.kind == "completion":
            choice["prompt_logprobs"] = prompt_logprobs(
                out.prompt_logprobs, parsed.prompt_logprobs, meta.token_text
            )
        choices.append(choice)
    response = {
        "id": meta.id,
        "object": OBJECT[parsed.kind],
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "usage": _usage(meta.prompt_tokens, num_out, _cached(outs, parsed.n)),
    }
    if parsed.prompt_logprobs is not None and parsed.kind == "chat":  # vLLM's place for chat
        scored = outs[0].prompt_logprobs
        response["prompt_logprobs"] = prompt_logprobs(scored, parsed.prompt_logprobs,
                                                      meta.token_text)  # fmt: skip
    return response


def _cached(outs: list[RequestOutput], n: int) -> int:
    """Prompt tokens served from the prefix cache, counting each prompt once (its first
    choice's, as `prompt_tokens` counts each prompt once)."""
    return sum(out.cached_tokens for out in outs[::n])


def _chunk(
    parsed: ParsedBody, meta: ResponseMeta, choices: list[dict], usage: dict | None = None
) -> dict:
    chunk = {
        "id": meta.id,
        "object": "chat.completion.chunk" if parsed.kind == "chat" else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
    }
    if parsed.include_usage:
        # OpenAI: null on every chunk but the last, usage-only one (unless continuous).
        chunk["usage"] = usage
    return chunk


def _chunk_choice(
    parsed: ParsedBody,
    idx: int,
    text: str,
    logprobs: dict | None,
    finish_reason: str | None,
    stop_reason: str | int | None = None,
) -> dict:
    """A streamed choice; `stop_reason` (vLLM's) on every chunk, null but on the last."""
    ends = {"finish_reason": finish_reason, "stop_reason": stop_reason}
    if parsed.kind == "chat":
        delta = {"content": text} if text or finish_reason is None else {}
        return {"index": idx, "delta": delta, "logprobs": logprobs, **ends}
    return {"index": idx, "text": text, "logprobs": logprobs, **ends}


def stream_events(
    parsed: ParsedBody, meta: ResponseMeta, outputs: Iterable[tuple[int, RequestOutput]]
) -> Iterator[str]:
    """Server-sent events for the engine outputs of every choice (choice index, output), in
    the order they arrive, up to and including `[DONE]`."""
    num_choices = parsed.n * len(meta.prompt_ids or [()])
    choices = [_Choice(parsed, meta, idx) for idx in range(num_choices)]
    if parsed.kind == "chat":
        for idx in range(num_choices):
            role = {"index": idx, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None, "stop_reason": None}  # fmt: skip
            yield sse(_chunk(parsed, meta, [role], choices[idx].usage()))
    num_out = 0
    cached: dict[int, int] = {}  # prompt index -> its first choice's cached prompt tokens
    for idx, out in outputs:
        num_out += len(out.new_token_ids)
        choices[idx].num_tokens += len(out.new_token_ids)
        if idx % parsed.n == 0:
            cached[choices[idx].prompt_idx] = out.cached_tokens
        if out.finish_reason == "error":
            if out.new_text or out.new_token_ids:
                yield from _delta_events(parsed, meta, choices[idx], out, num_out, None)
            yield sse(error_body(out.error or "generation failed", out.error_code, out.error_type))
            break
        yield from _delta_events(parsed, meta, choices[idx], out, num_out, out.finish_reason)
    else:
        if parsed.include_usage:
            usage = _usage(meta.prompt_tokens, num_out, sum(cached.values()))
            yield sse(dict(_chunk(parsed, meta, []), usage=usage))
    yield SSE_DONE


def _delta_events(
    parsed: ParsedBody,
    meta: ResponseMeta,
    choice: _Choice,
    out: RequestOutput,
    num_out: int,
    finish: str | None,
) -> Iterator[str]:
    """The event (zero or one) for one engine output; `num_out` counts output tokens so far."""
    if parsed.kind == "native":
        if finish is None:
            yield sse({"text": out.new_text, "token_ids": out.new_token_ids})
        else:
            yield sse(_native(meta, out, out.output_tokens or num_out))
        return
    text, logprobs = choice.delta(out)
    if choice.calls is not None:
        # Tools are refused with logprobs (server.api.openai.schema): a delta is text or a call's
        # part.
        deltas = choice.calls.feed(text)
        if finish is not None:
            last, finish = choice.calls.finish(finish)
            deltas = deltas + last if deltas or last else [{}]  # the last delta has the reason
        for i, delta in enumerate(deltas):
            reason = finish if i == len(deltas) - 1 else None
            chosen = {
                "index": choice.index,
                "delta": delta,
                "logprobs": None,
                "finish_reason": reason,
                "stop_reason": out.stop_reason if reason is not None else None,
            }
            yield sse(_chunk(parsed, meta, [chosen], choice.usage()))
        return
    has_logprobs = logprobs is not None and any(logprobs.get(k) for k in ("content", "tokens"))
    # A chunk for every output that brought tokens, its text empty while that is an
    # incomplete UTF-8 sequence or a possible stop string's start (the text comes later), as
    # vLLM streams: the client sees each token when it is made, and its time to first token is
    # the first token's, not the first whole character's.
    if text or out.new_token_ids or has_logprobs or finish is not None:
        chosen = _chunk_choice(parsed, choice.index, text, logprobs, finish, out.stop_reason)
        yield sse(_chunk(parsed, meta, [chosen], choice.usage()))


def models_response(base_model: str, adapters: list[dict], created: int) -> dict:
    """`GET /v1/models`: the base model, then each adapter with `parent` = the base model."""

    def card(name: str, parent: str | None, extra: dict[str, Any]) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "toppings",
            "root": name,
            "parent": parent,
            **extra,
        }

    data = [card(base_model, None, {})]
    for a in adapters:
        data.append(card(a["name"], base_model, {"rank": a.get("rank")}))
    return {"object": "list", "data": data}
