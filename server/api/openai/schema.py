"""Request bodies in, validated `ParsedBody` out (engine requests are made in
`server.openai_requests`, responses in `server.openai_response`).

Three request schemas share one parsed form, `ParsedBody`:
- `POST /v1/completions` (OpenAI): `model`, `prompt` (a string, token ids, or a list of up to
  MAX_PROMPTS strings or token-id lists), `max_tokens` (default 16; 0 with `echo`: score the
  prompt only), `echo`, `logprobs` (0 to 20 top alternatives per token).
- `POST /v1/chat/completions` (OpenAI): `model`, `messages` (string content or a list of text
  parts) rendered by the tokenizer's chat template (vLLM's `add_generation_prompt`,
  `continue_final_message` and `chat_template_kwargs` say how: chat_options.py),
  `max_completion_tokens` or `max_tokens` (default 256, capped by the context), `logprobs` (a
  boolean) and `top_logprobs` (0 to 20).
- `POST /generate` (native): `adapter`, `prompt` or `input_ids`, `max_new_tokens` (default 16).
All take `temperature` (default 1.0), `top_p`, `top_k` (0 or -1: off), `seed`, `stop` (a string or
a list), `stream`, `ignore_eos`, `min_tokens`, `presence_penalty`, `frequency_penalty`,
`repetition_penalty`, `logit_bias` (token id -> bias in [-100, 100]), vLLM's `stop_token_ids`,
`allowed_token_ids`, `include_stop_str_in_output`, `skip_special_tokens` and `min_p` (tokens under
min_p x the top token's probability are dropped), and the structured-output fields
(`response_format`, vLLM's `guided_*`; server.api.openai.structured); OpenAI bodies also `n` (1
to MAX_N choices per prompt) and `stream_options.include_usage` (with
`stream_options.continuous_usage_stats`, as vLLM: usage on every chunk too; only with
`stream: true`, as OpenAI).
OpenAI's metadata-class fields (IGNORED_FIELDS: `metadata`, `service_tier`, `store`, `user`,
`parallel_tool_calls`, `reasoning_effort`, `modalities: ["text"]`) change nothing here: they are
type-checked, then accepted and named in `ParsedBody.ignored` (the API logs them and names them
in the X-Toppings-Ignored-Fields header). Any other field is refused with a 400 naming it
(ACCEPTED_FIELDS; a field set to null counts as absent): the server never answers without what
was asked for.

Every function here is pure; a client mistake raises `RequestError` with its HTTP status.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from toppings.server.api.openai.chat_options import (
    CHAT_OPTION_FIELDS,
    ChatOptions,
    parse_chat_options,
)
from toppings.server.api.openai.fields import (
    check_known_fields,
    json_type,
    logit_bias_pairs,
    token_id_set,
    typed_field,
)
from toppings.server.api.openai.structured import GUIDED_FIELDS, REFUSED_FIELDS, parse_constraint
from toppings.server.api.openai.tools import Tools, parse_tools, template_message
from toppings.server.requests.request import MAX_LOGPROBS, RequestError

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_SEED = 2**63
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 256  # prompts in one completions request
MAX_CHOICES = 256  # prompts x n
# Accepted so that ordinary clients work, but only at the value that changes nothing.
NEUTRAL_FIELDS = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),  # OpenAI's older spelling of tools: use `tools`
    "function_call": (None, "none"),
}
NEUTRAL_BY_KIND = {
    "completion": {"top_logprobs": (None, 0), "tools": (None, []), "tool_choice": (None,)},
    "chat": {"echo": (None, False)},
}
# Every field each endpoint reads. Any other field with a value is a 400 naming it: a client
# that asked for something the server does not do must not get an answer without it.
SAMPLING_FIELDS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos", "min_tokens",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "stop_token_ids", "allowed_token_ids", "include_stop_str_in_output",  # vLLM's
    "skip_special_tokens",  # vLLM's
    "response_format", *GUIDED_FIELDS, *REFUSED_FIELDS,  # refused by name in parse_constraint
})  # fmt: skip
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
MAX_METADATA_PAIRS = 16  # OpenAI's limit
# OpenAI fields that ask nothing of generation here, with the JSON type each must have.
# metadata: tags for OpenAI's dashboard; service_tier: OpenAI's processing tier; store: whether
# OpenAI keeps the completion (nothing is kept here); user: an end-user id for abuse tracking;
# parallel_tool_calls: a reply holds at most one tool call here, so either value is met;
# reasoning_effort: for reasoning models (refused where the chat template reasons:
# server.api.openai.choices); modalities: only ["text"], the one output this server has;
# spaces_between_special_tokens (vLLM's): its fast-tokenizer detokenizer ignores it too.
IGNORED_FIELDS = {
    "metadata": "object", "service_tier": "str", "store": "bool", "user": "str",
    "parallel_tool_calls": "bool", "reasoning_effort": "str", "modalities": "list",
    "spaces_between_special_tokens": "bool",
}  # fmt: skip
OPENAI_FIELDS = SAMPLING_FIELDS | NEUTRAL_FIELDS.keys() | IGNORED_FIELDS.keys() | {
    "model", "stream", "stream_options", "n",
    "prompt_logprobs", "truncate_prompt_tokens",  # vLLM's
}  # fmt: skip
ACCEPTED_FIELDS = {
    "completion": OPENAI_FIELDS | NEUTRAL_BY_KIND["completion"].keys()
    | {"prompt", "max_tokens", "echo", "logprobs"},
    "chat": OPENAI_FIELDS | NEUTRAL_BY_KIND["chat"].keys() | {
        "messages", "max_completion_tokens", "max_tokens", "logprobs", "top_logprobs", "tools",
        "tool_choice", *CHAT_OPTION_FIELDS,
    },
    "native": SAMPLING_FIELDS | {"adapter", "prompt", "input_ids", "max_new_tokens", "stream"},
}  # fmt: skip
# Names the request fields that were accepted and change nothing (IGNORED_FIELDS, and the
# Responses API's own), comma-separated; absent when there were none.
IGNORED_HEADER = "X-Toppings-Ignored-Fields"
ENDPOINTS = {"completion": "/v1/completions", "chat": "/v1/chat/completions", "native": "/generate"}
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})
# Keys of a chat message; `name` goes to the chat template (templates that know it render it).
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})


@dataclass(frozen=True)
class ParsedBody:
    """A validated request body, not tokenized yet.

    Exactly one of `prompt` (text or token ids) and `messages` is set. `max_tokens` None means the
    endpoint's default; `model` is the name to echo back in OpenAI responses.
    """

    kind: str  # "completion" | "chat" | "native"
    model: str
    adapter: str | None
    prompts: list[str | list[int]] | None  # in the order their choices are answered
    messages: list[dict[str, Any]] | None
    max_tokens: int | None
    sampling: dict[str, Any]  # SamplingParams keyword arguments except max_new_tokens
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # with include_usage: usage on every chunk
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: the prompt's text (and logprobs) before each choice's
    logprobs: int | None = None  # top alternatives per token; None: no logprobs
    prompt_logprobs: int | None = None  # vLLM's: the same for the prompt's tokens; None: none
    # vLLM's truncate_prompt_tokens: keep the prompt's last this many tokens (-1: as many as the
    # context holds); None: the whole prompt
    truncate: int | None = None
    tools: Tools | None = None  # chat: the tools and tool_choice (server.api.openai.tools)
    chat: ChatOptions = ChatOptions()  # chat: how the messages render (chat_options.py)
    ignored: tuple[str, ...] = ()  # IGNORED_FIELDS the body set, in IGNORED_FIELDS' order

    @property
    def prompt(self) -> str | list[int] | None:
        """The prompt of a one-prompt body (None for chat)."""
        return self.prompts[0] if self.prompts else None


def parse_token_ids(value: Any, key: str) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise RequestError(f"'{key}' must be a string or a list of integer token ids")
    return list(value)


def _sampling(body: dict) -> dict[str, Any]:
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestError(f"'stop' must be a string or a list of strings, not {json_type(stop)}")
    seed = typed_field(body, "seed", "int")
    if seed is not None and not 0 <= seed < MAX_SEED:
        raise RequestError(f"'seed' must be in [0, 2^63), not {seed}")
    top_k = typed_field(body, "top_k", "int", 0)
    constraint = parse_constraint(body)
    return {
        "temperature": typed_field(body, "temperature", "number", 1.0),
        "top_p": typed_field(body, "top_p", "number", 1.0),
        "top_k": 0 if top_k == -1 else top_k,  # -1 is vLLM's spelling of "off"
        "min_p": typed_field(body, "min_p", "number", 0.0),
        "seed": seed,
        "stop": tuple(stop or ()),
        "ignore_eos": typed_field(body, "ignore_eos", "bool", False),
        "presence_penalty": typed_field(body, "presence_penalty", "number", 0.0),
        "frequency_penalty": typed_field(body, "frequency_penalty", "number", 0.0),
        "repetition_penalty": typed_field(body, "repetition_penalty", "number", 1.0),
        "min_tokens": typed_field(body, "min_tokens", "int", 0),
        "logit_bias": logit_bias_pairs(body.get("logit_bias")),
        "stop_token_ids": token_id_set(body, "stop_token_ids"),
        "allowed_token_ids": tuple(sorted(token_id_set(body, "allowed_token_ids"))),
        "include_stop_str_in_output": typed_field(
            body, "include_stop_str_in_output", "bool", False
        ),
        "skip_special_tokens": typed_field(body, "skip_special_tokens", "bool", True),
    } | ({} if constraint is None else {"constraint": constraint})


def _in_range(value: int, key: str, low: int, high: int) -> int:
    if not low <= value <= high:
        raise RequestError(f"'{key}' must be in [{low}, {high}], not {value}")
    return value


def _openai_common(body: dict, base_model: str, kind: str) -> dict[str, Any]:
    """ParsedBody fields every OpenAI body has; rejects what we lack."""
    check_known_fields(body, ACCEPTED_FIELDS[kind], ENDPOINTS[kind])
    for key, neutral in (NEUTRAL_FIELDS | NEUTRAL_BY_KIND[kind]).items():
        if body.get(key) not in neutral:
            raise RequestError(f"'{key}' is not supported by this server")
    model = typed_field(body, "model", "str", base_model)
    stream = typed_field(body, "stream", "bool", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(f"'stream_options' must be an object, not {json_type(options)}")
    check_known_fields(options or {}, STREAM_OPTIONS, "'stream_options'")
    if options is not None and not stream:
        raise RequestError("'stream_options' is only allowed with 'stream': true")
    prompt_logprobs = typed_field(body, "prompt_logprobs", "int")
    if prompt_logprobs is not None:
        _in_range(prompt_logprobs, "prompt_logprobs", 0, MAX_LOGPROBS)
        if stream:
            raise RequestError("'prompt_logprobs' with 'stream' is not supported by this server")
    truncate = typed_field(body, "truncate_prompt_tokens", "int")
    if truncate is not None and truncate != -1 and truncate < 1:
        raise RequestError("'truncate_prompt_tokens' must be -1 (the context) or at least 1")
    return {
        "prompt_logprobs": prompt_logprobs,
        "truncate": truncate,
        "model": model,
        "adapter": None if model == base_model else model,
        "sampling": _sampling(body),
        "stream": stream,
        "ignored": ignored_fields(body),
        "include_usage": typed_field(options or {}, "include_usage", "bool", False),
        "continuous_usage": typed_field(options or {}, "continuous_usage_stats", "bool", False),
        "n": _in_range(typed_field(body, "n", "int", 1), "n", 1, MAX_N),
    }


def ignored_fields(body: dict) -> tuple[str, ...]:
    """The IGNORED_FIELDS `body` sets (null counts as absent), each checked for its type; a
    `modalities` other than ["text"] or a `reasoning_effort` OpenAI does not define is a 400."""
    named = []
    for key, kind in IGNORED_FIELDS.items():
        value = body.get(key)
        if value is None:
            continue
        if kind == "object" and not isinstance(value, dict):
            raise RequestError(f"'{key}' must be an object, not {json_type(value)}")
        if kind == "list" and not isinstance(value, list):
            raise RequestError(f"'{key}' must be an array, not {json_type(value)}")
        if kind not in ("object", "list"):
            typed_field(body, key, kind)
        named.append(key)
    metadata = body.get("metadata") or {}
    if len(metadata) > MAX_METADATA_PAIRS or not all(isinstance(v, str) for v in metadata.values()):
        raise RequestError(f"'metadata' must hold at most {MAX_METADATA_PAIRS} string values")
    if body.get("modalities") not in (None, ["text"]):
        raise RequestError('\'modalities\' other than ["text"] is not supported by this server: '
                           "it writes text only")  # fmt: skip
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise RequestError(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}")
    return tuple(named)


def _prompts(value: Any) -> list[str | list[int]]:
    """`prompt` as a list of prompts: one string, token ids, or a list of either."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise RequestError(f"'prompt' must be a string or token ids, not {json_type(value)}")
    if not isinstance(value[0], (str, list)):
        return [parse_token_ids(value, "prompt")]
    if len(value) > MAX_PROMPTS:
        raise RequestError(f"'prompt' may hold at most {MAX_PROMPTS} prompts, not {len(value)}")
    prompts: list[str | list[int]] = []
    for idx, item in enumerate(value):
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list):
            prompts.append(parse_token_ids(item, f"prompt[{idx}]"))
        else:
            raise RequestError("'prompt' lists must hold only strings or only token-id lists")
    return prompts


