"""The tiny Llama and random adapter makers: what they write loads like a real checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from toppings.gpu_lora.peft.adapter import load_peft_adapter
from toppings.scripts import make_adapters, make_tiny_llama
from toppings.scripts.make_adapters import make_random_adapter, make_random_adapters
from toppings.server.model.config import ModelConfig

TEXT = "The quick brown fox, and the lazy dog.\n\n  x = [1, 2]; print(x)  # ok?"


def test_tiny_model_loads_and_generates(tiny_model_dir: Path) -> None:
    assert (tiny_model_dir / "model.safetensors").is_file()
    assert not list(tiny_model_dir.glob("*.bin"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir), "tiny")
    shape = (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads)
    assert shape == (64, 2, 4, 2)
    assert config.eos_token_ids == (tokenizer.eos_token_id,)
    assert len(tokenizer) <= config.vocab_size

    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
        out = model.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert torch.isfinite(logits).all()
    new = out[0, ids.shape[1] :].tolist()
    assert len(new) == 16
    assert len(set(new)) > 4, f"greedy decoding is stuck: {new}"


def test_tokenizer_round_trips_and_applies_chat_template(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT
    # Streaming detokenization relies on per-token pieces concatenating to the text.
    assert "".join(tokenizer.decode([i]) for i in ids) == TEXT
    assert len(ids) < len(TEXT)  # multi-character tokens exist

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    chat_ids = tokenizer.encode(text, add_special_tokens=False)
    assert chat_ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    assert chat_ids.count(tokenizer.eos_token_id) == 2
    assert tokenizer.decode(chat_ids) == text


def test_tiny_llama_options(tmp_path: Path) -> None:
    out = make_tiny_llama.make_tiny_llama(
        tmp_path / "m", num_layers=3, vocab_size=300, tie_word_embeddings=True, rope_theta=500.0
    )
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(out), "m")
    assert (config.num_layers, config.vocab_size, config.tie_word_embeddings) == (3, 300, True)
    assert config.rope_theta == 500.0
    assert len(AutoTokenizer.from_pretrained(out)) == 300
    with pytest.raises(ValueError, match="vocab_size must be at least"):
        make_tiny_llama.make_tiny_llama(tmp_path / "small", vocab_size=50)


def test_random_adapter_loads_in_peft_and_ours_and_changes_logits(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    targets = ("q_proj", "v_proj", "down_proj")
    path = make_random_adapter(tmp_path / "a", tiny_model_dir, rank=4, target_modules=targets)
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir), "tiny")
    adapter = load_peft_adapter(path, config)
    assert (adapter.rank, adapter.alpha, adapter.target_modules) == (4, 8.0, targets)
    assert adapter.base_model == str(tiny_model_dir.resolve())

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.tensor([[5, 17, 29, 40, 52, 63, 77, 90]])
    with torch.no_grad():
        base_logits = base(ids).logits
        peft_model = PeftModel.from_pretrained(base, str(path)).eval()
        lora_logits = peft_model(ids).logits
    assert torch.isfinite(lora_logits).all()
    assert (lora_logits - base_logits).norm() > 0.05 * base_logits.norm()

    probe = torch.randn(256, config.hidden_size, generator=torch.Generator().manual_seed(1))
    for (layer_idx, module), (a, b) in adapter.weights.items():
        peft_layer = peft_model.base_model.model.model.layers[layer_idx]
        proj = getattr(peft_layer.self_attn if module != "down_proj" else peft_layer.mlp, module)
        assert torch.equal(a, proj.lora_A["default"].weight)
        assert torch.equal(b, proj.lora_B["default"].weight)
        assert adapter.scale == pytest.approx(proj.scaling["default"])
        if module != "down_proj":  # down_proj's input is intermediate-sized
            ratio = (adapter.scale * probe @ a.T @ b.T).norm() / (probe @ proj.weight.T).norm()
            assert 0.1 < ratio < 0.4  # delta_ratio 0.2, measured on other random inputs


def test_random_adapters_names_seeds_and_init_std(tiny_model_dir: Path, tmp_path: Path) -> None:
    paths = make_random_adapters(tmp_path, tiny_model_dir, [2, 4], ("k_proj",), seed=3, count=2)
    assert [p.name for p in paths] == ["lora-r2-0", "lora-r2-1", "lora-r4-0", "lora-r4-1"]
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir), "tiny")
    adapters = [load_peft_adapter(p, config) for p in paths]
    assert [a.rank for a in adapters] == [2, 2, 4, 4]
    first, second = adapters[0].weights[(0, "k_proj")], adapters[1].weights[(0, "k_proj")]
    assert not torch.equal(first[0], second[0])

    again = make_random_adapter(
        tmp_path / "again", tiny_model_dir, rank=2, target_modules=("k_proj",), seed=3
    )
    assert torch.equal(load_peft_adapter(again, config).weights[(0, "k_proj")][1], first[1])

    drawn = make_random_adapter(
        tmp_path / "std", tiny_model_dir, rank=8, target_modules=("o_proj",), init_std=0.5
    )
    a, b = load_peft_adapter(drawn, config).weights[(1, "o_proj")]
    assert 0.4 < a.std() < 0.6 and 0.4 < b.std() < 0.6


def test_clis(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    make_tiny_llama.main([str(tmp_path / "m"), "--layers", "1", "--hidden", "32", "--heads", "2"])
    assert AutoConfig.from_pretrained(tmp_path / "m").num_hidden_layers == 1
    make_adapters.main(
        ["--base", str(tmp_path / "m"), "--out", str(tmp_path / "ads"), "--ranks", "2,3"]
        + ["--targets", "q_proj,up_proj", "--count", "1"]
    )
    printed = capsys.readouterr().out.split()
    assert printed[-2:] == [
        str(tmp_path / "ads" / "lora-r2-0"),
        str(tmp_path / "ads" / "lora-r3-0"),
    ]
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path / "m"), "m")
    adapter = load_peft_adapter(tmp_path / "ads" / "lora-r3-0", config)
    assert adapter.target_modules == ("q_proj", "up_proj") and adapter.rank == 3
