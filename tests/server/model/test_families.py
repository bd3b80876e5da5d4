"""The family table: what ModelConfig.from_hf reads for each served family, the RoPE frequencies
against transformers' own, Qwen3's per-head norm and biased projections against torch, and the
one-line refusals of anything else (before any weight is read)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from tests.server.model.tiny_families import CHECKPOINTS, SHAPES
from toppings.gpu_lora.targets import LORA_TARGETS
from toppings.server.model.config import ModelConfig
from toppings.server.model.family import FAMILIES, RopeType
from toppings.server.model.fused import rms_norm_heads_
from toppings.server.model.linear import Linear
from toppings.server.model.llama import rope_inv_freq

SERVED = "served families: llama, mistral, qwen2, qwen3"


def hf_config(name: str, **overrides):
    from transformers import AutoConfig

    model_type, changes = CHECKPOINTS[name]
    return AutoConfig.for_model(model_type, **{**SHAPES, **changes, **overrides})


def test_every_family_targets_all_seven_projections():
    assert set(FAMILIES) == {"llama", "mistral", "qwen2", "qwen3"}
    for family in FAMILIES.values():
        assert family.lora_targets == LORA_TARGETS
        assert family.rope_types == frozenset(RopeType)


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("llama3", dict(qkv_bias=False, has_qk_norm=False, rope_type=RopeType.LLAMA3)),
        ("llama-linear", dict(qkv_bias=False, rope_type=RopeType.LINEAR)),
        ("llama-dynamic", dict(rope_type=RopeType.DYNAMIC)),
        ("llama-bias", dict(qkv_bias=True, o_bias=True, mlp_bias=True)),
        ("mistral", dict(qkv_bias=False, o_bias=False, rope_type=RopeType.DEFAULT)),
        ("qwen2", dict(qkv_bias=True, o_bias=False, mlp_bias=False, tie_word_embeddings=True)),
        ("qwen3", dict(qkv_bias=False, has_qk_norm=True, head_dim=24)),
    ],
)
def test_from_hf_reads_the_family_switches(name, want):
    config = ModelConfig.from_hf(hf_config(name), name)
    assert config.family == CHECKPOINTS[name][0]
    got = {k: getattr(config, k, None) for k in want if k != "rope_type"}
    assert got == {k: v for k, v in want.items() if k != "rope_type"}
    if "rope_type" in want:
        assert config.rope_scaling.rope_type is want["rope_type"]


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3"])
def test_a_scored_token_weighs_the_lm_head_over_the_layers_projections(name):
    # the oracle: transformers' own model, its head's weights over its projections' weights
    from transformers import AutoModelForCausalLM

    hf = hf_config(name, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(hf)
    projections = sum(
        module.weight.numel()
        for path, module in model.named_modules()
        if path.rsplit(".", 1)[-1] in LORA_TARGETS
    )
    want = model.lm_head.weight.numel() / projections
    assert ModelConfig.from_hf(hf, name).scored_token_weight == pytest.approx(want)


def test_llama3_scaling_parameters_are_read():
    config = ModelConfig.from_hf(hf_config("llama3"), "l3")
    s = config.rope_scaling
    assert (s.factor, s.low_freq_factor, s.high_freq_factor) == (8.0, 1.0, 4.0)
    assert s.original_max_position_embeddings == 16
    assert config.max_position_embeddings == 512


@pytest.mark.parametrize("name", ["llama3", "llama-linear", "llama-dynamic", "mistral", "qwen3"])
def test_rope_frequencies_equal_transformers(name):
    """inv_freq as transformers' ROPE_INIT_FUNCTIONS computes it for the served context."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_config(name)
    ours = rope_inv_freq(ModelConfig.from_hf(hf, name))
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":
        d = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        theta = hf.rope_parameters["rope_theta"]
        want = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    else:
        seq_len = hf.max_position_embeddings if rope_type == "dynamic" else None
        want, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", seq_len)
        assert attention_factor == 1.0
    assert torch.allclose(ours, want, rtol=1e-6, atol=0)
    if rope_type in ("llama3", "linear"):
        unscaled = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
        assert not torch.allclose(ours, unscaled), "the scaling changed nothing"


