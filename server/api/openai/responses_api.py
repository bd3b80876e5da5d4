"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: a body is read as the chat
request it means (here), answered by the chat code, and the answer reshaped (responses_output).

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
The text's logprobs (`include: ["message.output_text.logprobs"]`, `top_logprobs` alternatives)
are the chat's, in the text part and its delta events. Nothing is stored: `previous_response_id`,
`conversation`, `background` and the other fields of a stored or hosted response are a 400 by
name, as are hosted tools (`web_search`, ...).
"""

from __future__ import annotations

import re
from typing import Any

from toppings.server.api.openai.fields import check_known_fields, json_type
from toppings.server.requests.request import RequestError

PASSED = ("model", "temperature", "top_p", "stream", "metadata", "user", "store", "service_tier",
          "parallel_tool_calls")  # fmt: skip
READ = frozenset({*PASSED, "input", "instructions", "max_output_tokens", "tools", "tool_choice",
                  "text", "reasoning", "truncation", "safety_identifier", "prompt_cache_key",
                  "stream_options", "include", "top_logprobs"})  # fmt: skip
STATEFUL = ("previous_response_id", "conversation", "background", "prompt")
LOGPROBS = "message.output_text.logprobs"  # the one `include` value: what the server computes
# The chat request's names in its errors -> the Responses body's (a message index: input_words).
CHAT_NAMES = ((re.compile(r"'reasoning_effort'"), "'reasoning.effort'"),
              (re.compile(r"'max_completion_tokens'"), "'max_output_tokens'"),
              (re.compile(r"response_format(\.json_schema)?"), "text.format"),
              (re.compile(r"(tools\[\d+\])\.function\."), r"\1."))  # fmt: skip
MESSAGE_AT = re.compile(r"messages\[(\d+)\]")
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
        _check_call_ids(messages)
    else:
        raise RequestError("'input' must be a string or a non-empty list of items")
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise RequestError(f"'instructions' must be a string, not "
                               f"{json_type(body['instructions'])}")  # fmt: skip
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
    top = body.get("top_logprobs")
    if top is not None and (type(top) is not int or not 0 <= top <= 20):  # (a bool is no int)
        raise RequestError("'top_logprobs' must be an integer from 0 to 20")
    if wants_logprobs(body):
        chat["logprobs"], chat["top_logprobs"] = True, top or 0
    return chat


def _check_call_ids(messages: list[dict]) -> None:
    """Each function_call_output answers a function_call before it (nothing is stored here to
    answer one of an earlier response), as OpenAI's API requires."""
    called: set[str] = set()
    for i, message in enumerate(messages):
        called.update(call["id"] for call in message.get("tool_calls") or ())
        if message["role"] == "tool" and message["tool_call_id"] not in called:
            raise RequestError(f"input[{i}].call_id {message['tool_call_id'][:64]!r} answers no "
                               "function_call item before it")  # fmt: skip


def wants_logprobs(body: dict) -> bool:
    """Whether the text's logprobs are asked for (`include`, as OpenAI's); a 400 for what
    `include` asks that this server has not (stored or hosted items)."""
    include = body.get("include")
    if include is None:
        return False
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise RequestError("'include' must be a list of strings")
    for value in include:
        if value != LOGPROBS:
            raise RequestError(f"'include' value {value[:64]!r} is not supported by this server "
                               f"(only {LOGPROBS!r})")  # fmt: skip
    return bool(include)


def ignored(body: dict) -> list[str]:
    """The Responses fields read and ignored here (the chat's own are named by the chat path)."""
    nested = [("reasoning", "summary"), ("reasoning", "generate_summary"), ("text", "verbosity")]
    named = [k for k in ("safety_identifier", "prompt_cache_key") if body.get(k) is not None]
    if body.get("top_logprobs") is not None and LOGPROBS not in (body.get("include") or ()):
        named.append("top_logprobs")  # without the logprobs, as OpenAI's
    return named + [f"{a}.{b}" for a, b in nested
                    if isinstance(body.get(a), dict) and body[a].get(b) is not None]  # fmt: skip


def input_words(error: RequestError, body: dict) -> RequestError:
    """The chat path's error about the chat request a Responses body became, in the body's
    words: `messages[i]` is the input item it came from (or `instructions`), a chat field the
    Responses field it came from."""
    first = 1 if body.get("instructions") is not None else 0
    whole = isinstance(body.get("input"), str)

    def item(match: re.Match) -> str:
        index = int(match.group(1)) - first
        return "instructions" if index < 0 else "input" if whole else f"input[{index}]"

    message = MESSAGE_AT.sub(item, str(error))
    for pattern, name in CHAT_NAMES:
        message = pattern.sub(name, message)
    return RequestError(message, error.code, error.error_type, error.retry_after_s)
