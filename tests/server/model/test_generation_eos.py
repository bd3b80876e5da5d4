"""Stop tokens from generation_config.json: chat checkpoints list their end-of-turn token there
(Llama 3's <|eot_id|>, Qwen's <|im_end|>), beside config.json's eos_token_id."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers import running_engine
from toppings.server.model.loader import CheckpointError, generation_eos_ids, load_checkpoint
from toppings.server.requests.request import GenerationRequest, SamplingParams

PROMPT = [5, 17, 42, 9, 3]


def generate(model_dir, max_new: int, ignore_eos: bool):
    with running_engine(model_dir, max_total_tokens=512) as engine:
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=ignore_eos)
        return engine.submit(GenerationRequest(PROMPT, params)).result(60)


def test_a_generation_stops_at_the_second_eos_id_of_generation_config(tiny_model_dir, tmp_path):
    free_run = generate(tiny_model_dir, 8, ignore_eos=True).new_token_ids
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "eot")
    config_eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    assert config_eos not in free_run[:3]  # the tiny model's config eos does not end it early
    # The first token after the first that has not come before: the run stops right there.
    stop_at = next(i for i in range(1, 3) if free_run[i] not in free_run[:i])
    (model_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [config_eos, free_run[stop_at]]})
    )
    assert load_checkpoint(str(model_dir)).generation_eos_ids == (config_eos, free_run[stop_at])
    out = generate(model_dir, 8, ignore_eos=False)
    assert out.finish_reason == "stop"
    assert out.new_token_ids == free_run[: stop_at + 1]


@pytest.mark.parametrize(
    "text, ids", [("{}", ()), ('{"eos_token_id": 7}', (7,)), ('{"eos_token_id": [1, 2]}', (1, 2))]
)
def test_eos_token_id_may_be_an_int_or_a_list(tmp_path, text, ids):
    (tmp_path / "generation_config.json").write_text(text)
    assert generation_eos_ids(tmp_path) == ids


@pytest.mark.parametrize("text", ["[1]", '{"eos_token_id": "x"}', '{"eos_token_id": [-1]}'])
def test_a_bad_generation_config_is_one_line(tmp_path, text):
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(CheckpointError, match="generation_config.json"):
        generation_eos_ids(tmp_path)
