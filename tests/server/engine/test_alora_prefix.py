"""Activated LoRA shares the base model's KV through the prefix tree.

An activated request's full blocks wholly before its activation are the base model's KV: they
are matched and cached under the base model, so a base request and any activated adapter reuse
each other's prefix (and two activated adapters each other's base part). The block holding the
activation and everything after it were computed with the adapter and are never cached: no base
request, other adapter, or later activation finds them. Checked through the HTTP API
(`usage.prompt_tokens_details.cached_tokens`), by the prompt tokens each step computed, and
against transformers + PEFT's own aLoRA forward (greedy tokens) for both kernels and every LoRA
mode.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tests.helpers import assert_memory_balanced, running_engine
from tests.server.engine.test_alora_exactness import (
    INVOKE,
    MARGIN,
    llama,  # noqa: F401 (the module's fixture)
    noise,
    reference,
    slow_link,
)
from toppings.server.api.app import create_app

BLOCK = 16  # the engine's default block_tokens
NEW_TOKENS = 4


class Recorder:
    """Wraps the engine's model runner: per prompt, the prompt tokens its steps computed and the
    tokens it sampled."""

    def __init__(self, engine, monkeypatch):
        self.computed: dict[tuple[int, ...], int] = defaultdict(int)
        self.tokens: dict[tuple[int, ...], list[int]] = defaultdict(list)
        run = engine.runner.run

        def recording(plan):
            outcome = run(plan)
            for seq, start, n in zip(plan.seqs, plan.starts, plan.tokens):
                if start < seq.prompt_len:
                    self.computed[tuple(seq.request.prompt_ids)] += n
            for seq, token in zip(outcome.plan.sampled, outcome.result.tokens):
                self.tokens[tuple(seq.request.prompt_ids)].append(token)
            return outcome

        monkeypatch.setattr(engine.runner, "run", recording)


def complete(client, prompt: list[int], model: str) -> dict:
    """A greedy /v1/completions call; returns its usage."""
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.get_data(as_text=True)
    return reply.get_json()["usage"]


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def assert_greedy_as_peft(llama_dirs, prompt: list[int], new_ids: list[int], name) -> None:
    """Our greedy tokens are PEFT's argmax at every generated position (or a near tie)."""
    model_dir, adapters = llama_dirs
    assert len(new_ids) == NEW_TOKENS
    ids = prompt + new_ids
    logits = reference(model_dir, adapters, prompt, ids, name)
    for pos in range(len(prompt) - 1, len(ids) - 1):
        if ids[pos + 1] != int(logits[pos].argmax()):
            top2 = torch.topk(logits[pos], 2).values
            assert float(top2[0] - top2[1]) < MARGIN, (name, pos, "greedy token differs")
            break


@pytest.fixture
def served(llama, monkeypatch):  # noqa: F811
    """An engine with the prefix cache on, its HTTP client and a step recorder."""
    model_dir, adapters = llama

    def start(**config):
        cm = running_engine(model_dir, adapters, max_total_tokens=4096, max_batch_size=8,
                            prefix_cache=True, **config)  # fmt: skip
        engine = cm.__enter__()
        started.append(cm)
        return engine, create_app(engine).test_client(), Recorder(engine, monkeypatch)

    started = []
    yield start
    for cm in started:
        cm.__exit__(None, None, None)


@pytest.mark.parametrize("lora_mode", ["cached", "on-demand", "cpu-assisted"])
@pytest.mark.parametrize("kernel", ["mbgmv", "bgmv"])
def test_activated_request_reuses_the_base_requests_conversation(
    llama,  # noqa: F811
    served,
    kernel,
    lora_mode,
):
    """A base turn on a 40-token conversation caches two full blocks; the checker's prompt
    (conversation + invocation + more) reuses both, computes only the tokens after them (the
    block holding its activation included), and its greedy tokens are PEFT's aLoRA forward."""
    _, adapters = llama
    link = slow_link(adapters, 0.5) if lora_mode != "cached" else 0.0
    engine, client, steps = served(kernel=kernel, lora_mode=lora_mode, link_gbps=link)
    gen = torch.Generator().manual_seed(11)
    conversation = noise(gen, 40)
    base = complete(client, conversation, engine.model_name)
    assert cached(base) == 0
    checker = conversation + INVOKE["act5"] + noise(gen, 6)
    usage = complete(client, checker, "act5")
    assert cached(usage) == 2 * BLOCK
    assert usage["prompt_tokens"] == len(checker)
    assert steps.computed[tuple(checker)] == len(checker) - 2 * BLOCK
    if lora_mode == "cpu-assisted":
        assert engine.lora.host_stats.calls > 0, "no layer ran on the host"
    assert_greedy_as_peft(llama, conversation, steps.tokens[tuple(conversation)], None)
    assert_greedy_as_peft(llama, checker, steps.tokens[tuple(checker)], "act5")
    assert_memory_balanced(engine)


