"""vLLM's `/tokenize` and `/detokenize`: the server's tokenizer, for clients that count tokens.

    POST /tokenize    {"model"?, "prompt": str, "add_special_tokens"?: true, "return_token_strs"?}
                      or {"model"?, "messages": [...], "tools"?: [...], "add_generation_prompt"?:
                          true, "continue_final_message"?: false, "chat_template_kwargs"?: {},
                          "return_token_strs"?: false}
                      -> {"count", "max_model_len", "tokens": [int], "token_strs": [str] | null}
    POST /detokenize  {"model"?, "tokens": [int]} -> {"prompt": str}

`model` (the base model or an adapter; all share the tokenizer) is checked like a generation's,
and a prompt (or the messages' text) over the server's character bound gets a 400 before it is
tokenized, as a generation's does (server.api.openai.choices). Messages and tools render as a
chat's do (`choices.chat_ids`), so `count` is the `usage.prompt_tokens` a chat request with them
reports: a template that fails or runs past its budget is the same 400. The body of a chat or a
completion request counts as it is (its fields that change no prompt, `max_tokens`,
`temperature`, ..., are not read; `truncate_prompt_tokens` is not applied); a field neither
endpoint knows is a 400, as on them.
"""

from __future__ import annotations

from typing import Any

from toppings.server.api.openai.chat_options import parse_chat_options
from toppings.server.api.openai.choices import RequestLimits, chat_ids, messages_chars
from toppings.server.api.openai.fields import check_known_fields, typed_field
from toppings.server.api.openai.schema import ACCEPTED_FIELDS, parse_message, parse_token_ids
from toppings.server.api.openai.tools import parse_tools
from toppings.server.requests.errors import NOT_FOUND, unknown_adapter
from toppings.server.requests.request import RequestError

# A completion's or a chat's whole body counts: its fields that change no prompt are not read.
OWN_FIELDS = frozenset({"add_special_tokens", "return_token_strs"})
PROMPT_FIELDS = ACCEPTED_FIELDS["completion"] | OWN_FIELDS
CHAT_FIELDS = ACCEPTED_FIELDS["chat"] | OWN_FIELDS
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def _check_model(body: dict, engine) -> None:
    model = typed_field(body, "model", "str", engine.model_name)
    if model != engine.model_name and model not in {a["name"] for a in engine.adapters()}:
        raise RequestError(unknown_adapter(model), 404, NOT_FOUND)


def tokenize(body: dict, engine, tokenizer, limits: RequestLimits) -> dict[str, Any]:
    """Token ids of a prompt or of chat messages rendered by the chat template, by `tokenizer`
    (a copy of the engine's that this thread alone uses)."""
    chat = "messages" in body
    check_known_fields(body, CHAT_FIELDS if chat else PROMPT_FIELDS, "/tokenize")
    _check_model(body, engine)
    strs = typed_field(body, "return_token_strs", "bool", False)
    if chat:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list")
        parsed = [parse_message(m, i) for i, m in enumerate(messages)]
        limits.check_text(messages_chars(parsed))
        tools = parse_tools(body)
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template")
        options = parse_chat_options(body, parsed)
        special = typed_field(body, "add_special_tokens", "bool", False)  # beyond the template's
        ids = chat_ids(tokenizer, parsed, tools, options, limits.max_prompt_chars, special)
    else:
        prompt = typed_field(body, "prompt", "str")
        if prompt is None:
            raise RequestError("give 'prompt' (a string) or 'messages'")
        limits.check_text(len(prompt))
        special = typed_field(body, "add_special_tokens", "bool", True)
        ids = list(tokenizer.encode(prompt, add_special_tokens=special))
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if strs else None}  # fmt: skip


def detokenize(body: dict, engine) -> dict[str, Any]:
    """The text of token ids (special tokens kept, as vLLM does)."""
    check_known_fields(body, DETOKENIZE_FIELDS, "/detokenize")
    _check_model(body, engine)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise RequestError("'tokens' must be a list of integer token ids")
    ids = parse_token_ids(tokens, "tokens")
    vocab = engine.model_config.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise RequestError(f"token ids must be in [0, {vocab})")
    return {"prompt": engine.tokenizer.decode(ids)}