def test_unsupported_model_type_is_one_line():
    from transformers import AutoConfig

    with pytest.raises(ValueError) as info:
        ModelConfig.from_hf(AutoConfig.for_model("gpt2"), "g")
    assert str(info.value) == f"model_type 'gpt2' is not supported; {SERVED}"


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_unsupported_rope_type_is_one_line(name):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    with pytest.raises(ValueError) as info:
        ModelConfig.from_hf(hf_config(name, rope_parameters=yarn), name)
    message = str(info.value)
    assert "\n" not in message
    assert "rope type 'yarn' is not supported" in message
    assert "served rope types: default, linear, dynamic, llama3" in message


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_another_mlp_activation_is_one_line(name):
    """The MLP runs SiLU; a checkpoint of another activation was served with SiLU (wrong from
    the first token). transformers' `swish` is SiLU."""
    with pytest.raises(ValueError) as info:
        ModelConfig.from_hf(hf_config(name, hidden_act="gelu_pytorch_tanh"), name)
    assert str(info.value) == (
        "hidden_act 'gelu_pytorch_tanh' is not supported; the MLP runs SiLU (silu)"
    )
    assert ModelConfig.from_hf(hf_config(name, hidden_act="swish"), name).name == name


def test_refused_before_any_weight_is_read(tmp_path):
    """A checkpoint of another family: load_checkpoint names the served families, not the
    missing weights or tokenizer it never got to."""
    from transformers import AutoConfig

    from toppings.server.model.loader import load_checkpoint

    AutoConfig.for_model("gpt2").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=SERVED):
        load_checkpoint(str(tmp_path))


def test_serve_refuses_an_unsupported_family_or_rope_in_one_line(tmp_path):
    from transformers import AutoConfig

    from tests.server.api.test_cli_errors import assert_refused, run

    AutoConfig.for_model("gpt2").save_pretrained(tmp_path / "gpt2")
    result = run("toppings-serve", "--model", str(tmp_path / "gpt2"), "--port", "0")
    assert_refused(result, "toppings-serve", "model_type 'gpt2' is not supported", SERVED)
    config = hf_config("llama3").to_dict()
    config["rope_parameters"] = {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    }  # fmt: skip
    (tmp_path / "yarn").mkdir()
    (tmp_path / "yarn" / "config.json").write_text(json.dumps(config))
    result = run("toppings-serve", "--model", str(tmp_path / "yarn"), "--port", "0")
    assert_refused(result, "toppings-serve", "rope type 'yarn' is not supported")


def test_sliding_window_caps_the_context_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="toppings.server.model.config"):
        config = ModelConfig.from_hf(hf_config("mistral", sliding_window=48), "m")
    assert config.max_position_embeddings == 48 and config.sliding_window == 48
    assert "sliding window of 48 tokens" in caplog.text
    wide = ModelConfig.from_hf(hf_config("mistral", sliding_window=4096), "m")
    assert wide.max_position_embeddings == 512
    # Qwen's window is off unless use_sliding_window: transformers drops it.
    off = ModelConfig.from_hf(hf_config("qwen2", sliding_window=48), "q")
    assert off.max_position_embeddings == 512 and off.sliding_window is None
    on = ModelConfig.from_hf(
        hf_config("qwen2", sliding_window=48, use_sliding_window=True, max_window_layers=0), "q"
    )
    assert on.max_position_embeddings == 48


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_heads_equals_qwen3_norm(dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, (4 + 2 * 2) * 24, generator=gen).to(dtype)  # [T, (N+2K)*D]
    norm = Qwen3RMSNorm(24, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=gen)
    q = qkv[:, : 4 * 24].view(5, 4, 24)  # a strided view, as the forward hands it
    with torch.no_grad():
        want = norm(q.clone())
    rest = qkv[:, 4 * 24 :].clone()
    rms_norm_heads_(q, norm.weight.detach(), 1e-6)
    assert torch.equal(qkv[:, : 4 * 24].view(5, 4, 24), want)
    assert torch.equal(qkv[:, 4 * 24 :], rest), "k and v are left alone"


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_linear_adds_its_bias(pack, rows):
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen)
    x = torch.randn(rows, 32, generator=gen)
    got = Linear(weight, pack, bias=bias)(x)
    assert torch.allclose(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bias"):
        Linear(weight, pack, bias=bias[:-1])