def test_base_request_reuses_an_activated_requests_base_part(llama, served):  # noqa: F811
    """The reverse order: the checker runs first; a base request with the very same prompt
    finds the blocks before the activation only, and gives the base model's tokens."""
    engine, client, steps = served()
    gen = torch.Generator().manual_seed(12)
    checker = noise(gen, 40) + INVOKE["act5"] + noise(gen, 30)  # 73 tokens, 4 full blocks
    assert cached(complete(client, checker, "act5")) == 0
    usage = complete(client, checker, engine.model_name)
    assert cached(usage) == 2 * BLOCK  # not blocks 2 and 3: the adapter computed them
    assert steps.computed[tuple(checker)] == 2 * len(checker) - 2 * BLOCK  # both requests
    tokens = steps.tokens[tuple(checker)]
    assert_greedy_as_peft(llama, checker, tokens[:NEW_TOKENS], "act5")
    assert_greedy_as_peft(llama, checker, tokens[NEW_TOKENS:], None)


def test_two_activated_adapters_share_the_base_part(llama, served):  # noqa: F811
    """Two checkers with different invocations on one conversation: the second reuses the
    first's blocks before its activation, and each gets PEFT's tokens."""
    engine, client, steps = served(kernel="bgmv")
    gen = torch.Generator().manual_seed(13)
    conversation = noise(gen, 50)
    first = conversation + INVOKE["act5"] + noise(gen, 3)
    second = conversation + INVOKE["act3"] + noise(gen, 9)
    assert cached(complete(client, first, "act5")) == 0
    assert cached(complete(client, second, "act3")) == 3 * BLOCK
    assert steps.computed[tuple(second)] == len(second) - 3 * BLOCK
    assert_greedy_as_peft(llama, first, steps.tokens[tuple(first)], "act5")
    assert_greedy_as_peft(llama, second, steps.tokens[tuple(second)], "act3")
    assert_memory_balanced(engine)


def test_the_block_holding_the_activation_is_never_shared(llama, served):  # noqa: F811
    """An activation at a block's first token and one inside a block: the tree keeps the blocks
    before it under the base model and nothing under the activated adapter, so neither the
    same adapter again, another one, nor a base request finds the adapter's blocks."""
    engine, client, steps = served()
    gen = torch.Generator().manual_seed(14)
    conversation = noise(gen, 48)  # three full blocks
    at_edge = conversation + INVOKE["act5"] + noise(gen, 20)  # activates at 48: block 3
    assert cached(complete(client, at_edge, "act5")) == 0
    assert cached(complete(client, at_edge, "act5")) == 3 * BLOCK  # again: its base part only
    assert cached(complete(client, at_edge, engine.model_name)) == 3 * BLOCK
    inside = conversation[:40] + INVOKE["act3"] + noise(gen, 30)  # activates at 40: block 2
    assert cached(complete(client, inside, "act3")) == 2 * BLOCK
    assert cached(complete(client, inside, engine.model_name)) == 2 * BLOCK
    tree = engine.memory.tree
    assert {ref.name for ref in tree.roots if ref is not None} == set()
    assert all(node.adapter is None for node in tree.nodes())
    assert_greedy_as_peft(llama, inside, steps.tokens[tuple(inside)][:NEW_TOKENS], "act3")
    assert_memory_balanced(engine)


@pytest.mark.parametrize("activated_first", [True, False])
def test_the_same_weights_as_plain_and_activated_lora_keep_their_own_kind(
    llama,  # noqa: F811
    tmp_path,
    activated_first,
):
    """One content under two names (one host copy): the activated name still needs its
    invocation and shares the base model's KV, the plain one applies everywhere, whichever was
    registered first."""
    import json
    import shutil

    from toppings.server.requests.request import GenerationRequest, RequestError, SamplingParams

    model_dir, adapters = llama
    plain = tmp_path / "plain"
    shutil.copytree(adapters["act5"], plain)
    config = json.loads((plain / "adapter_config.json").read_text())
    del config["alora_invocation_tokens"]
    (plain / "adapter_config.json").write_text(json.dumps(config))
    order = [("act5", adapters["act5"]), ("plain5", str(plain))]
    with running_engine(model_dir, {}, max_total_tokens=4096, prefix_cache=True) as engine:
        for name, path in order if activated_first else order[::-1]:
            engine.add_adapter(name, path)
        assert engine.stats().adapter_host_memory["copies"] == 1
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        gen = torch.Generator().manual_seed(15)
        prompt = noise(gen, 20)  # no invocation
        with pytest.raises(RequestError):
            engine.submit(GenerationRequest(prompt, params, engine.resolve_adapter("act5")))
        out = engine.submit(
            GenerationRequest(prompt, params, engine.resolve_adapter("plain5"))
        ).result(300)
        model_dirs = (model_dir, {**adapters, "plain5": str(plain)})
        assert_greedy_as_peft(model_dirs, prompt, out.new_token_ids, "plain5")
        engine.submit(GenerationRequest(prompt, params, None)).result(300)
        checker = prompt + INVOKE["act5"] + noise(gen, 20)
        run = engine.submit(GenerationRequest(checker, params, engine.resolve_adapter("act5")))
        assert run.result(300).cached_tokens == 16  # the base model's block before position 20
