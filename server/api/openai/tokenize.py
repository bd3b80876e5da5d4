"""vLLM's `/tokenize` and `/detokenize`: the server's tokenizer, for clients that count tokens.

    POST /tokenize    {"model"?, "prompt": str, "add_special_tokens"?: true}
                      or {"model"?, "messages": [...], "add_generation_prompt"?: true,
                          "continue_final_message"?: false, "chat_template_kwargs"?: {}}
                      -> {"count", "max_model_len", "tokens": [int]}
    POST /detokenize  {"model"?, "tokens": [int]} -> {"prompt": str}

`model` (the base model or an adapter; all share the tokenizer) is checked like a generation's,
and a prompt (or the messages' text) over the server's character bound gets a 400 before it is
tokenized, as a generation's does (server.api.openai.choices). Messages render as a chat's do
(server.chat_template.render): a template that fails or runs past its budget is the same 400.
"""

from __future__ import annotations

from typing import Any

from toppings.server.api.openai.chat_options import parse_chat_options
from toppings.server.api.openai.choices import RequestLimits, messages_chars
from toppings.server.api.openai.fields import typed_field
from toppings.server.api.openai.schema import parse_message, parse_token_ids
from toppings.server.chat_template.render import render_chat
from toppings.server.requests.errors import NOT_FOUND, unknown_adapter
from toppings.server.requests.request import RequestError


def _check_model(body: dict, engine) -> None:
    model = typed_field(body, "model", "str", engine.model_name)
    if model != engine.model_name and model not in {a["name"] for a in engine.adapters()}:
        raise RequestError(unknown_adapter(model), 404, NOT_FOUND)


def tokenize(body: dict, engine, tokenizer, limits: RequestLimits) -> dict[str, Any]:
    """Token ids of a prompt or of chat messages rendered by the chat template, by `tokenizer`
    (a copy of the engine's that this thread alone uses)."""
    _check_model(body, engine)
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list")
        parsed = [parse_message(m, i) for i, m in enumerate(messages)]
        limits.check_text(messages_chars(parsed))
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template")
        chat = parse_chat_options(body, parsed)
        text = render_chat(tokenizer, parsed, None, chat.add_generation_prompt,
                           limits.max_prompt_chars, chat.template_kwargs,
                           chat.continue_final_message)  # fmt: skip
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    else:
        prompt = typed_field(body, "prompt", "str")
        if prompt is None:
            raise RequestError("give 'prompt' (a string) or 'messages'")
        limits.check_text(len(prompt))
        special = typed_field(body, "add_special_tokens", "bool", True)
        ids = list(tokenizer.encode(prompt, add_special_tokens=special))
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}


def detokenize(body: dict, engine) -> dict[str, Any]:
    """The text of token ids (special tokens kept, as vLLM does)."""
    _check_model(body, engine)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise RequestError("'tokens' must be a list of integer token ids")
    ids = parse_token_ids(tokens, "tokens")
    vocab = engine.model_config.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise RequestError(f"token ids must be in [0, {vocab})")
    return {"prompt": engine.tokenizer.decode(ids)}
