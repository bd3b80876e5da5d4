"""Chat messages -> prompt text, by a tokenizer's chat template under a render budget.

The chat completions path and `/tokenize` both render here, so a template that raises
(`raise_exception`, a conversation it refuses), touches what the sandbox blocks, or runs past its
budget (server.chat_template.sandbox) is the same 400 on both, and the tokenizer copy that
rendered is back in its pool when the error returns.

The template sees what transformers' `apply_chat_template` gives it: the messages (keys whose
value is None dropped), `tools`, `documents` (None), `add_generation_prompt` and the tokenizer's
special tokens by name (`bos_token`, `eos_token`, ...); it renders in the same sandbox with the
same globals, plus the budget, which `apply_chat_template` has no way to take.
"""

from __future__ import annotations

from typing import Any

from toppings.server.chat_template.sandbox import render_template
from toppings.server.requests.request import RequestError


def _plain(value: Any) -> Any:
    """A special token (an AddedToken, a list of them) as the string the template joins."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if value is None or isinstance(value, str) else str(value)


def render_chat(
    tokenizer: Any,
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    max_chars: int | None = None,
) -> str:
    """The prompt text of `messages` by `tokenizer`'s chat template (which must have one);
    raises RequestError (400) when the template refuses or fails them or passes its budget,
    whose size bound is `max_chars` (the server's prompt bound; None: the sandbox's default)."""
    source = tokenizer.get_chat_template(None, tools)
    context = {name: _plain(token) for name, token in tokenizer.special_tokens_map.items()}
    context.update(
        messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
        tools=tools,
        documents=None,
        add_generation_prompt=add_generation_prompt,
    )
    try:
        return render_template(source, context, max_chars)
    except Exception as e:  # jinja raises for conversations the template refuses
        raise RequestError(f"chat template rejected the messages: {e}") from e
