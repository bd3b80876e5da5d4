"""The tool call a chat reply makes (server.api.openai.tools says what the request asked), whole and
streamed as OpenAI's `tool_calls` deltas.

The arguments of a call are the JSON text of ARGS as the model wrote it, never re-serialized, so
that the fragments of a streamed call join to exactly the call of the same reply unstreamed.

- "required" / named (the output is constrained to `{"name": NAME, "arguments": ARGS}`, in
  that order, so its shape is known): the reply is a call from the moment NAME is complete
  (`CallScanner`). Streamed, the first delta `{"index": 0, "id", "type": "function",
  "function": {"name": NAME, "arguments": ""}}` goes out then, and each later delta
  `{"index": 0, "function": {"arguments": FRAGMENT}}` carries the text of ARGS certain so far:
  the closing `}` of the wrapper (and whitespace after a number) is never sent. The call ends
  with `finish_reason: "tool_calls"` when ARGS is complete and generation stopped on its own;
  a call cut short (by `max_tokens` or a stop string) keeps its partial arguments and the
  engine's finish reason. Output that ends before NAME is complete is text.
- "auto": the reply is a call only when all of it, once finished with "stop", is one call
  object (`parse_call`): text after a complete object would make it text again, so nothing
  before the end is certain. Streamed, a reply that may still become a call (whitespace, then
  `{` or `<tool_call>`) is held back; at the end it goes out as the two deltas of a call (name,
  then all the arguments) or as one content delta. A reply that cannot be a call streams as
  content from the first character that shows it (the held text first), as it would without
  tools.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from toppings.server.api.openai.tools import ToolChoice, Tools
from toppings.server.requests.errors import nests_too_deep

TOOL_CALLS = "tool_calls"  # the finish reason of a reply that is a complete tool call
TAG = "<tool_call>"
TAGGED = re.compile(r"^\s*<tool_call>(.*)</tool_call>\s*$", re.DOTALL)
_WS = r"[ \t\n\r]*"  # JSON's whitespace, as `json` skips it
JSON_SPACE = re.compile(_WS)
# A constrained call up to the closing quote of NAME, then what leads to ARGS.
CALL_NAME = re.compile(_WS + r"\{" + _WS + '"name"' + _WS + ":" + _WS + '"([A-Za-z0-9_-]{1,64})"')
ARGUMENTS_KEY = re.compile(_WS + "," + _WS + '"arguments"' + _WS + ":")


@dataclass(frozen=True)
class Call:
    """A call a reply makes: the function's name and the JSON text of its arguments."""

    name: str
    arguments: str

    def openai(self) -> dict:
        """The call as one entry of OpenAI's `message.tool_calls`, with a new id."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": new_call_id(), "type": "function", "function": function}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallScanner:
    """Reads a constrained call's text, `{"name": NAME, "arguments": ARGS}`, as it grows: NAME
    once complete, and the prefix of ARGS that is certainly part of ARGS. Each character is read
    once (a string, an object or array to its matching close, or a number or literal up to the
    character after it)."""

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self.is_complete = False  # ARGS has ended
        self._after_name = 0  # where the text after NAME starts
        self._pos: int | None = None  # where reading ARGS goes on (None: its key has not come)
        self._start: int | None = None  # where ARGS starts
        self._end = 0  # where its certain text ends
        self._depth = 0  # objects and arrays open in ARGS
        self._in_string = False
        self._escaped = False  # the previous character was a backslash inside a string

    @property
    def arguments(self) -> str:
        """The text of ARGS certain so far."""
        return "" if self._start is None else self.text[self._start : self._end]

    def feed(self, text: str) -> None:
        self.text += text
        if self.name is None:
            head = CALL_NAME.match(self.text)
            if head is None:
                return
            self.name, self._after_name = head.group(1), head.end()
        if self._pos is None:
            key = ARGUMENTS_KEY.match(self.text, self._after_name)
            if key is None:
                return
            self._pos = key.end()
        if not self.is_complete:
            self._read()

    def _read(self) -> None:
        text, pos = self.text, self._pos
        assert pos is not None
        for i in range(pos, len(text)):
            c = text[i]
            if self._start is None:
                if c in " \t\n\r":
                    continue
                self._start = i
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]" and self._depth > 0:
                self._depth -= 1
            elif self._depth == 0 and c in " \t\n\r,}]":  # a number or literal has ended
                self.is_complete = True
                return
            self._end = i + 1
            if self._depth == 0 and not self._in_string and text[self._start] in '{["':
                self.is_complete = True
                return
        self._pos = len(text)


def _members(text: str) -> dict[str, str] | None:
    """The JSON text of each member of the one JSON object that `text` is (a repeated key: its
    last value, as `json.loads` keeps), or None when `text` is not exactly one object."""
    if nests_too_deep(text):  # a reply nested past what the parser should recurse into
        return None
    decoder = json.JSONDecoder()
    start = JSON_SPACE.match(text).end()
    try:
        value, end = decoder.raw_decode(text, start)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or JSON_SPACE.match(text, end).end() != len(text):
        return None
    members = {}
    idx = JSON_SPACE.match(text, start + 1).end()
    while text[idx] != "}":
        key, idx = decoder.raw_decode(text, idx)
        idx = JSON_SPACE.match(text, JSON_SPACE.match(text, idx).end() + 1).end()  # past ':'
        _, end = decoder.raw_decode(text, idx)
        members[key], idx = text[idx:end], JSON_SPACE.match(text, end).end()
        if text[idx] == ",":
            idx = JSON_SPACE.match(text, idx + 1).end()
    return members


def parse_call(tools: Tools, text: str) -> Call | None:
    """The call of an "auto" reply: all of `text` one object `{"name": NAME, "arguments": {...}}`
    (or `"parameters"`, optionally inside `<tool_call>` tags) naming one of `tools`; else None."""
    tagged = TAGGED.match(text)
    members = _members(tagged.group(1) if tagged else text)
    if members is None or "name" not in members:
        return None
    name = json.loads(members["name"])
    if name not in tools.names():
        return None
    arguments = members.get("arguments", members.get("parameters", "{}"))
    return Call(name, arguments) if isinstance(json.loads(arguments), dict) else None


def may_be_call(text: str) -> bool:
    """Whether an "auto" reply that starts with `text` may still be a call (`parse_call`)."""
    head = text.lstrip()
    if not head.startswith(TAG):
        return TAG.startswith(head) or head.startswith("{")
    head = head[len(TAG) :].lstrip()
    return not head or head.startswith("{")


def reply_call(tools: Tools, text: str, finish_reason: str) -> tuple[Call | None, str]:
    """The call a finished reply of `text` makes (None: the reply is text) and the reply's
    finish reason."""
    if tools.choice is ToolChoice.NONE:
        return None, finish_reason
    if not tools.is_constrained:
        call = parse_call(tools, text) if finish_reason == "stop" else None
        return call, finish_reason if call is None else TOOL_CALLS
    scanner = CallScanner()
    scanner.feed(text)
    if scanner.name is None:
        return None, finish_reason
    done = finish_reason == "stop" and scanner.is_complete
    return Call(scanner.name, scanner.arguments), TOOL_CALLS if done else finish_reason


class CallStream:
    """The deltas of one streamed chat choice whose reply may be a tool call (see the module
    docstring): `feed` each new text, then `finish` once."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.text = ""
        self.scanner = CallScanner() if tools.is_constrained else None
        self.is_text = False  # "auto": the reply cannot be a call; its text streams as content
        self.has_header = False  # the delta with the id and name has gone out
        self.num_sent = 0  # characters of the arguments sent

    def feed(self, text: str) -> list[dict]:
        """The deltas that `text`, the reply's next text, makes certain."""
        if self.is_text:
            return [{"content": text}] if text else []
        self.text += text
        if self.scanner is not None:
            self.scanner.feed(text)
            return self._call_deltas(self.scanner.name, self.scanner.arguments)
        if may_be_call(self.text):
            return []
        self.is_text = True
        return [{"content": self.text}]

    def finish(self, finish_reason: str) -> tuple[list[dict], str]:
        """The last deltas of the reply and its finish reason."""
        if self.is_text:
            return [], finish_reason
        call, finish_reason = reply_call(self.tools, self.text, finish_reason)
        if call is None:
            return ([{"content": self.text}] if self.text else []), finish_reason
        return self._call_deltas(call.name, call.arguments), finish_reason

    def _call_deltas(self, name: str | None, arguments: str) -> list[dict]:
        """The header delta once `name` is known, then the arguments not sent yet."""
        deltas = []
        if name is not None and not self.has_header:
            self.has_header = True
            function = {"name": name, "arguments": ""}
            header = {"index": 0, "id": new_call_id(), "type": "function", "function": function}
            deltas.append({"tool_calls": [header]})
        if len(arguments) > self.num_sent:
            fragment = {"index": 0, "function": {"arguments": arguments[self.num_sent :]}}
            deltas.append({"tool_calls": [fragment]})
            self.num_sent = len(arguments)
        return deltas
