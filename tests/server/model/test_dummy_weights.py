"""`--load-format dummy`: a directory with only config.json and a tokenizer loads with random
weights of transformers' own shapes for that config, the same for the same seed, and serves."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import running_engine
from toppings.scripts.make_dummy_model import PRESETS, make_dummy_model
from toppings.server.config import EngineConfig
from toppings.server.model.loader import load_checkpoint
from toppings.server.requests.request import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def dummy_dir(tmp_path_factory, tiny_model_dir):
    """The tiny Llama's config and tokenizer, no weights."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    return make_dummy_model(tmp_path_factory.mktemp("dummy"), config, tiny_model_dir)


def test_the_directory_holds_no_weights_and_auto_refuses_it(dummy_dir):
    assert not list(dummy_dir.glob("*.safetensors"))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_checkpoint(str(dummy_dir))


def test_dummy_weights_have_the_checkpoint_shapes_and_follow_the_seed(dummy_dir, tiny_model_dir):
    real = load_checkpoint(str(tiny_model_dir))
    dummy = load_checkpoint(str(dummy_dir), "dummy", seed=1)
    assert sorted(dummy.weights) == sorted(real.weights)
    for name, tensor in dummy.weights.items():
        assert tensor.shape == real.weights[name].shape, name
        assert tensor.dtype == real.weights[name].dtype == torch.float32, name
        assert torch.isfinite(tensor).all(), name
    assert torch.equal(dummy.weights["model.norm.weight"], torch.ones(64))
    q = "model.layers.1.self_attn.q_proj.weight"
    assert 0.01 < dummy.weights[q].std().item() < 0.04
    again = load_checkpoint(str(dummy_dir), "dummy", seed=1).weights
    other = load_checkpoint(str(dummy_dir), "dummy", seed=2).weights
    assert torch.equal(again[q], dummy.weights[q]) and not torch.equal(other[q], dummy.weights[q])


def test_a_dummy_model_serves(dummy_dir):
    with running_engine(dummy_dir, max_total_tokens=512, load_format="dummy") as engine:
        params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
        out = engine.submit(GenerationRequest([5, 6, 7], params)).result(60)
        assert len(out.new_token_ids) == 6
        assert all(0 <= t < engine.model_config.vocab_size for t in out.new_token_ids)


def test_a_tied_model_has_no_lm_head_of_its_own(tmp_path, tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text()) | {
        "tie_word_embeddings": True
    }
    weights = load_checkpoint(
        str(make_dummy_model(tmp_path / "tied", config, tiny_model_dir)), "dummy"
    ).weights
    assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_are_configs_transformers_reads(preset):
    from transformers import AutoConfig

    config = AutoConfig.for_model(**PRESETS[preset])
    assert config.hidden_size == PRESETS[preset]["hidden_size"]


def test_every_tensor_of_other_families_is_there_by_its_hf_name():
    """Qwen2's q/k/v biases and Qwen3's q/k norms come by name as the projections do, so model
    code that reads them needs nothing of the loader."""
    from transformers import Qwen2Config, Qwen3Config

    from toppings.server.model.weights import DummyWeights

    shapes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    qwen2 = DummyWeights.for_config(Qwen2Config(**shapes), torch.bfloat16)
    assert qwen2["model.layers.1.self_attn.k_proj.bias"].shape == (32,)
    assert qwen2["model.layers.1.self_attn.k_proj.bias"].dtype == torch.bfloat16
    qwen3 = DummyWeights.for_config(Qwen3Config(**shapes), torch.bfloat16)
    assert torch.equal(qwen3["model.layers.0.self_attn.q_norm.weight"], torch.ones(16).bfloat16())
    assert "model.layers.0.self_attn.k_norm.weight" in qwen3
    assert "model.layers.0.self_attn.q_proj.bias" not in qwen3


def test_load_format_is_a_serve_flag():
    from toppings.server.cli_args import build_parser, parse_configs

    parser = build_parser()
    assert "--load-format" in parser.format_help()
    _, config, _ = parse_configs(parser.parse_args(["--model", "m", "--load-format", "dummy"]))
    assert config.load_format == "dummy"
    _, default, _ = parse_configs(parser.parse_args(["--model", "m"]))
    assert default.load_format == "auto"
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(load_format="pickle")


def test_a_cpu_model_takes_the_weights_as_drawn_on_the_host(dummy_dir):
    """On a CPU the engine's tensors are those `load_checkpoint` draws (a host-side peer of the
    same seed holds them), whatever dtype the model runs in."""
    checkpoint = load_checkpoint(str(dummy_dir), "dummy", seed=1)
    assert checkpoint.weights_on("cpu", torch.bfloat16) is checkpoint.weights


def test_weights_drawn_in_the_model_dtype_keep_the_shapes_and_the_seed(dummy_dir):
    """The draw a CUDA model gets (each tensor where the model keeps it, in its dtype), on the
    CPU: the same names and shapes, in that dtype, norms all ones, N(0, 0.02), one seed one
    draw."""
    from toppings.server.model.weights import DummyWeights

    host = load_checkpoint(str(dummy_dir), "dummy", seed=1).weights
    direct = DummyWeights(host.shapes, torch.bfloat16, seed=1, device="cpu")
    assert sorted(direct) == sorted(host)
    for name, tensor in direct.items():
        assert tensor.shape == host[name].shape and tensor.dtype == torch.bfloat16, name
        assert tensor.device.type == "cpu" and torch.isfinite(tensor).all(), name
    assert torch.equal(direct["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    q = "model.layers.1.self_attn.q_proj.weight"
    assert 0.01 < direct[q].float().std().item() < 0.04
    assert torch.equal(direct[q], DummyWeights(host.shapes, torch.bfloat16, 1)[q])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dummy_weights_of_a_cuda_model_are_drawn_on_the_device(dummy_dir):
    checkpoint = load_checkpoint(str(dummy_dir), "dummy", seed=1)
    placed = checkpoint.weights_on("cuda", torch.bfloat16)
    again = checkpoint.weights_on("cuda", torch.bfloat16)
    q = "model.layers.1.self_attn.q_proj.weight"
    for name in checkpoint.weights:
        tensor = placed[name]
        assert tensor.device.type == "cuda" and tensor.dtype == torch.bfloat16, name
        assert tensor.shape == checkpoint.weights[name].shape, name
    assert torch.equal(placed[q], again[q])
    assert 0.01 < placed[q].float().std().item() < 0.04
    with running_engine(
        dummy_dir, max_total_tokens=512, load_format="dummy", device="cuda", dtype="bfloat16"
    ) as engine:
        params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        assert (
            len(engine.submit(GenerationRequest([5, 6, 7], params)).result(60).new_token_ids) == 4
        )
