"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: a body is read as the chat
request it means, answered by the chat code, and the answer reshaped.

    {"model", "input": str | [items], "instructions"?, "max_output_tokens"?, "temperature"?,
     "top_p"?, "stream"?, "tools"?: [{"type": "function", "name", "parameters"?, ...}],
     "tool_choice"?, "text"?: {"format": {"type": "text" | "json_object" | "json_schema", ...}},
     "reasoning"?: {"effort"}, "metadata"?, "user"?, "store"?, "parallel_tool_calls"?, ...}

Input items: messages (`role`, `content` as text or `input_text` / `output_text` parts), the
model's earlier `function_call`s and the caller's `function_call_output`s, which become the
chat's assistant `tool_calls` and `tool` messages; `instructions` a system message first. The
answer is a `response` object whose `output` holds one `message` (its `output_text`) or one
`function_call`, `status` "incomplete" with `incomplete_details.reason` "max_output_tokens" where
the token limit ended it, and `usage` as `input_tokens` / `output_tokens`. Streamed, OpenAI's
typed events (`response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ..., `response.completed` or `response.incomplete`;
an `error` event and `response.failed` where generation fails), numbered by `sequence_number`.
Nothing is stored: `previous_response_id`, `conversation`, `background` and the other fields of
a stored or hosted response are a 400 by name, as are hosted tools (`web_search`, ...).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

from flask import Response, jsonify

from toppings.server.api.openai.fields import check_known_fields, json_type
from toppings.server.api.openai.schema import IGNORED_HEADER
from toppings.server.requests.request import RequestError

PASSED = ("model", "temperature", "top_p", "stream", "metadata", "user", "store", "service_tier",
          "parallel_tool_calls")  # fmt: skip
READ = frozenset({*PASSED, "input", "instructions", "max_output_tokens", "tools", "tool_choice",
                  "text", "reasoning", "truncation", "safety_identifier", "prompt_cache_key",
                  "stream_options"})  # fmt: skip
STATEFUL = ("previous_response_id", "conversation", "background", "prompt", "include")
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")


def _text(content: Any, where: str) -> str | list[dict]:
    """A message's content as chat content: text, or its text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise RequestError(f"{where}.content must be a string or a non-empty list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            raise RequestError(f"{where}.content[{j}] must be an input_text or output_text part")
        parts.append({"type": "text", "text": part.get("text")})
    return parts


def _message(item: Any, where: str) -> dict:
    """One input item as a chat message."""
    if not isinstance(item, dict):
        raise RequestError(f"{where} must be an object, not {json_type(item)}")
    kind = item.get("type", "message")
    if kind == "message":
        if item.get("role") not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}")
        return {"role": item["role"], "content": _text(item.get("content"), where)}
    if kind == "function_call":
        call_id, name, arguments = _strings(item, ("call_id", "name", "arguments"), where)
        function = {"name": name, "arguments": arguments}
        call = {"id": call_id, "type": "function", "function": function}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        call_id, output = _strings(item, ("call_id", "output"), where)
        return {"role": "tool", "tool_call_id": call_id, "content": output}
    raise RequestError(f"{where}.type {str(kind)[:64]!r} is not supported by this server "
                       "(message, function_call, function_call_output)")  # fmt: skip


def _strings(item: dict, keys: tuple[str, ...], where: str) -> list[str]:
    """The string fields `keys` of an input item; a 400 naming the first that is not one."""
    for key in keys:
        if not isinstance(item.get(key), str):
            raise RequestError(f"{where}.{key} must be a string, not {json_type(item.get(key))}")
    return [item[key] for key in keys]


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise RequestError(f"tools[{i}]: only function tools are supported by this server")
        fields = {k: v for k, v in tool.items() if k != "type"}
        out.append({"type": "function", "function": fields})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise RequestError("'tool_choice' must be 'none', 'auto', 'required' or "
                               "{'type': 'function', 'name': ...}")  # fmt: skip
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice  # "none", "auto", "required", or what the chat parser refuses


def _response_format(text: Any) -> dict | None:
    if not isinstance(text, dict):
        raise RequestError("'text' must be an object")
    check_known_fields(text, {"format", "verbosity"}, "'text'")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise RequestError("'text.format.type' must be 'text', 'json_object' or 'json_schema'")
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if not isinstance(fmt.get("schema"), dict):
        raise RequestError("'text.format.schema' must be a JSON schema object")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def chat_body(body: dict) -> dict:
    """The chat request a Responses body means; raises RequestError for what it cannot mean."""
    for key in STATEFUL:
        if body.get(key) not in (None, False, []):
            raise RequestError(f"'{key}' is not supported by this server: it stores no response")
    check_known_fields(body, READ | set(STATEFUL), "/v1/responses")
    if body.get("truncation") not in (None, "disabled"):
        raise RequestError("'truncation' must be 'disabled': a prompt past the context is a 400")
    given = body.get("input")
    if isinstance(given, str):
        messages = [{"role": "user", "content": given}]
    elif isinstance(given, list) and given:
        messages = [_message(item, f"input[{i}]") for i, item in enumerate(given)]
    else:
        raise RequestError("'input' must be a string or a non-empty list of items")
    if body.get("instructions") is not None:
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    chat = {key: body[key] for key in PASSED if key in body}
    chat["messages"] = messages
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise RequestError("'max_output_tokens' must be a positive integer")
        chat["max_completion_tokens"] = limit
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("text") is not None:
        chat["response_format"] = _response_format(body["text"])
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise RequestError("'reasoning' must be an object")
        check_known_fields(reasoning, {"effort", "summary", "generate_summary"}, "'reasoning'")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    for key in ("safety_identifier", "prompt_cache_key"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise RequestError(f"'{key}' must be a string, not {json_type(body[key])}")
    if body.get("stream_options") is not None and not body.get("stream"):
        raise RequestError("'stream_options' needs 'stream': true")
    if body.get("stream"):
        chat["stream_options"] = {"include_usage": True}  # for the final event's usage
    return chat


def ignored(body: dict) -> list[str]:
    """The Responses fields read and ignored here (the chat's own are named by the chat path)."""
    nested = [("reasoning", "summary"), ("reasoning", "generate_summary"), ("text", "verbosity")]
    named = [k for k in ("safety_identifier", "prompt_cache_key") if body.get(k) is not None]
    return named + [f"{a}.{b}" for a, b in nested
                    if isinstance(body.get(a), dict) and body[a].get(b) is not None]  # fmt: skip


class Reshaper:
    """Makes chat answers of one Responses request into its response object and events."""

    def __init__(self, body: dict):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.body = body
        self.sequence = 0

    def response(self, status: str, output: list[dict], usage: dict | None, model: str) -> dict:
        body = self.body
        length = status == "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": model, "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if length else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "metadata": body.get("metadata") or {}, "user": body.get("user"),
            "previous_response_id": None, "store": False, "truncation": "disabled",
            "reasoning": {"effort": None, "summary": None},
        }  # fmt: skip

    def answer(self, chat: Response) -> Response:
        """The Responses answer of the chat path's (an error passes as it is)."""
        if chat.status_code != 200:
            return chat
        kept = {k: v for k, v in chat.headers.items() if k.startswith("X-")}  # ignored fields...
        names = [n for n in [kept.get(IGNORED_HEADER, "")] + ignored(self.body) if n]
        if names:
            kept[IGNORED_HEADER] = ", ".join(names)
        if chat.mimetype != "text/event-stream":
            answer = jsonify(self.whole(chat.get_json()))
            answer.headers.update(kept)
            return answer
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kept}
        return Response(self._events(chat.response), mimetype="text/event-stream", headers=headers)

    def whole(self, reply: dict) -> dict:
        """The response object of a chat completion (one choice)."""
        choice = reply["choices"][0]
        message, status = choice["message"], _status(choice["finish_reason"])
        output = [_call_item(c, status) for c in message.get("tool_calls") or ()]
        if not output:
            output = [_message_item(message.get("content") or "", status)]
        return self.response(status, output, _usage(reply.get("usage")), reply["model"])

    def _event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"

    def _events(self, chat_events: Iterable[str]) -> Iterator[str]:
        """The typed events of a chat stream's chunks; closing this closes the chat stream
        (which aborts the request and gives its slot back)."""
        try:
            yield from _Stream(self).events(chat_events)
        finally:
            close = getattr(chat_events, "close", None)
            if close is not None:
                close()


class _Stream:
    """One streamed answer: the output item open (a message or a function call), its text."""

    def __init__(self, shape: Reshaper):
        self.shape = shape
        self.model = shape.body.get("model")
        self.item: dict | None = None
        self.output: list[dict] = []
        self.finish: str | None = None
        self.usage: dict | None = None

    def events(self, chat_events: Iterable[str]) -> Iterator[str]:
        ev = self.shape._event
        start = self.shape.response("in_progress", [], None, self.model)
        yield ev("response.created", response=start)
        yield ev("response.in_progress", response=start)
        for raw in chat_events:
            if not raw.startswith("data: ") or raw.startswith("data: [DONE]"):
                continue
            chunk = json.loads(raw[6:])
            if "error" in chunk:
                error = chunk["error"]
                yield ev("error", code=error.get("type"), message=error.get("message"), param=None)
                failed = self.shape.response("failed", self.output, None, self.model)
                failed["error"] = {"code": error.get("type"), "message": error.get("message")}
                yield ev("response.failed", response=failed)
                return
            self.model = chunk.get("model", self.model)
            if chunk.get("usage"):
                self.usage = _usage(chunk["usage"])
            for choice in chunk.get("choices") or ():
                yield from self._delta(choice.get("delta") or {})
                self.finish = choice.get("finish_reason") or self.finish
        status = _status(self.finish)
        yield from self._close(status)
        final = self.shape.response(status, self.output, self.usage, self.model)
        yield ev(f"response.{status}", response=final)

    def _delta(self, delta: dict) -> Iterator[str]:
        ev = self.shape._event
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if call.get("id"):  # a call begins: its id and name
                yield from self._open(_call_item({"id": call["id"], "function": {
                    "name": function.get("name"), "arguments": ""}}, "in_progress"))  # fmt: skip
            fragment = function.get("arguments") or ""
            if fragment and self.item is not None and self.item["type"] == "function_call":
                self.item["arguments"] += fragment
                yield ev("response.function_call_arguments.delta", item_id=self.item["id"],
                         output_index=len(self.output), delta=fragment)  # fmt: skip
        text = delta.get("content")
        if text:
            if self.item is None or self.item["type"] != "message":
                yield from self._open(_message_item("", "in_progress"))
            self.item["content"][0]["text"] += text
            yield ev("response.output_text.delta", item_id=self.item["id"],
                     output_index=len(self.output), content_index=0, delta=text,
                     logprobs=[])  # fmt: skip

    def _open(self, item: dict) -> Iterator[str]:
        """The open item done, then `item` added (and a message's text part)."""
        yield from self._close()
        self.item, ev, index = item, self.shape._event, len(self.output)
        yield ev("response.output_item.added", output_index=index, item=item)
        if item["type"] == "message":
            yield ev("response.content_part.added", item_id=item["id"], output_index=index,
                     content_index=0, part=_text_part(""))  # fmt: skip

    def _close(self, status: str = "completed") -> Iterator[str]:
        """The done events of the open item, if any (incomplete: the token limit cut it)."""
        item, self.item = self.item, None
        if item is None:
            return
        ev, index = self.shape._event, len(self.output)
        item["status"] = status
        if item["type"] == "function_call":
            yield ev("response.function_call_arguments.done", item_id=item["id"],
                     output_index=index, arguments=item["arguments"])  # fmt: skip
        else:
            text = item["content"][0]["text"]
            yield ev("response.output_text.done", item_id=item["id"], output_index=index,
                     content_index=0, text=text, logprobs=[])  # fmt: skip
            yield ev("response.content_part.done", item_id=item["id"], output_index=index,
                     content_index=0, part=_text_part(text))  # fmt: skip
        yield ev("response.output_item.done", output_index=index, item=item)
        self.output.append(item)


def _status(finish_reason: str | None) -> str:
    """A response's (and its last item's) status: incomplete where the token limit cut it, as
    OpenAI marks it."""
    return "incomplete" if finish_reason == "length" else "completed"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def _message_item(text: str, status: str) -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status,
            "role": "assistant", "content": [_text_part(text)]}  # fmt: skip


def _call_item(call: dict, status: str) -> dict:
    function = call["function"]
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": function["name"], "arguments": function["arguments"],
            "status": status}  # fmt: skip


def _usage(usage: dict | None) -> dict | None:
    if not usage:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip
