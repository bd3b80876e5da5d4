"""Safetensors shards: a checkpoint split by `save_pretrained(max_shard_size=...)` loads and
generates what the single file does; a missing shard, a shard lacking a tensor its index
names, or a broken index is one CheckpointError line naming the file, raised before any model
is built."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import running_engine
from toppings.server.config import EngineConfig
from toppings.server.model.loader import CheckpointError, load_checkpoint
from toppings.server.model.weights import INDEX_FILE
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny Llama saved again in at least three shards, with its tokenizer."""
    from transformers import LlamaForCausalLM

    out = tmp_path_factory.mktemp("sharded")
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.save_pretrained(out, max_shard_size="150KB", safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tiny_model_dir / name).is_file():
            shutil.copyfile(tiny_model_dir / name, out / name)
    return out


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def shards(model_dir: Path) -> list[str]:
    return sorted(set(json.loads((model_dir / INDEX_FILE).read_text())["weight_map"].values()))


def greedy(model_dir: Path, prompt: list[int], max_new: int) -> list[int]:
    with running_engine(model_dir, max_total_tokens=512) as engine:
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
        return engine.submit(GenerationRequest(prompt, params)).result(60).new_token_ids


def test_shards_hold_the_same_tensors_and_generate_the_same_tokens(sharded_dir, tiny_model_dir):
    assert len(shards(sharded_dir)) >= 3
    assert not (sharded_dir / "model.safetensors").exists()
    single, split = load_checkpoint(str(tiny_model_dir)), load_checkpoint(str(sharded_dir))
    assert sorted(single.weights) == sorted(split.weights)
    for name in single.weights:
        assert torch.equal(single.weights[name], split.weights[name]), name
    prompt = [5, 17, 42, 9, 3]
    assert greedy(sharded_dir, prompt, 8) == greedy(tiny_model_dir, prompt, 8)


def assert_one_line(error: pytest.ExceptionInfo, *words: str) -> None:
    message = str(error.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message


def test_a_missing_shard_is_one_line_naming_it(sharded_dir, tmp_path):
    broken = copy_of(sharded_dir, tmp_path / "broken")
    gone = shards(broken)[1]
    (broken / gone).unlink()
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(str(broken))
    assert_one_line(error, "missing shard", gone)
    with pytest.raises(CheckpointError):  # the engine is never built
        build_engine(str(broken), EngineConfig(dtype="float32", max_total_tokens=512))


def test_a_shard_without_a_tensor_its_index_names(sharded_dir, tmp_path):
    broken = copy_of(sharded_dir, tmp_path / "broken")
    index = json.loads((broken / INDEX_FILE).read_text())
    shard = shards(broken)[0]
    index["weight_map"]["model.layers.0.self_attn.q_proj.bias"] = shard
    (broken / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(str(broken))
    assert_one_line(error, shard, "model.layers.0.self_attn.q_proj.bias")


@pytest.mark.parametrize(
    "index_text",
    ["{not json", '{"metadata": {}}', '{"weight_map": {"a": 5}}',
     '{"weight_map": {"a": "../elsewhere.safetensors"}}'],
    ids=str,
)  # fmt: skip
def test_a_broken_index_is_one_line(sharded_dir, tmp_path, index_text):
    broken = copy_of(sharded_dir, tmp_path / "broken")
    (broken / INDEX_FILE).write_text(index_text)
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(str(broken))
    assert_one_line(error, INDEX_FILE)


def test_the_cli_refuses_a_missing_shard_in_one_line(sharded_dir, tmp_path):
    from tests.server.api.test_cli_errors import assert_refused, run

    broken = copy_of(sharded_dir, tmp_path / "broken")
    gone = shards(broken)[0]
    (broken / gone).unlink()
    result = run("toppings-serve", "--model", str(broken), "--port", "0")
    assert_refused(result, "toppings-serve", "missing shard", gone)


def test_a_tensor_read_is_the_model_s_own_memory(sharded_dir, tmp_path):
    """A shard rewritten in place while the server runs does not change the weights it read."""
    model_dir = copy_of(sharded_dir, tmp_path / "rewritten")
    weights = load_checkpoint(str(model_dir)).weights
    name = "model.embed_tokens.weight"
    tensor = weights[name]
    before = tensor.clone()
    shard = model_dir / weights.files[name]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:  # keep the header, zero every byte of data
        header = 8 + int.from_bytes(f.read(8), "little")
        f.seek(header)
        f.write(bytes(size - header))
    assert torch.equal(tensor, before)
