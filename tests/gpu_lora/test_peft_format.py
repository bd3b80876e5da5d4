"""PEFT adapter loading: exact agreement with the peft library, and one test per rejection."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from toppings.gpu_lora.peft.adapter import AdapterError, load_peft_adapter, read_adapter_config
from toppings.gpu_lora.peft.config import MAX_WEIGHTS_BYTES
from toppings.gpu_lora.peft.tensors import abs_max, is_all_finite
from toppings.server.model.config import LORA_TARGETS, ModelConfig

HF_CONFIG = LlamaConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)
MODEL = ModelConfig.from_hf(HF_CONFIG, "tiny")
Q_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"


def save_adapter(out: Path, seed: int = 0, **lora_kwargs) -> dict:
    """Save a PEFT adapter of a new tiny Llama; return PEFT's {(layer, module): (A, B, scale)}."""
    torch.manual_seed(seed)
    base = LlamaForCausalLM(HF_CONFIG)
    lora_kwargs.setdefault("lora_alpha", 16)
    peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
    peft_model.save_pretrained(out)
    expected = {}
    for i, layer in enumerate(peft_model.base_model.model.model.layers):
        for module in LORA_TARGETS:
            parent = (
                layer.self_attn if module in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp
            )
            proj = getattr(parent, module)
            if hasattr(proj, "lora_A"):
                a, b = proj.lora_A["default"].weight, proj.lora_B["default"].weight
                expected[(i, module)] = (a.detach(), b.detach(), proj.scaling["default"])
    return expected


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(r=4, target_modules=["q_proj", "v_proj"]),
        dict(r=8, target_modules="all-linear", use_rslora=True),
        dict(r=3, lora_alpha=5, target_modules=r".*\.1\.mlp\.(up|down)_proj"),
        dict(r=2, target_modules=["k_proj", "o_proj"], layers_to_transform=[1]),
        dict(r=4, target_modules="all-linear", exclude_modules=["k_proj", "gate_proj"]),
        dict(
            r=2,
            target_modules=["model.layers.0.self_attn.q_proj", "v_proj"],
            layers_to_transform=[1],
        ),  # fmt: skip
    ],
    ids=["qv", "all-linear-rslora", "regex", "layers_to_transform", "exclude", "full-name-layers"],
)
def test_matches_peft(tmp_path: Path, kwargs: dict) -> None:
    expected = save_adapter(tmp_path / "ad", **kwargs)
    adapter = load_peft_adapter(tmp_path / "ad", MODEL)
    assert adapter.name == "ad" and adapter.rank == kwargs["r"]
    assert set(adapter.weights) == set(expected)
    assert adapter.target_modules == tuple(m for m in LORA_TARGETS if m in {m for _, m in expected})
    for pair, (a_ref, b_ref, scale_ref) in expected.items():
        a, b = adapter.weights[pair]
        # B over a contiguous B^T: the pool's rows and the host kernel read it as it lies
        assert a.dtype == torch.float32 and a.is_contiguous() and b.T.is_contiguous()
        assert torch.equal(a, a_ref) and torch.equal(b, b_ref)
        assert adapter.scale == pytest.approx(scale_ref)
        # what the read kept for the overflow check: each tensor's largest magnitude
        assert adapter.weight_bounds[pair] == (a.abs().max().item(), b.abs().max().item())
    want_scale = adapter.alpha / (
        math.sqrt(adapter.rank) if kwargs.get("use_rslora") else adapter.rank
    )
    assert adapter.scale == pytest.approx(want_scale)
    numel = sum(a.numel() + b.numel() for a, b in adapter.weights.values())
    assert adapter.num_bytes == 4 * numel
    assert adapter.bytes_at(torch.bfloat16) == 2 * numel
    assert read_adapter_config(tmp_path / "ad")["r"] == kwargs["r"]


