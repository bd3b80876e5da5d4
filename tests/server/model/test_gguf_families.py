"""The GGUF path for the families llama.cpp exports: a tiny llama- and qwen2-arch GGUF, written
offline with the `gguf` package as llama.cpp's converter lays it out, converts back to every
tensor of the Hugging Face checkpoint it came from, by its Hugging Face name (qwen2's q/k/v
biases included), which is what the model code reads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

SHAPES = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
              eos_token_id=2)  # fmt: skip
MERGES = ["Ġ t", "h e", "i n", "Ġt he"]


def byte_level_vocab() -> list[str]:
    """The 256 byte tokens of a GPT-2-style tokenizer plus the merges' results (260 tokens)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return sorted(bytes_to_unicode().values()) + ["Ġt", "he", "in", "Ġthe"]


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores a llama q/k projection with each head's rotary halves interleaved."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(
    path: Path, arch: str, state: dict[str, torch.Tensor], types: dict[str, object] | None = None
) -> None:
    """A float32 GGUF of `state` (Hugging Face names) with the hyper-parameters of SHAPES;
    `types` stores the tensors it names in those GGML types instead (gguf's own quantizer)."""
    model_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2}[arch]
    names = gguf.get_tensor_name_map(model_arch, SHAPES["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(SHAPES["max_position_embeddings"])
    writer.add_embedding_length(SHAPES["hidden_size"])
    writer.add_block_count(SHAPES["num_hidden_layers"])
    writer.add_feed_forward_length(SHAPES["intermediate_size"])
    writer.add_head_count(SHAPES["num_attention_heads"])
    writer.add_head_count_kv(SHAPES["num_key_value_heads"])
    writer.add_rope_freq_base(SHAPES["rope_theta"])
    writer.add_layer_norm_rms_eps(SHAPES["rms_norm_eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(arch)
    vocab = byte_level_vocab()
    writer.add_token_list(vocab)
    writer.add_token_types([1] * len(vocab))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(SHAPES["bos_token_id"])
    writer.add_eos_token_id(SHAPES["eos_token_id"])
    for name, tensor in state.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = SHAPES["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            tensor = llama_cpp_permute(tensor, heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        qtype = (types or {}).get(name)
        if qtype is None:
            writer.add_tensor(gguf_name, tensor.numpy())
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(tensor.numpy(), qtype),
                              raw_dtype=qtype)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_gguf_converts_to_every_tensor_by_its_hf_name(arch, tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from toppings.server.model.loader import resolve_model_dir
    from toppings.server.model.weights import SafetensorsWeights

    monkeypatch.setenv("TOPPINGS_CACHE", str(tmp_path / "cache"))
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[arch]
    torch.manual_seed(0)
    state = model_cls(config_cls(**SHAPES)).float().state_dict()
    if arch == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in state
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, arch, state)
    from gguf import GGUFReader

    parses = []
    parse = GGUFReader.__init__

    def counted(self, *args, **kwargs):
        parses.append(args[0])
        parse(self, *args, **kwargs)

    monkeypatch.setattr(GGUFReader, "__init__", counted)
    model_dir = resolve_model_dir(str(path))
    assert len(parses) == 1, parses  # config, tensors and tokenizer share one parse
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == arch
    weights = SafetensorsWeights.from_dir(model_dir)
    assert sorted(weights) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(weights[name], tensor), name
    assert resolve_model_dir(str(path)) == model_dir  # converted once, then found in the cache


def test_two_ggufs_of_one_name_are_two_models(tmp_path, monkeypatch):
    """`a/model.gguf` and `b/model.gguf`, and a file replaced in place (its size and modification
    time kept, as `cp -p` does), are converted each on their own (the copy was found by the
    file's stem, and the second served the first's weights); the replaced file's old copy is
    removed; the served name stays the stem."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from toppings.server.model.loader import load_checkpoint, resolve_model_dir
    from toppings.server.model.weights import SafetensorsWeights

    monkeypatch.setenv("TOPPINGS_CACHE", str(tmp_path / "cache"))
    states, dirs = [], []
    for seed, folder in enumerate(("a", "b", "a")):  # "a" again: replaced in place
        torch.manual_seed(seed)
        states.append(LlamaForCausalLM(LlamaConfig(**SHAPES)).float().state_dict())
        path = tmp_path / folder / "model.gguf"
        path.parent.mkdir(exist_ok=True)
        path.unlink(missing_ok=True)
        write_gguf(path, "llama", states[-1])
        os.utime(path, ns=(10**9, 10**9))  # one modification time for all three
        dirs.append(resolve_model_dir(str(path)))
        weights = SafetensorsWeights.from_dir(dirs[-1])
        name = "model.layers.0.self_attn.o_proj.weight"
        assert torch.equal(weights[name], states[-1][name]), folder
    assert len(set(dirs)) == 3
    assert not dirs[0].exists() and dirs[1].exists() and dirs[2].exists()
    assert load_checkpoint(str(tmp_path / "b" / "model.gguf")).config.name == "model"
