"""Chat messages -> prompt text, by a tokenizer's chat template under a render budget.

The chat completions path and `/tokenize` both render here, so a template that raises
(`raise_exception`, a conversation it refuses), touches what the sandbox blocks, or runs past its
budget (server.chat_template.sandbox) is the same 400 on both, and the tokenizer copy that
rendered is back in its pool when the error returns.

The template sees what transformers' `apply_chat_template` gives it: the messages (keys whose
value is None dropped), `tools`, `documents` (None), `add_generation_prompt` and the tokenizer's
special tokens by name (`bos_token`, `eos_token`, ...); it renders in the same sandbox with the
same globals, plus the budget, which `apply_chat_template` has no way to take. A client's
`chat_template_kwargs` are variables beside those, as vLLM passes them, never in their place;
`continue_final_message` cuts the text after the final message as `apply_chat_template` does.
"""

from __future__ import annotations

from typing import Any

from toppings.server.chat_template.sandbox import render_template, sandbox
from toppings.server.requests.errors import shown
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
    template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
) -> str:
    """The prompt text of `messages` by `tokenizer`'s chat template (which must have one);
    raises RequestError (400) when the template refuses or fails them or passes its budget,
    whose size bound is `max_chars` (the server's prompt bound; None: the sandbox's default).
    template_kwargs: more variables for the template (a client's `chat_template_kwargs`; one
    that would replace a variable or global of the render is a 400); continue_final_message:
    end the text right after the final message's (`cut_after_final`)."""
    source = tokenizer.get_chat_template(None, tools)
    context = {name: _plain(token) for name, token in tokenizer.special_tokens_map.items()}
    context.update(
        messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
        tools=tools,
        documents=None,
        add_generation_prompt=add_generation_prompt,
    )
    for name in template_kwargs or {}:
        if name in context or name in sandbox().globals:
            raise RequestError(f"'chat_template_kwargs' cannot set {shown(name)!r}: the server "
                               "sets it")  # fmt: skip
    context.update(template_kwargs or {})
    try:
        text = render_template(source, context, max_chars)
    except Exception as e:  # jinja raises for conversations the template refuses
        raise RequestError(f"chat template rejected the messages: {e}") from e
    return cut_after_final(text, final_text(messages[-1])) if continue_final_message else text


def final_text(message: dict[str, Any]) -> str:
    """The text a continued final message ends with: its content, or its last text part's."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    parts = [p.get("text") for p in content or () if isinstance(p, dict)]
    return next((t for t in reversed(parts) if isinstance(t, str)), "")


def cut_after_final(text: str, final: str) -> str:
    """`text` (a rendered chat) cut right after the last place `final` (the final message's
    text) appears in it, so that the prompt ends inside that message. The template may have
    trimmed the message's outer whitespace: the cut keeps the message's trailing whitespace only
    where the rendered text kept it. Raises RequestError where the text is not there at all (a
    template that rewrites the message)."""
    core = final.strip()
    at = text.rfind(core)
    if not core or at < 0:
        raise RequestError("'continue_final_message': the chat template does not render the "
                           "final message's text as given, so it cannot be continued")  # fmt: skip
    tail = final.lstrip()
    return text[: at + (len(tail) if text.startswith(tail, at) else len(core))]
