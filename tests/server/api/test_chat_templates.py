"""Each checkpoint's own chat template renders through the chat path (server.api.openai.choices): a
Llama-3-style template (header tokens, <|eot_id|>) and a Qwen-style ChatML one (<|im_end|>),
each end-of-turn marker encoded as its one special token, the id generation_config.json lists
as a stop token."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from toppings.server.api.openai.choices import prompt_ids
from toppings.server.api.openai.schema import ParsedBody

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' }}"
    "{{ m['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
QWEN = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def tokenizer(specials: list[str], template: str, bos: str | None) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the messages' words plus the family's special tokens."""
    words = ["[UNK]", "be", "brief", "hi", "there", "system", "user", "assistant", "\n", "\n\n"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, unk_token="[UNK]")
    tok.chat_template = template
    return tok


def chat_ids(tok) -> list[int]:
    body = ParsedBody(kind="chat", model="m", adapter=None, prompts=None, messages=MESSAGES,
                      max_tokens=None, sampling={})  # fmt: skip
    return prompt_ids(body, tok, None)


@pytest.mark.parametrize(
    "specials, template, bos, end_of_turn, start",
    [
        (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
         LLAMA3, "<|begin_of_text|>", "<|eot_id|>", ["<|begin_of_text|>", "<|start_header_id|>"]),
        (["<|im_start|>", "<|im_end|>"], QWEN, None, "<|im_end|>", ["<|im_start|>", "system"]),
    ],
    ids=["llama3", "qwen"],
)  # fmt: skip
def test_the_checkpoint_template_renders_with_its_end_of_turn_token(
    specials, template, bos, end_of_turn, start
):
    tok = tokenizer(specials, template, bos)
    ids = chat_ids(tok)
    eot = tok.convert_tokens_to_ids(end_of_turn)
    assert ids.count(eot) == len(MESSAGES)  # one end-of-turn token per message, not its letters
    assert ids[: len(start)] == tok.convert_tokens_to_ids(start)
    if bos is not None:  # BOS once, from the template: encoding adds no second one
        assert ids.count(tok.bos_token_id) == 1
    assert "assistant" in tok.decode(ids[ids.index(eot, ids.index(eot) + 1) :])
