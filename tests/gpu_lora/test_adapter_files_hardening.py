"""Untrusted adapter directories: regex target_modules that backtrack catastrophically or are too
long, and adapter files that are symlinks or not regular files; each one an AdapterError."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.gpu_lora.test_peft_format import MODEL, save_adapter
from toppings.gpu_lora.peft.adapter import AdapterError, load_peft_adapter, read_adapter_config
from toppings.gpu_lora.peft.config import MAX_PATTERN_CHARS, resolve_targets

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# Backtracks exponentially in the length of the name before "q_proj": Python's `re` needs about
# 0.27 s for a 16-character prefix and four times that for every two more characters, so the
# 25-character prefix of a self-attention projection takes minutes per name.
CATASTROPHIC = r"(.*?)*q_projx?y"


@pytest.fixture
def adapter(tmp_path: Path) -> Path:
    save_adapter(tmp_path / "ad", r=4, target_modules=["q_proj", "v_proj"])
    return tmp_path / "ad"


def _set_config(directory: Path, **fields) -> None:
    cfg = json.loads((directory / CONFIG).read_text())
    (directory / CONFIG).write_text(json.dumps(cfg | fields))


def test_a_catastrophic_target_regex_fails_the_load_naming_the_field(adapter: Path) -> None:
    _set_config(adapter, target_modules=CATASTROPHIC)
    with pytest.raises(AdapterError, match="target_modules regex .* takes too long"):
        load_peft_adapter(adapter, MODEL)


def test_a_catastrophic_exclude_regex_fails_naming_exclude_modules() -> None:
    cfg = {"target_modules": ["q_proj"], "exclude_modules": CATASTROPHIC}
    with pytest.raises(AdapterError, match="exclude_modules regex .* takes too long"):
        resolve_targets(cfg, MODEL, "cfg")


def test_a_regex_over_the_size_limit_is_refused_before_it_is_compiled(adapter: Path) -> None:
    # A valid pattern selecting q_proj, padded with alternatives to just over the limit.
    pattern = r".*\.(q_proj" + "|q_proj" * (MAX_PATTERN_CHARS // 7) + ")"
    assert len(pattern) > MAX_PATTERN_CHARS
    _set_config(adapter, target_modules=pattern)
    with pytest.raises(AdapterError, match=f"at most {MAX_PATTERN_CHARS}"):
        read_adapter_config(adapter)


def test_an_ordinary_regex_still_selects_what_peft_selects(adapter: Path) -> None:
    _set_config(adapter, target_modules=r"model\.layers\.\d+\.self_attn\.(q|v)_proj")
    loaded = load_peft_adapter(adapter, MODEL)
    assert loaded.target_modules == ("q_proj", "v_proj")


@pytest.mark.parametrize("name", [CONFIG, WEIGHTS])
def test_a_symlinked_adapter_file_is_refused(adapter: Path, tmp_path: Path, name: str) -> None:
    # Even one pointing at an intact copy: what a symlink points to can change after any check.
    copy = tmp_path / f"copy-{name}"
    (adapter / name).rename(copy)
    os.symlink(copy, adapter / name)
    with pytest.raises(AdapterError, match=f"{name} is a symlink"):
        load_peft_adapter(adapter, MODEL)


def test_a_fifo_in_place_of_the_config_is_refused_without_waiting(adapter: Path) -> None:
    (adapter / CONFIG).unlink()
    os.mkfifo(adapter / CONFIG)  # an open for reading would wait for a writer forever
    with pytest.raises(AdapterError, match=f"{CONFIG} is not a regular file"):
        read_adapter_config(adapter)


def test_a_directory_in_place_of_the_weights_is_refused(adapter: Path) -> None:
    (adapter / WEIGHTS).unlink()
    (adapter / WEIGHTS).mkdir()
    with pytest.raises(AdapterError, match=f"{WEIGHTS} is not a regular file"):
        load_peft_adapter(adapter, MODEL)
