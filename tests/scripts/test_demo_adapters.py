"""Demo adapter training: the templated data, the loss mask, and a trained adapter that loads."""

from __future__ import annotations

from transformers import AutoConfig, AutoTokenizer

from toppings.gpu_lora.peft.adapter import load_peft_adapter
from toppings.scripts.demo_data import STYLES, caps, examples
from toppings.scripts.train_demo_adapters import encode, is_trained, train_one
from toppings.server.model.config import ModelConfig


def test_examples_have_three_distinct_styles():
    data = examples()
    assert len(data) == 56 and len({e.question for e in data}) == 56
    for e in data:
        french, terse = STYLES["french"](e), STYLES["terse"](e)
        assert french != e.english
        assert len(terse.split()) <= 6 and terse.count(".") == 1
    french = " ".join(STYLES["french"](e) for e in data)
    assert sum(french.count(w) for w in (" est ", " la ", " le ", " les ", " et ")) > 56
    assert caps("A dog barks. It runs! Then it sleeps.") == "A DOG BARKS. IT RUNS!"


def test_loss_covers_the_answer_and_end_of_turn_only(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    question = [{"role": "user", "content": "What is 2 plus 3?"}]
    ids, labels = encode(tokenizer, question[0]["content"], "5.")
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    num_prompt = len(tokenizer.encode(prompt, add_special_tokens=False))
    assert len(ids) == len(labels) and labels[:num_prompt] == [-100] * num_prompt
    assert labels[num_prompt:] == ids[num_prompt:]
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[num_prompt:-1]) == "5."


def test_trained_adapter_loads_as_peft(tiny_model_dir, tmp_path):
    loss = train_one(tiny_model_dir, "caps", tmp_path / "caps", epochs=2, lr=3e-3, seed=0)
    assert loss == loss and is_trained(tmp_path / "caps")  # not NaN, files written
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir), "tiny")
    adapter = load_peft_adapter(str(tmp_path / "caps"), config)
    assert adapter.rank == 8
    assert set(adapter.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