def test_held_at_bfloat16_as_every_copy_of_a_bfloat16_engine(tmp_path: Path) -> None:
    """dtype=bfloat16 holds A and B as a bfloat16 engine's device rows and workers' arena get
    them (PEFT's float32 weights rounded once), charged their own bytes; a DoRA adapter stays
    float32 (its scales are computed from it); no other dtype is taken."""
    expected = save_adapter(tmp_path / "ad", r=4, target_modules="all-linear")
    wide = load_peft_adapter(tmp_path / "ad", MODEL)
    held = load_peft_adapter(tmp_path / "ad", MODEL, dtype=torch.bfloat16)
    for pair, (a_ref, b_ref, _) in expected.items():
        a, b = held.weights[pair]
        assert a.dtype == b.dtype == torch.bfloat16
        assert torch.equal(a, a_ref.to(torch.bfloat16)) and torch.equal(b, b_ref.to(torch.bfloat16))
        assert held.weight_bounds[pair] == (a.abs().max().item(), b.abs().max().item())
    assert held.num_bytes * 2 == wide.num_bytes
    assert held.bytes_at(torch.bfloat16) == wide.bytes_at(torch.bfloat16) == held.num_bytes
    assert held.bytes_at(torch.float32) == wide.num_bytes
    save_adapter(tmp_path / "dora", r=4, target_modules=["q_proj", "v_proj"], use_dora=True)
    dora = load_peft_adapter(tmp_path / "dora", MODEL, dtype=torch.bfloat16)
    assert {t.dtype for pair in dora.weights.values() for t in pair} == {torch.float32}
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        load_peft_adapter(tmp_path / "ad", MODEL, dtype=torch.float16)


@pytest.fixture(scope="module")
def good_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("good") / "qv"
    save_adapter(out, r=4, target_modules=["q_proj", "v_proj"])
    return out


@pytest.fixture
def adapter_dir(tmp_path: Path, good_adapter: Path) -> Path:
    """A private copy of a valid q/v adapter (r=4) to break."""
    return Path(shutil.copytree(good_adapter, tmp_path / "broken"))


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            cfg.pop(key)
        else:
            cfg[key] = value
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def edit_tensors(path: Path, fn) -> None:
    tensors = load_file(path / "adapter_model.safetensors")
    save_file(fn(tensors), path / "adapter_model.safetensors")


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_a_bias_setting_loads_unless_biases_were_trained(adapter_dir: Path, bias: str) -> None:
    """PEFT's bias "all" / "lora_only" on a base without biases (Llama) saves none: the adapter
    is a plain LoRA. One that saved a trained bias is refused, naming it."""
    edit_config(adapter_dir, bias=bias)
    load_peft_adapter(adapter_dir, MODEL)
    name = "base_model.model.model.layers.0.self_attn.q_proj.bias"
    edit_tensors(adapter_dir, lambda t: {**t, name: torch.zeros(MODEL.hidden_size)})
    with pytest.raises(AdapterError, match="is a trained bias, which is not supported"):
        load_peft_adapter(adapter_dir, MODEL)


