"""The answer of a Responses request (`POST /v1/responses`, read by responses_api) made of the
chat path's: a `response` object, or OpenAI's typed events made of the chat's streamed chunks.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

from flask import Response, jsonify

from toppings.server.api.openai.responses_api import ignored
from toppings.server.api.openai.schema import IGNORED_HEADER


class Reshaper:
    """Makes chat answers of one Responses request into its response object and events."""

    def __init__(self, body: dict):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.body = body
        self.sequence = 0

    def response(
        self, status: str, output: list[dict], usage: dict | None, model: str,
        finish: str | None = None,
    ) -> dict:  # fmt: skip
        """The response object; `finish` the chat's finish_reason (why it is incomplete)."""
        body = self.body
        cut = status == "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": model, "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": INCOMPLETE[finish]} if cut else None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "metadata": body.get("metadata") or {}, "user": body.get("user"),
            "previous_response_id": None, "store": False, "truncation": "disabled",
            "reasoning": {"effort": None, "summary": None},
            "top_logprobs": body.get("top_logprobs") or 0,
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
        finish = choice["finish_reason"]
        message, status = choice["message"], _status(finish)
        output = [_call_item(c, status) for c in message.get("tool_calls") or ()]
        if not output:
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            if finish == "stop" and not isinstance(choice.get("stop_reason"), str):
                logprobs = logprobs[:-1]  # the stop token's: no text of its own, as OpenAI's
            output = [_message_item(message.get("content") or "", status, logprobs)]
        return self.response(status, output, _usage(reply.get("usage")), reply["model"], finish)

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
        self.logprobs: list[dict] = []  # those of tokens whose text has not come yet

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
                self.logprobs += (choice.get("logprobs") or {}).get("content") or ()
                yield from self._delta(choice.get("delta") or {})
                self.finish = choice.get("finish_reason") or self.finish
        status = _status(self.finish)
        yield from self._close(status)
        final = self.shape.response(status, self.output, self.usage, self.model, self.finish)
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
            part, logprobs, self.logprobs = self.item["content"][0], self.logprobs, []
            part["text"] += text
            part["logprobs"] += logprobs
            yield ev("response.output_text.delta", item_id=self.item["id"],
                     output_index=len(self.output), content_index=0, delta=text,
                     logprobs=logprobs)  # fmt: skip

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
            part = item["content"][0]
            self.logprobs = []  # a stop token's, which has no text: OpenAI gives none
            yield ev("response.output_text.done", item_id=item["id"], output_index=index,
                     content_index=0, text=part["text"], logprobs=part["logprobs"])  # fmt: skip
            yield ev("response.content_part.done", item_id=item["id"], output_index=index,
                     content_index=0, part=part)  # fmt: skip
        yield ev("response.output_item.done", output_index=index, item=item)
        self.output.append(item)


# Finish reasons that leave a response incomplete -> its `incomplete_details.reason`: the token
# limit (OpenAI's own reason), or the server ending it (a drain past its timeout).
INCOMPLETE = {"length": "max_output_tokens", "abort": "interrupted"}


def _status(finish_reason: str | None) -> str:
    """A response's (and its last item's) status: incomplete where the token limit or the server
    cut it, as OpenAI marks it."""
    return "incomplete" if finish_reason in INCOMPLETE else "completed"


def _text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    """An output_text part; `logprobs` the chat's entries of its tokens (token, logprob,
    bytes, top_logprobs: the shape OpenAI's Responses API gives them too)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(text: str, status: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status,
            "role": "assistant", "content": [_text_part(text, logprobs)]}  # fmt: skip


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