def parse_completion(body: dict, base_model: str) -> ParsedBody:
    """Validate an OpenAI `/v1/completions` body."""
    common = _openai_common(body, base_model, "completion")
    prompts = _prompts(body.get("prompt"))
    if len(prompts) * common["n"] > MAX_CHOICES:
        raise RequestError(f"prompts x n must be at most {MAX_CHOICES} choices")
    logprobs = typed_field(body, "logprobs", "int")
    if logprobs is not None:
        _in_range(logprobs, "logprobs", 0, MAX_LOGPROBS)
    echo = typed_field(body, "echo", "bool", False)
    if echo and common["truncate"] is not None:
        raise RequestError("'truncate_prompt_tokens' with 'echo' is not supported by this server")
    if echo and logprobs is not None and common["prompt_logprobs"] is not None:
        raise RequestError(
            "'prompt_logprobs' with 'echo' and 'logprobs' is not supported by this server: the "
            "echoed prompt's logprobs are the prompt's already"
        )
    max_tokens = typed_field(body, "max_tokens", "int")
    if max_tokens == 0 and not echo:
        raise RequestError("'max_tokens' 0 needs 'echo': true (it scores the prompt only)")
    return ParsedBody(
        "completion", prompts=prompts, messages=None, max_tokens=max_tokens, echo=echo,
        logprobs=logprobs, **common,
    )  # fmt: skip


