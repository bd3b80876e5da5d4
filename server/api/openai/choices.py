"""A validated body (`server.api.openai.schema.ParsedBody`) -> the engine requests that answer it.

A body becomes one request per choice: prompts x n, prompt-major (choice index = prompt index *
n + copy), which is the order OpenAI and vLLM number choices in. The n copies of a prompt are
independent requests, each with its own prefill (no KV sharing between them); with a seed,
copy j samples with seed + j so that the copies differ but repeat across calls. The operator's
limits (`RequestLimits`) are checked once every prompt fits the model's context: a prompt over
--max-prompt-tokens or an explicit max_tokens over --max-new-tokens-limit is refused, and a
default max_tokens is cut to the limit.

Before any tokenization, a text prompt (or the messages' text) longer than `max_prompt_chars` is
refused: no token of the vocabulary spans more than `max_token_chars` characters, so a text
longer than the token limit times that cannot fit, and the work spent on a prompt that will be
refused stays bounded (tokenizing megabytes takes seconds and gigabytes of memory).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from toppings.server.api.openai.chat_options import ChatOptions
from toppings.server.api.openai.schema import MAX_SEED, ParsedBody
from toppings.server.api.openai.tools import Tools, generic_tool_messages, template_renders_tools
from toppings.server.chat_template.render import render_chat
from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.request import GenerationRequest, RequestError, SamplingParams

DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256, "native": 16}


def max_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for (an upper bound).

    A vocabulary entry is written with at least one character per character it decodes to:
    byte-level BPE spells each byte as one character (and a character is at least one byte),
    SentencePiece spells a space as one character and a byte-fallback token as `<0x0A>`. Added
    tokens (`<|im_start|>`) are in the vocabulary too. Measured: SmolLM2's longest is 81 (a
    newline and 80 spaces), against about 4 characters a token in ordinary text. The bound
    assumes the tokenizer's normalizer does not shrink the text (NFC composing a letter and its
    accent does, by one character a pair: a margin the 20x above ordinary text covers).
    """
    return max(len(token) for token in tokenizer.get_vocab())


@dataclass(frozen=True)
class RequestLimits:
    """What the operator lets one request ask for; None: no limit.

    `max_prompt_chars` bounds the text of one prompt (for chat: of all its messages) before it
    is tokenized; `max_prompt_chars_per_token` is the factor it was made with, for the message.
    """

    max_prompt_tokens: int | None = None
    max_new_tokens_limit: int | None = None
    max_prompt_chars: int | None = None
    max_prompt_chars_per_token: int = 1

    @classmethod
    def for_model(
        cls,
        tokenizer,
        max_model_len: int,
        max_prompt_tokens: int | None = None,
        max_new_tokens_limit: int | None = None,
    ) -> RequestLimits:
        """The operator's limits plus the character bound of a prompt that can fit: the token
        limit (--max-prompt-tokens, else the context) times the longest token's characters."""
        chars_per_token = max_token_chars(tokenizer)
        max_tokens = min(max_model_len, max_prompt_tokens or max_model_len)
        return cls(max_prompt_tokens, max_new_tokens_limit, max_tokens * chars_per_token,
                   chars_per_token)  # fmt: skip

    def check_text(self, text_chars: int) -> None:
        """Raises RequestError when a prompt of `text_chars` characters cannot fit, before
        anything tokenizes it."""
        limit = self.max_prompt_chars
        if limit is not None and text_chars > limit:
            max_tokens = limit // self.max_prompt_chars_per_token
            raise RequestError(
                f"the prompt has {text_chars} characters; this server takes at most {limit} "
                f"({max_tokens} tokens of at most {self.max_prompt_chars_per_token} characters)"
            )

    def check(self, parsed: ParsedBody, num_ids: int, max_tokens: int) -> int:
        """The max_new_tokens of a prompt of `num_ids` tokens whose context allows `max_tokens`;
        raises RequestError past a limit."""
        limit = self.max_prompt_tokens
        if limit is not None and num_ids > limit:
            raise RequestError(
                f"the prompt has {num_ids} tokens; this server takes at most {limit}"
            )
        limit = self.max_new_tokens_limit
        if limit is None or max_tokens <= limit:
            return max_tokens
        if parsed.max_tokens is not None:
            raise RequestError(
                f"max tokens {parsed.max_tokens} is over this server's limit of {limit}"
            )
        return limit


def messages_chars(messages: list[dict]) -> int:
    """The characters of chat messages (contents, roles, tool calls as JSON) before the template
    renders them."""
    return sum(
        len(value) if isinstance(value, str) else len(json.dumps(value))
        for message in messages
        for value in message.values()
    )


