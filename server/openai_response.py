"""Response bodies and server-sent-event streams for the generation endpoints.

OpenAI responses follow the OpenAI schema (`text_completion`, `chat.completion` and their
`.chunk` stream forms, `usage`). The native `/generate` response is
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
from dataclasses import dataclass
from typing import Any

from toppings.server.errors import SERVER_ERROR, error_body
from toppings.server.openai_schema import ParsedBody
from toppings.server.request import RequestOutput

SSE_DONE = "data: [DONE]\n\n"
ID_PREFIX = {"completion": "cmpl", "chat": "chatcmpl", "native": "gen"}
OBJECT = {"completion": "text_completion", "chat": "chat.completion"}


def sse(obj: dict) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


@dataclass(frozen=True)
class ResponseMeta:
    """What every response and chunk of one request repeats."""

    id: str
    created: int
    model: str
    prompt_tokens: int

    @classmethod
    def new(cls, parsed: ParsedBody, prompt_tokens: int) -> ResponseMeta:
        rid = f"{ID_PREFIX[parsed.kind]}-{uuid.uuid4().hex[:24]}"
        return cls(rid, int(time.time()), parsed.model, prompt_tokens)


def _usage(meta: ResponseMeta, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": meta.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": meta.prompt_tokens + completion_tokens,
    }


def _native(meta: ResponseMeta, out: RequestOutput, output_tokens: int) -> dict:
    return {
        "text": out.new_text,
        "token_ids": out.new_token_ids,
        "prompt_tokens": meta.prompt_tokens,
        "output_tokens": output_tokens,
        "ttft_s": out.ttft_s,
        "e2e_s": out.e2e_s,
        "finish_reason": out.finish_reason,
    }


def final_response(parsed: ParsedBody, meta: ResponseMeta, out: RequestOutput) -> dict:
    """The whole response of a non-streaming request; `out` is the merged RequestOutput."""
    num_out = out.output_tokens or len(out.new_token_ids)
    if parsed.kind == "native":
        return _native(meta, out, num_out)
    if parsed.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": out.new_text}}
    else:
        choice = {"index": 0, "text": out.new_text}
    choice.update(logprobs=None, finish_reason=out.finish_reason)
    return {
        "id": meta.id,
        "object": OBJECT[parsed.kind],
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": _usage(meta, num_out),
    }


def _chunk(parsed: ParsedBody, meta: ResponseMeta, choices: list[dict]) -> dict:
    chunk = {
        "id": meta.id,
        "object": "chat.completion.chunk" if parsed.kind == "chat" else "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
    }
    if parsed.include_usage:
        chunk["usage"] = None  # OpenAI: null on every chunk but the last, usage-only one
    return chunk


def _choice(parsed: ParsedBody, text: str, finish_reason: str | None) -> dict:
    if parsed.kind == "chat":
        delta = {"content": text} if text or finish_reason is None else {}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def stream_events(
    parsed: ParsedBody, meta: ResponseMeta, outputs: Iterable[RequestOutput]
) -> Iterator[str]:
    """Server-sent events for a stream of engine outputs, up to and including `[DONE]`."""
    if parsed.kind == "chat":
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        yield sse(_chunk(parsed, meta, [dict(role, finish_reason=None)]))
    num_out = 0
    for out in outputs:
        num_out += len(out.new_token_ids)
        if out.finish_reason == "error":
            if out.new_text or out.new_token_ids:
                yield from _delta_events(parsed, meta, out, num_out, None)
            yield sse(error_body(out.error or "generation failed", 500, SERVER_ERROR))
            break
        yield from _delta_events(parsed, meta, out, num_out, out.finish_reason)
    else:
        if parsed.include_usage:
            yield sse(dict(_chunk(parsed, meta, []), usage=_usage(meta, num_out)))
    yield SSE_DONE


def _delta_events(
    parsed: ParsedBody, meta: ResponseMeta, out: RequestOutput, num_out: int, finish: str | None
) -> Iterator[str]:
    """The event (zero or one) for one engine output; `num_out` counts output tokens so far."""
    if parsed.kind == "native":
        if finish is None:
            yield sse({"text": out.new_text, "token_ids": out.new_token_ids})
        else:
            yield sse(_native(meta, out, out.output_tokens or num_out))
    elif out.new_text or finish is not None:
        # Tokens whose text is still an incomplete UTF-8 sequence come later as text.
        yield sse(_chunk(parsed, meta, [_choice(parsed, out.new_text, finish)]))


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