def parse_message(msg: Any, idx: int) -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise RequestError(f"messages[{idx}] must be an object, not {json_type(msg)}")
    check_known_fields(msg, MESSAGE_FIELDS, f"messages[{idx}]")
    role = msg.get("role")
    if role not in CHAT_ROLES:
        raise RequestError(f"messages[{idx}].role must be one of {', '.join(CHAT_ROLES)}")
    content = msg.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):  # text parts, each with its text (OpenAI's and vLLM's 400s)
        if not content:
            raise RequestError(f"messages[{idx}].content must not be an empty list")
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestError(f"messages[{idx}].content parts must be text parts")
            if not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{idx}].content[{j}].text must be a string, "
                                   f"not {json_type(part.get('text'))}")  # fmt: skip
            parts.append(part["text"])
        content = "\n".join(parts)
    if not isinstance(content, str):
        raise RequestError(f"messages[{idx}].content must be a string or a list of text parts")
    # Chat templates know the classic roles; "developer" is OpenAI's new name for "system".
    parsed = {"role": "system" if role == "developer" else role, "content": content}
    name = typed_field(msg, "name", "str")
    if name is not None:
        parsed["name"] = name
    return parsed | template_message(msg, idx)


def parse_chat(body: dict, base_model: str) -> ParsedBody:
    """Validate an OpenAI `/v1/chat/completions` body."""
    common = _openai_common(body, base_model, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    parsed = [parse_message(m, i) for i, m in enumerate(messages)]
    max_tokens = typed_field(body, "max_completion_tokens", "int")
    if max_tokens is None:
        max_tokens = typed_field(body, "max_tokens", "int")
    top = typed_field(body, "top_logprobs", "int")
    if top is not None:
        _in_range(top, "top_logprobs", 0, MAX_LOGPROBS)
    logprobs = None
    if typed_field(body, "logprobs", "bool", False):
        logprobs = top or 0
    elif top:
        raise RequestError("'top_logprobs' needs 'logprobs': true")
    tools = parse_tools(body)
    if tools is not None and tools.calls_expected:
        if logprobs is not None:
            raise RequestError("'logprobs' with 'tools' is not supported by this server")
        call = tools.constraint()
        if call is not None:
            if "constraint" in common["sampling"]:
                raise RequestError("'tool_choice' required or named cannot be combined with a "
                                   "structured-output field")  # fmt: skip
            common["sampling"]["constraint"] = call
    return ParsedBody(
        "chat", prompts=None, messages=parsed, max_tokens=max_tokens, logprobs=logprobs,
        tools=tools, chat=parse_chat_options(body, parsed), **common,
    )  # fmt: skip


def parse_native(body: dict, base_model: str) -> ParsedBody:
    """Validate a native `/generate` body."""
    check_known_fields(body, ACCEPTED_FIELDS["native"], ENDPOINTS["native"])
    adapter = typed_field(body, "adapter", "str")
    prompt, input_ids = body.get("prompt"), body.get("input_ids")
    if (prompt is None) == (input_ids is None):
        raise RequestError("give exactly one of 'prompt' and 'input_ids'")
    if prompt is not None:
        prompt = typed_field(body, "prompt", "str")
    elif not isinstance(input_ids, list):
        raise RequestError(f"'input_ids' must be a list of integers, not {json_type(input_ids)}")
    else:
        prompt = parse_token_ids(input_ids, "input_ids")
    max_tokens = typed_field(body, "max_new_tokens", "int")
    stream = typed_field(body, "stream", "bool", False)
    return ParsedBody(
        "native", adapter or base_model, adapter, [prompt], None, max_tokens, _sampling(body),
        stream,
    )  # fmt: skip