def check_prompt_text(parsed: ParsedBody, limits: RequestLimits) -> None:
    """Refuse, before tokenizing, a text prompt or messages over the character bound."""
    if parsed.messages is not None:
        tools = parsed.tools.functions if parsed.tools is not None else ()
        limits.check_text(messages_chars(parsed.messages) + sum(len(f) for f in tools))
    for prompt in parsed.prompts or ():
        if isinstance(prompt, str):
            limits.check_text(len(prompt))


def template_reasons(tokenizer) -> bool:
    """Whether the chat template writes a reasoning part (Qwen3's `enable_thinking`, a
    `<think>` block): there `reasoning_effort` would mean something this server cannot set."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    return "enable_thinking" in template or "<think>" in template


def prompt_ids(
    parsed: ParsedBody, tokenizer, prompt: str | list[int] | None, max_chars: int | None = None
) -> list[int]:
    """Token ids of one prompt: chat-templated messages (rendered under a budget whose size
    bound is `max_chars`, server.chat_template.render), encoded text, or the ids as given."""
    if parsed.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template; use /v1/completions")
        if "reasoning_effort" in parsed.ignored and template_reasons(tokenizer):
            raise RequestError("'reasoning_effort' is not supported by this server: this "
                               "model's chat template reasons, and its effort cannot be set "
                               "here; its own switch can, with 'chat_template_kwargs' (Qwen3: "
                               '{"enable_thinking": false})')  # fmt: skip
        return chat_ids(tokenizer, parsed.messages, parsed.tools, parsed.chat, max_chars)
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    return list(prompt)


def chat_ids(
    tokenizer,
    messages: list[dict],
    tools: Tools | None,
    chat: ChatOptions,
    max_chars: int | None,
    add_special_tokens: bool = False,
) -> list[int]:
    """Token ids of parsed chat messages rendered by the tokenizer's chat template (it has one),
    the tools given to the template where it renders them, else in the generic format's system
    message (server.api.openai.tools): what a chat request's prompt is, and /tokenize counts
    (which may ask the tokenizer's special tokens on top, as vLLM's does)."""
    template_tools = None
    if tools is not None and template_renders_tools(tokenizer):
        template_tools = tools.template_tools()
    elif tools is not None:  # the generic format: the tools in the system message
        messages = generic_tool_messages(messages, tools)
    text = render_chat(tokenizer, messages, template_tools, chat.add_generation_prompt, max_chars,
                       chat.template_kwargs, chat.continue_final_message)  # fmt: skip
    # The rendered template already holds the BOS token where the model wants one.
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def truncated(parsed: ParsedBody, ids: list[int], max_model_len: int) -> list[int]:
    """A prompt's ids cut to their last `truncate_prompt_tokens` (vLLM's: -1 as many as the
    context holds), or as they are."""
    if parsed.truncate is None:
        return ids
    keep = max_model_len if parsed.truncate == -1 else parsed.truncate
    if keep > max_model_len:
        raise RequestError(f"'truncate_prompt_tokens' ({keep}) exceeds this model's context of "
                           f"{max_model_len} tokens")  # fmt: skip
    return ids[-keep:]


def _max_tokens(parsed: ParsedBody, num_ids: int, max_model_len: int) -> int:
    room = max_model_len - num_ids
    if room < (0 if parsed.max_tokens == 0 else 1):
        raise RequestError(
            f"the prompt has {num_ids} tokens; this model's context holds {max_model_len}"
        )
    max_tokens = parsed.max_tokens
    if max_tokens is None:
        return min(DEFAULT_MAX_TOKENS[parsed.kind], room)
    if not (0 if parsed.echo else 1) <= max_tokens <= max_model_len:
        raise RequestError(f"max tokens must be in [1, {max_model_len}], not {max_tokens}")
    if max_tokens > room:
        raise RequestError(
            f"this model's context holds {max_model_len} tokens; the prompt has {num_ids} and "
            f"{max_tokens} more were asked for"
        )
    return max_tokens


def _sampling(parsed: ParsedBody, vocab_size: int) -> dict:
    sampling = dict(parsed.sampling, top_k=min(parsed.sampling["top_k"], vocab_size))
    if any(not 0 <= t < vocab_size for t, _ in sampling["logit_bias"]):
        raise RequestError(f"'logit_bias' token ids must be in [0, {vocab_size})")
    for key in ("stop_token_ids", "allowed_token_ids"):
        if any(t >= vocab_size for t in sampling[key]):
            raise RequestError(f"'{key}' must be in [0, {vocab_size})")
    sampling["logprobs"] = parsed.logprobs
    if parsed.echo and parsed.logprobs is not None:
        sampling["prompt_logprobs"] = parsed.logprobs
    elif parsed.prompt_logprobs is not None:
        sampling["prompt_logprobs"] = parsed.prompt_logprobs
    elif parsed.max_tokens == 0:
        sampling["prompt_logprobs"] = 0  # nothing to generate: the engine only runs the prefill
    return sampling


def build_requests(
    parsed: ParsedBody,
    tokenizer,
    max_model_len: int,
    vocab_size: int,
    resolve: Callable[[str | None], AdapterRef | None],
    limits: RequestLimits = RequestLimits(),
) -> tuple[list[GenerationRequest], list[list[int]]]:
    """Check each prompt's text against the character bound, tokenize it and check it against
    the context, then against `limits`, then resolve the adapter's name (`resolve`: the
    engine's, 404 for a name nobody serves) once for all; returns the engine requests (one per
    choice, in choice order) and each prompt's token ids."""
    check_prompt_text(parsed, limits)
    sampling = _sampling(parsed, vocab_size)
    all_ids, context_max_tokens = [], []
    for prompt in parsed.prompts or [None]:
        ids = truncated(parsed, prompt_ids(parsed, tokenizer, prompt, limits.max_prompt_chars),
                        max_model_len)  # fmt: skip
        if not ids:
            raise RequestError("the prompt is empty")
        if any(not 0 <= t < vocab_size for t in ids):
            raise RequestError(f"token ids must be in [0, {vocab_size})")
        context_max_tokens.append(_max_tokens(parsed, len(ids), max_model_len))
        all_ids.append(ids)
    max_tokens_each = [
        limits.check(parsed, len(ids), context_max)
        for ids, context_max in zip(all_ids, context_max_tokens)
    ]
    adapter = resolve(parsed.adapter)
    requests = []
    for ids, max_tokens in zip(all_ids, max_tokens_each):
        for copy in range(parsed.n):
            seed = sampling["seed"]
            if seed is not None:
                seed = (seed + copy) % MAX_SEED
            params = SamplingParams(**dict(sampling, max_new_tokens=max_tokens, seed=seed))
            requests.append(GenerationRequest(prompt_ids=ids, params=params, adapter=adapter))
    check_logprob_entries(requests)
    return requests, all_ids


