"""Prompt lengths for routing: exact with the base model's tokenizer, estimated without."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from toppings.scheduler.prompt_tokens import PromptCounter, estimate_prompt_tokens


def test_counts_match_the_tokenizer(tiny_model_dir):
    count = PromptCounter(str(tiny_model_dir))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": "abc abc"}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert count({"messages": messages}) == len(tokenizer.encode(chat, add_special_tokens=False))
    assert count({"prompt": "abcabc"}) == len(tokenizer.encode("abcabc"))
    assert count({"prompt": [5, 6, 7, 8]}) == 4  # token ids: counted as they are


def test_malformed_bodies_fall_back_to_the_estimate(tiny_model_dir):
    count = PromptCounter(str(tiny_model_dir))
    for body in ({"messages": "not a list"}, {"messages": [1, None]}, {"prompt": None}):
        assert count(body) == estimate_prompt_tokens(body) >= 1


def test_only_a_local_directory_is_taken():
    with pytest.raises(ValueError, match="not a directory"):
        PromptCounter("HuggingFaceTB/SmolLM2-135M-Instruct")  # a hub id: never fetched
