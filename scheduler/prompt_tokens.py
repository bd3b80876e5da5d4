"""How many prompt tokens a request body asks the server to prefill, and its token ids where
they can be known here: the routing cost's prompt length and prefix-aware routing's key.

Without a tokenizer the count is estimated from characters (token ids given as ids are counted
exactly); with `--tokenizer`, `PromptCounter` counts and encodes as the server will.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

CHARS_PER_TOKEN = 4  # no tokenizer here: a rough prompt-length estimate for the perf models

# vLLM's fields on how a chat renders (server.api.openai.chat_options): ids are not guessed then
CHAT_RENDER_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")


def copies(body: dict[str, Any]) -> int:
    """Choices per prompt (`n`): each is a sequence of its own on the server."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def truncation(body: dict[str, Any]) -> int | None:
    """vLLM's `truncate_prompt_tokens` where it keeps k >= 1 tokens of each prompt; None
    otherwise (-1, as many as the context holds, is the server's to know)."""
    keep = body.get("truncate_prompt_tokens")
    return keep if isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1 else None


def num_prompts(body: dict[str, Any]) -> int:
    """Prompts in the body: a completions list of them, else one."""
    return 1 if "messages" in body else len(_prompt_list(body.get("prompt", "")))


def _prompt_list(prompt: Any) -> list[Any]:
    """A completions `prompt` as a list of prompts (strings or token-id lists)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return prompt
    return [prompt]


def _estimate_one(prompt: Any) -> int:
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    text = prompt if isinstance(prompt, str) else ""  # the server rejects it
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens the server will prefill, estimated from characters (token ids are counted
    exactly): summed over a list of prompts, times `n`; a Responses body (`input`, of text or
    items, and `instructions`) by the characters of its JSON."""
    if "input" in body:
        chars = len(json.dumps(body["input"])) + len(str(body.get("instructions") or ""))
        return max(1, math.ceil(chars / CHARS_PER_TOKEN))
    if "messages" in body:
        messages = body["messages"] if isinstance(body["messages"], list) else []
        chars = sum(len(str(m.get("content", ""))) + 16 for m in messages if isinstance(m, dict))
        return max(1, math.ceil(chars / CHARS_PER_TOKEN)) * copies(body)
    total = sum(_estimate_one(p) for p in _prompt_list(body.get("prompt", "")))
    return max(1, total) * copies(body)


def given_token_ids(body: dict[str, Any], kind: str) -> list[int] | None:
    """The one prompt's token ids when the body gives them as ids (a completions `prompt` of
    ints, a native `input_ids`); None otherwise."""
    ids = body.get("input_ids") if kind == "native" else body.get("prompt")
    if kind == "chat" or not isinstance(ids, list) or not ids:
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return ids
    return None


class PromptCounter:
    """Exact prompt lengths and token ids with the base model's tokenizer (and chat template),
    loaded from the servers' checkpoint directory (`--tokenizer`).

    Costs a tokenization per routed request (well under a millisecond for chat-sized prompts);
    without it the router estimates lengths from characters. The ids are the server's: a text
    prompt encoded with special tokens, messages rendered by the chat template with the
    generation prompt and encoded without (server/api/openai/choices.py `prompt_ids`), so
    that prefix routing hashes the blocks the server will announce. A body the tokenizer cannot
    take falls back to the estimate (and no ids): the server, not the router, reports bad input.
    """

    def __init__(self, tokenizer_dir: str):
        from transformers import AutoTokenizer

        if not Path(tokenizer_dir).is_dir():  # never a hub id: nothing is fetched at run time
            raise ValueError("not a directory")
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)

    def token_ids(self, body: dict[str, Any], kind: str) -> list[int] | None:
        """The ids the server will compute for the body's one prompt; None for several
        prompts, tools or vLLM's render fields (the server may render them its own way) or a
        body it cannot take."""
        given = given_token_ids(body, kind)
        if given is not None:
            return given
        try:
            if "messages" in body:
                messages = body["messages"]
                if "tools" in body or any(body.get(k) is not None for k in CHAT_RENDER_FIELDS):
                    return None  # the server renders these its own way
                if not all(
                    isinstance(m, dict) and isinstance(m.get("content", ""), str) for m in messages
                ):
                    return None
                text = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False
                )
                return list(self.tokenizer.encode(text, add_special_tokens=False))
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, str):
                return list(self.tokenizer.encode(prompt))
        except Exception:  # malformed messages, a template error: no ids
            pass
        return None

    def __call__(self, body: dict[str, Any]) -> int:
        if "input" in body:  # a Responses body: the server renders its items its own way
            return estimate_prompt_tokens(body)
        try:
            if "messages" in body:
                ids = self.tokenizer.apply_chat_template(
                    body["messages"], add_generation_prompt=True, tokenize=True
                )
                ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # BatchEncoding
                return max(1, len(ids)) * copies(body)
            prompts = _prompt_list(body.get("prompt", ""))
            if all(isinstance(p, str) for p in prompts):
                total = sum(len(self.tokenizer.encode(p)) for p in prompts)
                return max(1, total) * copies(body)
        except Exception:  # malformed messages, a template error: the estimate will do
            pass
        return estimate_prompt_tokens(body)
