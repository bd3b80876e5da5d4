"""Logprobs in OpenAI's two shapes, from the engine's `TokenLogprob`s.

Completions (the legacy shape, as vLLM answers it): `{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}`, one entry per token; `top_logprobs` maps each alternative's text
to its logprob and also lists the chosen token (so it holds up to logprobs + 1 entries). With
`echo`, the prompt's tokens come first and the first one's logprob and alternatives are null.
Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}` with exactly top_logprobs alternatives.

And vLLM's `prompt_logprobs` (a choice's on completions, the response's on chat): null for the
prompt's first token, then for each token an object keyed by token id (a string in JSON) of
`{"logprob", "rank", "decoded_token"}`: the prompt's token (its rank in the vocabulary) and the
`prompt_logprobs` most likely ones (ranks 1 to k), so k or k + 1 entries.
"""

from __future__ import annotations

from collections.abc import Iterable

from toppings.server.requests.request import TokenLogprob


class TokenText:
    """Each token's own text (special tokens spelled out), decoded once per id."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def completion_logprobs(
    tokens: Iterable[tuple[int, TokenLogprob | None]], token_text: TokenText, offset: int
) -> tuple[dict, int]:
    """The completions `logprobs` object of (token id, logprob) pairs whose text starts at
    character `offset` of the choice's text; returns it and the offset after the last token."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}  # fmt: skip
    for token_id, lp in tokens:
        text = token_text(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        top = {token_text(t): value for t, value in lp.top}
        top.setdefault(text, lp.logprob)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append(top)
    return out, offset


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(logprobs: Iterable[TokenLogprob], token_text: TokenText) -> dict:
    """The chat `logprobs` object of the generated tokens."""
    content = []
    for lp in logprobs:
        entry = _chat_entry(token_text(lp.token_id), lp.logprob)
        entry["top_logprobs"] = [_chat_entry(token_text(t), value) for t, value in lp.top]
        content.append(entry)
    return {"content": content}


def prompt_logprobs(
    scored: list[TokenLogprob | None] | None, k: int, token_text: TokenText
) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a prompt's scored tokens (the module's docstring)."""

    def entry(logprob: float, rank: int | None, token_id: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_text(token_id)}

    out: list[dict | None] = []
    for lp in scored or ():
        if lp is None:
            out.append(None)
            continue
        tokens = {str(lp.token_id): entry(lp.logprob, lp.rank, lp.token_id)}
        for rank, (token_id, logprob) in enumerate(lp.top[:k], 1):
            tokens.setdefault(str(token_id), entry(logprob, rank, token_id))
        out.append(tokens)
    return out