def test_default_adapter_name_in_keys_is_accepted(adapter_dir: Path) -> None:
    edit_tensors(
        adapter_dir, lambda t: {k.replace(".weight", ".default.weight"): v for k, v in t.items()}
    )
    assert len(load_peft_adapter(adapter_dir, MODEL, name="x").weights) == 4


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(peft_type="LOHA"), "peft_type"),
        (dict(r=0), "r must be a positive integer"),
        (dict(r="4"), "r must be a positive integer"),
        (dict(lora_alpha=...), "lora_alpha must be a number"),
        (dict(lora_alpha="big"), "lora_alpha must be a number"),
        (dict(target_modules=["q_proj", "lm_head"]), "lm_head"),
        (dict(target_modules=["q_proj", "foo_proj"]), "'foo_proj'"),
        (dict(target_modules=".*lm_head"), "lm_head"),
        (dict(target_modules=["model.layers.5.self_attn.q_proj"]), "of this 2-layer model"),
        (dict(target_modules=r".*\.self_attn\.nothing"), "selects no projection"),
        (dict(target_modules="(unclosed"), "regex"),
        (dict(target_modules=[]), "target_modules is empty"),
        (dict(use_dora=True), "use_dora is set but the DoRA magnitude"),
        (dict(alora_invocation_tokens=[]), "alora_invocation_tokens must be a non-empty list"),
        (dict(alora_invocation_tokens=[3, -1]), "alora_invocation_tokens must be"),
        (dict(alora_invocation_tokens=[3], use_dora=True), "activated LoRA with DoRA"),
        (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
        *[
            (dict(init_lora_weights=v), f"init_lora_weights='{v}' changes the base model's weights")
            for v in ("pissa", "pissa_niter_4", "olora", "corda", "loftq", "lora_ga")
        ],  # fmt: skip
        (dict(alpha_pattern={"q_proj": 8}), "alpha_pattern"),
        (dict(bias="sometimes"), "bias='sometimes' is not a PEFT bias setting"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(fan_in_fan_out=True), "fan_in_fan_out"),
        (dict(layers_to_transform=[5]), "layers_to_transform names layer 5"),
        (dict(layers_to_transform=["0"]), "layers_to_transform must be"),
        (dict(layers_pattern="blocks"), "layers_pattern"),
        (dict(layers_to_transform=[0]), "layers.1.self_attn.q_proj, which target_modules"),
        (dict(target_modules=["q_proj"]), "v_proj, which target_modules does not select"),
        (
            dict(target_modules=["q_proj", "v_proj", "k_proj"]),
            "lora_A of model.layers.0.self_attn.k_proj is missing",
        ),
    ],
)
def test_config_rejections(adapter_dir: Path, changes: dict, message: str) -> None:
    edit_config(adapter_dir, **changes)
    with pytest.raises(AdapterError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_peft_adapter(adapter_dir, MODEL)


@pytest.mark.parametrize("init", [True, False, "gaussian", "orthogonal", "eva", "mica"])
def test_inits_that_leave_the_base_alone_load(adapter_dir: Path, init) -> None:
    """Only the adapter's own starting values differ: what it saved is a plain LoRA."""
    edit_config(adapter_dir, init_lora_weights=init)
    load_peft_adapter(adapter_dir, MODEL)


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"peft_type": "LORA", "pad": "' + "x" * (1 << 20) + '"}', "larger than 1048576 bytes"),
        ("[" * 200_000 + "]" * 200_000, "nests its JSON too deeply"),
    ],
    ids=["over-1-MiB", "200000-deep"],
)
def test_a_huge_or_deeply_nested_config_is_refused_unparsed(adapter_dir, text, message) -> None:
    (adapter_dir / "adapter_config.json").write_text(text)
    with pytest.raises(AdapterError, match=message):
        read_adapter_config(adapter_dir)


@pytest.mark.parametrize(
    "fn, message",
    [
        (
            lambda t: {**t, "lm_head.lora_A.weight": torch.zeros(4, 64)},
            "unexpected tensor 'lm_head",
        ),
        (
            lambda t: {**t, Q_KEY.format("A").replace("layers.0", "layers.7"): torch.zeros(4, 64)},
            "layer 7, but the base model has 2 layers",
        ),
        (
            lambda t: {k: v for k, v in t.items() if k != Q_KEY.format("B")},
            "lora_B of .*q_proj is missing",
        ),
        (
            lambda t: {**t, Q_KEY.format("A"): torch.zeros(4, 32)},
            r"shape \[4, 32\], expected \[4, 64\]",
        ),
        (
            lambda t: {**t, Q_KEY.format("B"): torch.full((64, 4), float("nan"))},
            "lora_B.weight' holds NaN",
        ),
        (lambda t: {**t, Q_KEY.format("A"): torch.zeros(4, 64, dtype=torch.int32)}, "dtype"),
        (
            lambda t: {**t, Q_KEY.format("A").replace("self_attn", "mlp"): torch.zeros(4, 64)},
            "unknown module mlp.q_proj",
        ),
    ],
    ids=[
        "junk-key",
        "layer-out-of-range",
        "missing-partner",
        "shape",
        "nan",
        "int",
        "wrong-parent",
    ],
)
def test_tensor_rejections(adapter_dir: Path, fn, message: str) -> None:
    edit_tensors(adapter_dir, fn)
    with pytest.raises(AdapterError, match=message):
        load_peft_adapter(adapter_dir, MODEL)


