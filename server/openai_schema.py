"""Request bodies in, engine requests out; engine outputs in, OpenAI and native JSON out.

Three request schemas share one parsed form, `ParsedBody`:
- `POST /v1/completions` (OpenAI): `model`, `prompt` (a string, a list of one string, token ids, or
  a list of one token-id list), `max_tokens` (default 16).
- `POST /v1/chat/completions` (OpenAI): `model`, `messages` (string content or a list of text
  parts) rendered by the tokenizer's chat template, `max_completion_tokens` or `max_tokens`
  (default 256, capped by the context).
- `POST /generate` (native): `adapter`, `prompt` or `input_ids`, `max_new_tokens` (default 16).
All take `temperature` (default 1.0), `top_p`, `top_k` (0 or -1: off), `seed`, `stop` (a string or
a list), `stream`, `ignore_eos`; OpenAI bodies also `n` (only 1) and `stream_options.include_usage`.

Every function here is pure; a client mistake raises `RequestError` with its HTTP status. Response
builders live in `server.openai_response`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from toppings.server.request import GenerationRequest, RequestError, SamplingParams

DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256, "native": 16}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_SEED = 2**63
# Accepted so that ordinary clients work, but only at the value that changes nothing.
NEUTRAL_FIELDS = {
    "echo": (None, False),
    "best_of": (None, 1),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
}


@dataclass(frozen=True)
class ParsedBody:
    """A validated request body, not tokenized yet.

    Exactly one of `prompt` (text or token ids) and `messages` is set. `max_tokens` None means the
    endpoint's default; `model` is the name to echo back in OpenAI responses.
    """

    kind: str  # "completion" | "chat" | "native"
    model: str
    adapter: str | None
    prompt: str | list[int] | None
    messages: list[dict[str, str]] | None
    max_tokens: int | None
    sampling: dict[str, Any]  # SamplingParams keyword arguments except max_new_tokens
    stream: bool = False
    include_usage: bool = False


def _field(body: dict, key: str, kind: str, default: Any = None) -> Any:
    """body[key] checked against `kind` ("int", "number", "bool", "str"); None means absent."""
    value = body.get(key)
    if value is None:
        return default
    is_bool = isinstance(value, bool)
    ok = {
        "int": isinstance(value, int) and not is_bool,
        "number": isinstance(value, (int, float)) and not is_bool,
        "bool": is_bool,
        "str": isinstance(value, str),
    }[kind]
    if not ok:
        noun = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string"}
        raise RequestError(f"'{key}' must be {noun[kind]}, not {json_type(value)}")
    return float(value) if kind == "number" else value


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    for py, name in ((bool, "boolean"), ((int, float), "number"), (str, "string"), (list, "array")):
        if isinstance(value, py):
            return name
    return "object"


def _token_ids(value: Any, key: str) -> list[int]:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise RequestError(f"'{key}' must be a string or a list of integer token ids")
    return list(value)


def _sampling(body: dict) -> dict[str, Any]:
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestError(f"'stop' must be a string or a list of strings, not {json_type(stop)}")
    seed = _field(body, "seed", "int")
    if seed is not None and not 0 <= seed < MAX_SEED:
        raise RequestError(f"'seed' must be in [0, 2^63), not {seed}")
    top_k = _field(body, "top_k", "int", 0)
    return {
        "temperature": _field(body, "temperature", "number", 1.0),
        "top_p": _field(body, "top_p", "number", 1.0),
        "top_k": 0 if top_k == -1 else top_k,  # -1 is vLLM's spelling of "off"
        "seed": seed,
        "stop": tuple(stop or ()),
        "ignore_eos": _field(body, "ignore_eos", "bool", False),
    }


def _openai_common(body: dict, base_model: str) -> tuple[str, str | None, bool, bool]:
    """(model to echo, adapter, stream, include_usage) of an OpenAI body; rejects what we lack."""
    for key, neutral in NEUTRAL_FIELDS.items():
        if body.get(key) not in neutral:
            raise RequestError(f"'{key}' is not supported by this server")
    n = _field(body, "n", "int", 1)
    if n != 1:
        raise RequestError(f"'n' must be 1 (one choice per request), not {n}")
    model = _field(body, "model", "str", base_model)
    stream = _field(body, "stream", "bool", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise RequestError(f"'stream_options' must be an object, not {json_type(options)}")
    include_usage = _field(options or {}, "include_usage", "bool", False)
    return model, None if model == base_model else model, stream, include_usage


def parse_completion(body: dict, base_model: str) -> ParsedBody:
    """Validate an OpenAI `/v1/completions` body."""
    model, adapter, stream, include_usage = _openai_common(body, base_model)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise RequestError("'prompt' may hold one prompt only; send one request per prompt")
        prompt = prompt[0]
    if isinstance(prompt, list):
        prompt = _token_ids(prompt, "prompt")
    elif not isinstance(prompt, str):
        raise RequestError(f"'prompt' must be a string or token ids, not {json_type(prompt)}")
    max_tokens = _field(body, "max_tokens", "int")
    return ParsedBody(
        "completion",
        model,
        adapter,
        prompt,
        None,
        max_tokens,
        _sampling(body),
        stream,
        include_usage,
    )


def _message(msg: Any, idx: int) -> dict[str, str]:
    if not isinstance(msg, dict):
        raise RequestError(f"messages[{idx}] must be an object, not {json_type(msg)}")
    role = msg.get("role")
    if role not in CHAT_ROLES:
        raise RequestError(f"messages[{idx}].role must be one of {', '.join(CHAT_ROLES)}")
    content = msg.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestError(f"messages[{idx}].content parts must be text parts")
            parts.append(_field(part, "text", "str", ""))
        content = "\n".join(parts)
    if not isinstance(content, str):
        raise RequestError(f"messages[{idx}].content must be a string or a list of text parts")
    # Chat templates know the classic roles; "developer" is OpenAI's new name for "system".
    return {"role": "system" if role == "developer" else role, "content": content}


def parse_chat(body: dict, base_model: str) -> ParsedBody:
    """Validate an OpenAI `/v1/chat/completions` body."""
    model, adapter, stream, include_usage = _openai_common(body, base_model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    parsed = [_message(m, i) for i, m in enumerate(messages)]
    max_tokens = _field(body, "max_completion_tokens", "int")
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", "int")
    return ParsedBody(
        "chat", model, adapter, None, parsed, max_tokens, _sampling(body), stream, include_usage
    )


def parse_native(body: dict, base_model: str) -> ParsedBody:
    """Validate a native `/generate` body."""
    adapter = _field(body, "adapter", "str")
    prompt, input_ids = body.get("prompt"), body.get("input_ids")
    if (prompt is None) == (input_ids is None):
        raise RequestError("give exactly one of 'prompt' and 'input_ids'")
    if prompt is not None:
        prompt = _field(body, "prompt", "str")
    elif not isinstance(input_ids, list):
        raise RequestError(f"'input_ids' must be a list of integers, not {json_type(input_ids)}")
    else:
        prompt = _token_ids(input_ids, "input_ids")
    max_tokens = _field(body, "max_new_tokens", "int")
    stream = _field(body, "stream", "bool", False)
    return ParsedBody(
        "native", adapter or base_model, adapter, prompt, None, max_tokens, _sampling(body), stream
    )


def prompt_ids(parsed: ParsedBody, tokenizer) -> list[int]:
    """Token ids of the prompt: chat-templated messages, encoded text, or the ids as given."""
    if parsed.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template; use /v1/completions")
        try:
            text = tokenizer.apply_chat_template(
                parsed.messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as e:  # jinja raises for conversations the template refuses
            raise RequestError(f"chat template rejected the messages: {e}") from e
        # The rendered template already holds the BOS token where the model wants one.
        return list(tokenizer.encode(text, add_special_tokens=False))
    if isinstance(parsed.prompt, str):
        return list(tokenizer.encode(parsed.prompt, add_special_tokens=True))
    return list(parsed.prompt)


def build_request(
    parsed: ParsedBody, tokenizer, max_model_len: int, vocab_size: int
) -> GenerationRequest:
    """Tokenize and check the prompt against the context, then make the engine request."""
    ids = prompt_ids(parsed, tokenizer)
    if not ids:
        raise RequestError("the prompt is empty")
    if any(not 0 <= t < vocab_size for t in ids):
        raise RequestError(f"token ids must be in [0, {vocab_size})")
    room = max_model_len - len(ids)
    if room < 1:
        raise RequestError(
            f"the prompt has {len(ids)} tokens; this model's context holds {max_model_len}"
        )
    max_tokens = parsed.max_tokens
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS[parsed.kind], room)
    elif not 1 <= max_tokens <= max_model_len:
        raise RequestError(f"max tokens must be in [1, {max_model_len}], not {max_tokens}")
    elif max_tokens > room:
        raise RequestError(
            f"this model's context holds {max_model_len} tokens; the prompt has {len(ids)} and "
            f"{max_tokens} more were asked for"
        )
    sampling = dict(parsed.sampling, top_k=min(parsed.sampling["top_k"], vocab_size))
    params = SamplingParams(max_new_tokens=max_tokens, **sampling)
    return GenerationRequest(prompt_ids=ids, params=params, adapter=parsed.adapter)
