"""Tool calling on `/v1/chat/completions`: `tools`, `tool_choice`, and the calls in the reply.

`tools` is OpenAI's list of `{"type": "function", "function": {"name", "description",
"parameters"}}`; the checkpoint's chat template renders them. A template that never mentions
`tools` (SmolLM2's, any written before tools) gets the generic format instead, as other servers
fall back to: the tools described in the system message, earlier calls written as the JSON they
were, and the call read from the reply as below (the response says so in its
`X-Toppings-Tool-Format: generic` header). `tool_choice`:
- "none": the tools are rendered, the reply is text;
- "auto" (the default with tools): free text; a reply that is one JSON object
  `{"name": NAME, "arguments": {...}}` (or `"parameters"`, optionally inside
  `<tool_call>...</tool_call>`) naming a tool becomes a call;
- "required" / `{"type": "function", "function": {"name": NAME}}`: the output is constrained to
  `{"name": NAME, "arguments": ARGS}` with ARGS valid under that function's `parameters` (any
  of the tools for "required"), and the reply is that call.
A reply with a call has `content: null`, `tool_calls: [{"id", "type": "function", "function":
{"name", "arguments": JSON text}}]` and `finish_reason: "tool_calls"`; server.api.openai.tool_calls
reads the call from the reply's text, whole or as it streams.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from toppings.server.requests.errors import nests_too_deep, too_deep
from toppings.server.requests.request import Constraint, ConstraintKind, RequestError
from toppings.server.sampling.schema_refs import rebase_refs

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ToolChoice(Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class Tools:
    """A chat request's tools: each function (as JSON text, hashable) and the choice."""

    functions: tuple[str, ...]  # json.dumps of each {"name", "description"?, "parameters"?}
    choice: ToolChoice
    named: str | None = None  # the function of a NAMED choice

    @property
    def calls_expected(self) -> bool:
        """Whether a reply may be a tool call (not "none")."""
        return self.choice is not ToolChoice.NONE

    def template_tools(self) -> list[dict]:
        """The tools as the chat template receives them (OpenAI's shape)."""
        return [{"type": "function", "function": json.loads(f)} for f in self.functions]

    def names(self) -> list[str]:
        return [json.loads(f)["name"] for f in self.functions]

    @property
    def is_constrained(self) -> bool:
        """Whether the output is constrained to a call ("required" or named)."""
        return self.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED)

    def constraint(self) -> Constraint | None:
        """The JSON schema a "required" or named call's output must follow (None otherwise).

        Each function's `parameters` moves to `$defs` of that schema, its local `$ref`s
        rebased there, so that `#/$defs/City` (what pydantic writes) or `#` still point into
        the parameters they were written in, as they do under `response_format`."""
        if not self.is_constrained:
            return None
        calls, defs = [], {}
        for idx, text in enumerate(self.functions):
            function = json.loads(text)
            if self.named is not None and function["name"] != self.named:
                continue
            parameters = dict(function.get("parameters") or {"type": "object"})
            for key in ("$id", "$schema"):  # a resource of its own would change the base of refs
                parameters.pop(key, None)
            defs[f"tool_{idx}"] = rebase_refs(parameters, f"/$defs/tool_{idx}")
            calls.append({
                "type": "object",
                "properties": {
                    "name": {"const": function["name"]},
                    "arguments": {"$ref": f"#/$defs/tool_{idx}"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            })  # fmt: skip
        schema = dict(calls[0]) if len(calls) == 1 else {"anyOf": calls}
        schema["$defs"] = defs
        return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema), "tools")


