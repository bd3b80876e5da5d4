"""vLLM's fields on how a chat renders: `add_generation_prompt`, `continue_final_message` and
`chat_template_kwargs`, parsed into `ChatOptions` (chat completions and /tokenize alike).

- `add_generation_prompt` (default true): end the prompt with the template's opening of the
  assistant's turn.
- `continue_final_message` (default false): end the prompt inside the final message instead, right
  after its text, so that the model continues it (a reply started for it: "prefill"). The
  generation prompt is then off unless the body sets it, and setting both is a 400 (vLLM refuses
  both true too, but makes a client set the one to false itself).
- `chat_template_kwargs`: an object whose keys the template reads as variables, as vLLM passes
  them (Qwen3's `{"enable_thinking": false}`); at most MAX_TEMPLATE_KWARGS keys, none of the
  names the server's render sets itself (server.chat_template.render refuses those).

The render itself, the cut of a continued message included, is server.chat_template.render's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from toppings.server.api.openai.fields import json_type, typed_field
from toppings.server.chat_template.render import final_text
from toppings.server.requests.request import RequestError

MAX_TEMPLATE_KWARGS = 32
CHAT_OPTION_FIELDS = frozenset({
    "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
})  # fmt: skip


@dataclass(frozen=True)
class ChatOptions:
    """How a chat's messages become the prompt (module docstring)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def parse_chat_options(body: dict[str, Any], messages: list[dict[str, Any]]) -> ChatOptions:
    """The chat options `body` sets, checked against its parsed `messages`."""
    keep_open = typed_field(body, "continue_final_message", "bool", False)
    generation_prompt = typed_field(body, "add_generation_prompt", "bool", not keep_open)
    if keep_open and generation_prompt:
        raise RequestError(
            "'continue_final_message' and 'add_generation_prompt' cannot both "
            "be true: the prompt ends inside the last message or after it"
        )
    if keep_open and not final_text(messages[-1]).strip():
        raise RequestError("'continue_final_message' needs text in the final message to continue")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise RequestError(f"'chat_template_kwargs' must be an object, not {json_type(kwargs)}")
    elif len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise RequestError(f"'chat_template_kwargs' may hold at most {MAX_TEMPLATE_KWARGS} keys, "
                           f"not {len(kwargs)}")  # fmt: skip
    return ChatOptions(generation_prompt, keep_open, dict(kwargs))