def test_other_base_model_is_rejected_by_shape(adapter_dir: Path) -> None:
    wider = dataclasses.replace(MODEL, name="wide", hidden_size=96, head_dim=24)
    with pytest.raises(
        AdapterError, match=r"lora_A.weight' has shape \[4, 64\], expected \[4, 96\]"
    ):
        load_peft_adapter(adapter_dir, wider)


def test_file_level_rejections(tmp_path: Path, adapter_dir: Path) -> None:
    with pytest.raises(AdapterError, match="does not exist"):
        load_peft_adapter(tmp_path / "nope", MODEL)
    (tmp_path / "file").write_text("x")
    with pytest.raises(AdapterError, match="is not a directory"):
        load_peft_adapter(tmp_path / "file", MODEL)

    weights = adapter_dir / "adapter_model.safetensors"
    weights.write_bytes(b"\x00garbage")
    with pytest.raises(AdapterError, match="not a readable safetensors file"):
        load_peft_adapter(adapter_dir, MODEL)
    weights.unlink()
    with pytest.raises(AdapterError, match="adapter_model.safetensors missing"):
        load_peft_adapter(adapter_dir, MODEL)
    # Content that would run code if unpickled: the loader must refuse before touching it.
    (adapter_dir / "adapter_model.bin").write_bytes(b"cos\nsystem\n(S'exit 1'\ntR.")
    with pytest.raises(AdapterError, match="safetensors only"):
        load_peft_adapter(adapter_dir, MODEL)

    (adapter_dir / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        read_adapter_config(adapter_dir)
    (adapter_dir / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="adapter_config.json missing"):
        read_adapter_config(adapter_dir)


def test_a_weights_file_over_its_cap_is_refused_unread(adapter_dir: Path) -> None:
    """A valid adapter followed by (sparse) bytes past MAX_WEIGHTS_BYTES: refused on the opened
    file's size, before its bytes are read into memory."""
    with open(adapter_dir / "adapter_model.safetensors", "r+b") as f:
        f.truncate(MAX_WEIGHTS_BYTES + 1)
    with pytest.raises(AdapterError, match=f"larger than {MAX_WEIGHTS_BYTES} bytes"):
        load_peft_adapter(adapter_dir, MODEL)


def test_all_linear_shorthand_in_config(tmp_path: Path) -> None:
    # save_pretrained writes the expanded list; a hand-written config may keep the shorthand.
    expected = save_adapter(tmp_path / "ad", r=2, target_modules="all-linear")
    edit_config(tmp_path / "ad", target_modules="all-linear")
    adapter = load_peft_adapter(tmp_path / "ad", MODEL)
    assert set(adapter.weights) == set(expected) and adapter.target_modules == LORA_TARGETS


def test_is_all_finite_matches_isfinite_all():
    """The one reduction that checks a tensor (`abs_max`) is exact: a NaN, either infinity or
    both, and the largest finite float32 values, against `isfinite(t).all()`; its bound is
    `t.abs().max()`; the same over transposed and strided views."""
    big = torch.finfo(torch.float32).max
    cases = [torch.randn(64, 576), torch.full((4096,), big), torch.full((4096,), -big)]
    for bad in (math.nan, math.inf, -math.inf):
        t = torch.randn(64, 576)
        t[17, 300] = bad
        cases.append(t)
    both = torch.zeros(8)
    both[0], both[1] = math.inf, -math.inf
    cases.append(both)
    # B is held as the transpose of a contiguous B^T (reduced as B^T); a strided view as it is
    cases += [t.T for t in cases if t.dim() == 2] + [cases[3][:, ::3], cases[0][::2]]
    for t in cases:
        assert is_all_finite(t) == bool(torch.isfinite(t).all())
        want = t.abs().max().item()
        got = abs_max(t)
        assert got == want or (math.isnan(got) and math.isnan(want))
    peak = torch.randn(64, 576)
    peak[3, 4] = -7.5  # the largest magnitude negative
    assert abs_max(peak) == 7.5
