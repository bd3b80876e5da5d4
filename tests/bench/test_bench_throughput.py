"""bench_throughput on a dummy-weight checkpoint: transformers + PEFT hold the very tensors our
engine draws, so both generate the same tokens, and the driver writes every headline."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest
import torch

from bench import bench_throughput
from bench.hf_peft_peer import attach_adapters, load_base
from bench.roofline import decode_step_bytes
from bench.throughput_peer import generate
from bench.throughput_workload import DUMMY_TARGETS, Model, make_workload
from tests.helpers import running_engine
from toppings.scripts.make_adapters import base_from_config
from toppings.scripts.make_dummy_model import make_dummy_model
from toppings.server.config import LoadFormat
from toppings.server.model.loader import load_checkpoint
from toppings.server.requests.request import GenerationRequest, SamplingParams


def tiny_dummy(tmp_path_factory, tiny_model_dir, tied: bool):
    """The tiny Llama's config and tokenizer, no weights; lm_head tied (as Llama-3.2-1B's) or
    not."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["tie_word_embeddings"] = tied
    return make_dummy_model(tmp_path_factory.mktemp("dummy"), config, tiny_model_dir)


@pytest.fixture(scope="module")
def dummy_dir(tmp_path_factory, tiny_model_dir):
    # Untied: with tied N(0, 0.02) weights the tiny model repeats one token, whatever the adapter.
    return tiny_dummy(tmp_path_factory, tiny_model_dir, tied=False)


@pytest.mark.parametrize("tied", [False, True])
def test_the_peer_holds_the_tensors_our_engine_draws(tmp_path_factory, tiny_model_dir, tied):
    model_dir = tiny_dummy(tmp_path_factory, tiny_model_dir, tied)
    ours = load_checkpoint(str(model_dir), "dummy").weights
    peer = load_base(model_dir, torch.float32, LoadFormat.DUMMY)
    params = dict(peer.named_parameters())
    assert sorted(params) == sorted(ours)
    for name, param in params.items():
        assert torch.equal(param, ours[name]), name
    assert (peer.lm_head.weight is peer.model.embed_tokens.weight) == tied


def test_base_from_config_refuses_weights_of_another_model(dummy_dir):
    weights = dict(load_checkpoint(str(dummy_dir), "dummy").weights)
    del weights["model.norm.weight"]
    config = load_base(dummy_dir, torch.float32, LoadFormat.DUMMY).config
    with pytest.raises(ValueError, match="model.norm.weight"):
        base_from_config(config, weights, torch.float32)


def test_ours_and_the_peer_generate_the_same_tokens_with_and_without_an_adapter(
    dummy_dir, tmp_path
):
    args = Namespace(
        adapter_dir=tmp_path, num_adapters=2, dtype="float32", num_requests=2, prompt_len=12
    )
    vocab = json.loads((dummy_dir / "config.json").read_text())["vocab_size"]
    adapters, prompts, names = make_workload(
        args, Model(dummy_dir, LoadFormat.DUMMY), vocab, DUMMY_TARGETS
    )
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    with running_engine(dummy_dir, adapters, max_total_tokens=512, load_format="dummy") as engine:
        ours = {
            name: engine.submit(
                GenerationRequest(prompts[0], params, engine.resolve_adapter(name))
            ).result(60)
            for name in (None, names[0])
        }
    peer = attach_adapters(load_base(dummy_dir, torch.float32, LoadFormat.DUMMY), adapters)
    with peer.disable_adapter():
        theirs_base = generate(peer, [prompts[0]], None, 8)[0].tolist()
    theirs_adapter = generate(peer, [prompts[0]], [names[0]], 8)[0].tolist()
    assert list(ours[None].new_token_ids) == theirs_base
    assert list(ours[names[0]].new_token_ids) == theirs_adapter
    assert theirs_adapter != theirs_base  # the adapter (q, k, v and o) changes the tokens


def test_a_quick_run_writes_every_headline(dummy_dir, tmp_path):
    out = tmp_path / "result.json"
    bench_throughput.main(
        ["--dummy", str(dummy_dir), "--quick", "--num-adapters", "4", "--threads", "1",
         "--adapter-dir", str(tmp_path / "adapters"), "--out", str(out)]
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["config"]["load_format"] == "dummy"
    assert result["config"]["targets"] == list(DUMMY_TARGETS)
    metrics = result["metrics"]
    for key in ("tokens_per_s", "ratio_vs_hf_peft", "roofline_fraction",
                "decode_step_ratio_lora_vs_base", "ttft_ms_single", "tpot_ms_single"):  # fmt: skip
        assert metrics[key] > 0, key
    assert set(metrics["roofline"]["decode_step_bytes"]) == {"weights", "kv", "adapters"}
    for label in ("base", "adapter"):
        assert metrics["single"]["transformers"][label]["tpot_ms"] > 0
        assert metrics["agreement"][label]["fraction"] == 1.0  # float32, the same weights
        assert len(metrics["agreement"][label]["ours"]) == 8


@pytest.mark.parametrize("tied", [False, True])
def test_a_decode_step_reads_every_weight_once_and_only_batch_rows_of_the_embedding(
    tmp_path_factory, tiny_model_dir, tied
):
    checkpoint = load_checkpoint(str(tiny_dummy(tmp_path_factory, tiny_model_dir, tied)), "dummy")
    cfg, weights = checkpoint.config, checkpoint.weights
    embedding = weights["model.embed_tokens.weight"].numel()
    every_weight = sum(weights[name].numel() for name in weights)
    read = every_weight if tied else every_weight - embedding  # a tied lm_head is the embedding
    batch, context = 3, 10.0
    step = decode_step_bytes(cfg, 2, batch, context, [8, 16], ["q_proj", "o_proj"])
    assert step["weights"] == 2 * (read + batch * cfg.hidden_size)
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
    assert step["kv"] == 2 * batch * context * kv_per_token
    q_in, q_out = cfg.projection_shape("q_proj")
    o_in, o_out = cfg.projection_shape("o_proj")
    assert step["adapters"] == 2 * cfg.num_layers * (8 + 16) * (q_in + q_out + o_in + o_out)