def _function(tool: Any, idx: int) -> str:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise RequestError(f"tools[{idx}] must be an object with 'type': 'function'")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise RequestError(f"tools[{idx}].function must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise RequestError(f"tools[{idx}].function.name must be 1-64 letters, digits, _ or -")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise RequestError(f"tools[{idx}].function.parameters must be a JSON schema object")
    for key in set(function) - {"name", "description", "parameters", "strict"}:
        raise RequestError(f"tools[{idx}].function.{key} is not supported by this server")
    kept = {k: function[k] for k in ("name", "description", "parameters") if k in function}
    return json.dumps(kept)


def parse_tools(body: dict) -> Tools | None:
    """A chat body's `tools` and `tool_choice` (None: no tools); raises RequestError for a
    malformed one and for a named choice that names no tool."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise RequestError("'tool_choice' needs 'tools'")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise RequestError(f"'tools' must be a list of at most {MAX_TOOLS} tools")
    functions = tuple(_function(t, i) for i, t in enumerate(tools))
    names = [json.loads(f)["name"] for f in functions]
    if len(set(names)) != len(names):
        raise RequestError("'tools' names a function twice")
    if choice is None or choice in ("none", "auto", "required"):
        return Tools(functions, ToolChoice(choice or "auto"))
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise RequestError(f"'tool_choice' names {name!r}, which is not in 'tools'")
        return Tools(functions, ToolChoice.NAMED, name)
    raise RequestError(
        "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
        "'function': {'name': ...}}"
    )


def template_message(msg: dict, idx: int) -> dict[str, Any]:
    """The tool fields of a chat message, in the shape chat templates read: an assistant's
    `tool_calls` (arguments as objects) and a tool result's `tool_call_id`."""
    out: dict[str, Any] = {}
    calls = msg.get("tool_calls")
    if calls is not None:
        if msg.get("role") != "assistant" or not isinstance(calls, list):
            raise RequestError(f"messages[{idx}].tool_calls must be a list on an assistant")
        out["tool_calls"] = []
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RequestError(f"messages[{idx}].tool_calls need a function name")
            arguments = function.get("arguments", "{}")
            if isinstance(arguments, str) and nests_too_deep(arguments):
                raise RequestError(too_deep(f"messages[{idx}] tool call arguments"))
            try:
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError:
                raise RequestError(f"messages[{idx}] tool call arguments are not JSON") from None
            out["tool_calls"].append({
                "id": call.get("id"),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            })  # fmt: skip
    if msg.get("role") == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str):
            raise RequestError(f"messages[{idx}].tool_call_id must be a string")
        out["tool_call_id"] = call_id
    return out


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template reads `tools` (else the generic format describes them)."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def _generic_instructions(tools: Tools) -> str:
    """The system text of the generic format: each tool as JSON, and how to call one."""
    listed = "\n".join(tools.functions)
    call = '{"name": <function name>, "arguments": <object of its arguments>}'
    if tools.choice is ToolChoice.NAMED:
        how = f"Call the function {tools.named!r} now: reply with only the JSON object {call}."
    elif tools.choice is ToolChoice.REQUIRED:
        how = f"Call one of them now: reply with only the JSON object {call}."
    else:
        how = (f"To call one, reply with only the JSON object {call} and nothing else; "
               "otherwise answer in plain text.")  # fmt: skip
    return f"You can call these functions, each described as JSON:\n{listed}\n{how}"


def generic_tool_messages(messages: list[dict], tools: Tools) -> list[dict]:
    """The conversation for a template that does not render tools (the generic format): the
    tools described in the system message (one is added in front when there is none), an
    assistant's earlier calls written as the JSON objects it would have replied, and each tool
    result as a message of role "tool". `tool_choice` "none" describes no tool."""
    out = []
    for msg in messages:
        msg = dict(msg)
        calls = msg.pop("tool_calls", None)
        msg.pop("tool_call_id", None)
        if calls:
            written = [json.dumps({"name": c["function"]["name"], "arguments": c["function"][
                "arguments"]}) for c in calls]  # fmt: skip
            msg["content"] = "\n".join(filter(None, [msg.get("content"), *written]))
        if msg.get("content") is None:
            msg["content"] = ""
        out.append(msg)
    if tools.choice is ToolChoice.NONE:
        return out
    text = _generic_instructions(tools)
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{text}")
    else:
        out.insert(0, {"role": "system", "content": text})
    return out
