"""Every adapter field bounded at load (issue 67): activated-LoRA invocation tokens within the
base model's vocabulary and at most MAX_INVOCATION_TOKENS of them, DoRA magnitudes finite and
of the base projection's width, and an error that echoes a list from the adapter's files short
(a 100,000-id list made each 400 about it 689 KB). Over HTTP, a bad adapter is a 400 naming the
field and the server keeps serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.gpu_lora.test_peft_format import MODEL, edit_config, save_adapter
from toppings.gpu_lora.brief import MAX_SHOWN_ITEMS
from toppings.gpu_lora.peft.adapter import AdapterError, inspect_peft_adapter, load_peft_adapter
from toppings.gpu_lora.peft.config import MAX_INVOCATION_TOKENS

SHORT = 400  # characters: a message naming the field and a few values, never the whole list


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bounds")
    save_adapter(root / "plain", r=4, target_modules=["q_proj", "v_proj"])
    save_adapter(root / "dora", r=4, target_modules=["q_proj", "v_proj"], use_dora=True)
    return {"plain": root / "plain", "dora": root / "dora"}


@pytest.fixture
def copy(tmp_path: Path, saved: dict[str, Path]):
    return lambda kind: Path(shutil.copytree(saved[kind], tmp_path / kind))


def _refused(path: Path) -> str:
    """The AdapterError message of loading `path`; the header-only inspection refuses it too."""
    with pytest.raises(AdapterError) as caught:
        inspect_peft_adapter(path, MODEL)
    with pytest.raises(AdapterError) as loaded:
        load_peft_adapter(path, MODEL)
    assert str(caught.value) == str(loaded.value)
    return str(loaded.value)


def test_invocation_tokens_past_the_vocabulary_are_refused(copy):
    path = copy("plain")
    edit_config(path, alora_invocation_tokens=[5, MODEL.vocab_size - 1, MODEL.vocab_size, 10**9])
    message = _refused(path)
    assert "alora_invocation_tokens" in message and f"token id {MODEL.vocab_size}," in message
    assert f"vocabulary of {MODEL.vocab_size} ids" in message and "(2 such ids" in message
    edit_config(path, alora_invocation_tokens=[5, MODEL.vocab_size - 1])
    assert load_peft_adapter(path, MODEL).invocation_tokens == (5, MODEL.vocab_size - 1)


@pytest.mark.parametrize("num_tokens", [MAX_INVOCATION_TOKENS + 1, 100_000])
def test_too_many_invocation_tokens_are_refused_in_a_short_message(copy, num_tokens):
    path = copy("plain")
    edit_config(path, alora_invocation_tokens=[i % MODEL.vocab_size for i in range(num_tokens)])
    message = _refused(path)
    assert f"holds {num_tokens} token ids; at most {MAX_INVOCATION_TOKENS}" in message
    assert len(message) < SHORT
    edit_config(path, alora_invocation_tokens=[3] * MAX_INVOCATION_TOKENS)
    assert len(load_peft_adapter(path, MODEL).invocation_tokens) == MAX_INVOCATION_TOKENS


@pytest.mark.parametrize(
    "field, value",
    [
        ("alora_invocation_tokens", [7] * 99_999 + [-1]),
        ("layers_to_transform", ["0"] * 100_000),
        ("target_modules", "q_proj" * 100_000),
        ("rank_pattern", {f"m{i}": 8 for i in range(10_000)}),
    ],
    ids=["invocation", "layers", "regex", "rank_pattern"],
)
def test_an_error_echoing_a_field_is_short(copy, field, value):
    path = copy("plain")
    edit_config(path, **{field: value})
    message = _refused(path)
    assert field in message and len(message) < SHORT
    if isinstance(value, list):
        assert f"({len(value)} in all)" in message
        shown = message.rsplit("got ", 1)[-1]  # after the path, which may hold the same digits
        assert shown.count(repr(value[0])) == MAX_SHOWN_ITEMS


def _edit_magnitudes(path: Path, fn) -> None:
    tensors = load_file(path / "adapter_model.safetensors")
    tensors = {k: fn(v) if "magnitude" in k else v for k, v in tensors.items()}
    save_file(tensors, path / "adapter_model.safetensors")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m: torch.full_like(m, float("nan")), "holds NaN or inf"),
        (lambda m: m.clone().index_fill_(0, torch.tensor([1]), float("inf")), "holds NaN or inf"),
        (lambda m: m[:-1].clone(), "expected [64] (the out_features"),
        (lambda m: m.repeat(2, 1), "expected [64] (the out_features"),
        (lambda m: m.to(torch.int32), "has dtype torch.int32"),
    ],
    ids=["nan", "inf", "short", "2d", "int"],
)
def test_a_bad_dora_magnitude_is_refused(copy, change, message):
    path = copy("dora")
    assert load_peft_adapter(path, MODEL).is_dora
    _edit_magnitudes(path, change)
    with pytest.raises(AdapterError) as caught:
        load_peft_adapter(path, MODEL)
    assert "lora_magnitude_vector" in str(caught.value) and message in str(caught.value)


def test_bad_adapters_over_http_are_400s_naming_the_field(tiny_engine, tiny_model_dir, tmp_path):
    """POST /v1/load_lora_adapter of an adapter whose invocation tokens are past the tiny
    model's vocabulary or too many: a 400 naming the field in a short body. A valid activated
    LoRA of MAX_INVOCATION_TOKENS ids loads, and a prompt without them is a short 400."""
    from toppings.scripts.make_adapters import make_random_adapter
    from toppings.server.api.app import create_app
    from toppings.server.api.options import ApiOptions

    good = make_random_adapter(tmp_path / "good", tiny_model_dir, rank=4, seed=1)
    config = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    vocab = config["vocab_size"]
    cases = {
        "past": [3, vocab],
        "many": [3] * (MAX_INVOCATION_TOKENS + 1),
        "long": [(5 + i) % vocab for i in range(MAX_INVOCATION_TOKENS)],
    }
    for name, tokens in cases.items():
        path = Path(shutil.copytree(good, tmp_path / name))
        edit_config(path, alora_invocation_tokens=tokens)
    with tiny_engine() as engine:
        client = create_app(engine, ApiOptions(lora_roots=(str(tmp_path),))).test_client()
        for name, needle in [("past", f"token id {vocab},"), ("many", "at most")]:
            body = {"lora_name": name, "lora_path": str(tmp_path / name)}
            reply = client.post("/v1/load_lora_adapter", json=body)
            assert reply.status_code == 400 and len(reply.get_data()) < SHORT + 100
            message = reply.get_json()["error"]["message"]
            assert "alora_invocation_tokens" in message and needle in message
        body = {"lora_name": "long", "lora_path": str(tmp_path / "long")}
        assert client.post("/v1/load_lora_adapter", json=body).status_code == 200
        reply = client.post("/generate", json={"adapter": "long", "input_ids": [1, 2, 3],
                                               "max_new_tokens": 1})  # fmt: skip
        assert reply.status_code == 400 and len(reply.get_data()) < SHORT + 100
        message = reply.get_json()["error"]["message"]
        assert "alora_invocation_tokens" in message
        assert f"({MAX_INVOCATION_TOKENS} in all)" in message


def test_a_bad_adapter_given_at_start_names_the_field(tiny_model_dir, tmp_path):
    """`--lora NAME=PATH` reads the adapter as the engine is built: the same AdapterError."""
    from tests.helpers import running_engine
    from toppings.scripts.make_adapters import make_random_adapter

    path = make_random_adapter(tmp_path / "bad", tiny_model_dir, rank=4, seed=1)
    edit_config(path, alora_invocation_tokens=list(range(100_000)))
    with pytest.raises(AdapterError) as caught:
        with running_engine(tiny_model_dir, {"bad": str(path)}):
            pass
    assert "alora_invocation_tokens" in str(caught.value) and len(str(caught.value)) < SHORT
