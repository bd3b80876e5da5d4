"""`--load-format dummy`: a directory with only config.json and a tokenizer loads with random
weights of transformers' own shapes for that config, the same for the same seed, and serves."""

from __future__ import annotations

import json

import pytest
import torch

from toppings.scripts.make_dummy_model import PRESETS, make_dummy_model
from toppings.server.config import EngineConfig
from toppings.server.model.loader import load_checkpoint
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine


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
    config = EngineConfig(dtype="float32", max_total_tokens=512, load_format="dummy")
    engine = build_engine(str(dummy_dir), config)
    try:
        params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
        out = engine.submit(GenerationRequest([5, 6, 7], params)).result(60)
        assert len(out.new_token_ids) == 6
        assert all(0 <= t < engine.model_config.vocab_size for t in out.new_token_ids)
    finally:
        engine.shutdown()


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