# Logprob entries one request may ask for: each scored token's own and its alternatives, over
# every choice. They are held as Python objects until the response is written: at 20
# alternatives 11 KB a token (tracemalloc: the engine's TokenLogprob 2.6 KB, the response's
# dicts 6.9 KB, its JSON 1.7 KB), about 530 bytes an entry, so one request of 256 choices of
# 8,000 scored tokens would hold some 20 GB. 250k entries: about 0.13 GB; lm-eval's scoring
# (echo, 1 alternative) of 125k prompt tokens, or 12k tokens at 20 alternatives.
MAX_LOGPROB_ENTRIES = 250_000
# What the answers in flight may hold together (about 1 GB): past it a request gets 429 with
# Retry-After, so many requests at the bound above cannot exhaust the host's memory together
# (1,024 in flight, 4x a batch of 256, would otherwise be allowed 133 GB).
LOGPROB_ENTRIES_IN_FLIGHT = 8 * MAX_LOGPROB_ENTRIES


def logprob_entries(requests: list[GenerationRequest]) -> int:
    """The logprob entries the requests' answers may hold: scored tokens (prompt and output)
    x (alternatives + 1)."""
    entries = 0
    for req in requests:
        per_prompt, per_output = req.params.prompt_logprobs, req.params.logprobs
        if per_prompt is not None:
            entries += (len(req.prompt_ids) - 1) * (per_prompt + 1)
        if per_output is not None:
            entries += req.params.max_new_tokens * (per_output + 1)
    return entries


def check_logprob_entries(requests: list[GenerationRequest]) -> None:
    """Raises RequestError when the request's choices would score more than
    MAX_LOGPROB_ENTRIES tokens x alternatives (prompt and output logprobs together)."""
    entries = logprob_entries(requests)
    if entries > MAX_LOGPROB_ENTRIES:
        raise RequestError(
            f"the logprobs asked for come to {entries} entries (scored tokens x (alternatives "
            f"+ 1), every choice); this server answers at most {MAX_LOGPROB_ENTRIES} a request"
        )
