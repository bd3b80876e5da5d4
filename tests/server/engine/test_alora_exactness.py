"""Activated LoRA adapters (PEFT's `alora_invocation_tokens`) give what transformers + PEFT's own
aLoRA forward gives each request alone: the adapter applies from the start of the last
occurrence of its invocation sequence in the prompt on, as PEFT's `calculate_alora_offsets`
decides it, and the tokens before it are the base model's. Checked with the invocation at
several positions and occurring twice, in mixed batches with plain LoRA and base rows, for both
kernels and every LoRA mode (the CPU-assisted host path included), with chunked prefill cutting
prompts across the activation point, and with the prefix cache on (an activated request reuses
only base-model blocks before its activation: test_alora_prefix.py). A prompt without the
invocation sequence is a 400 naming it.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import running_engine
from tests.server.engine.test_dora_exactness import run as run_dora
from tests.server.engine.test_dora_exactness import slow_link
from tests.server.engine.test_exactness import _peft_model
from toppings.server.requests.request import GenerationRequest, RequestError, SamplingParams

TOL = 1e-4
MARGIN = 1e-4
NEW_TOKENS = 6
TOP = 2
VOCAB = 256
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INVOKE = {"act5": [7, 8, 9], "act3": [11, 12]}  # invocation token ids (kept out of the noise)
# name -> (rank, targets)
SPECS = {
    "act5": (5, ALL),
    "act3": (3, ("q_proj", "v_proj", "down_proj")),
    "lora8": (8, ("q_proj", "k_proj", "gate_proj")),
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from toppings.scripts.make_adapters import make_random_adapter
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path_factory.mktemp("alora_llama"), num_layers=3)
    root = tmp_path_factory.mktemp("alora_adapters")
    adapters = {}
    for i, (name, (rank, targets)) in enumerate(SPECS.items()):
        path = make_random_adapter(root / name, model_dir, rank=rank, target_modules=targets,
                                   seed=i, delta_ratio=0.5)  # fmt: skip
        if name in INVOKE:  # trained weights aside, an activated LoRA is its config
            cfg = json.loads((path / "adapter_config.json").read_text())
            cfg.update(alora_invocation_tokens=INVOKE[name], task_type="CAUSAL_LM")
            (path / "adapter_config.json").write_text(json.dumps(cfg))
        adapters[name] = str(path)
    return model_dir, adapters


def noise(gen: torch.Generator, n: int) -> list[int]:
    """n token ids that contain no invocation token."""
    return torch.randint(20, VOCAB, (n,), generator=gen).tolist()


def mixed_prompts(seed: int) -> list[tuple[list[int], str | None]]:
    """Activated requests with the invocation at the start, in the middle, at the very end and
    twice; plain LoRA and base requests beside them."""
    gen = torch.Generator().manual_seed(seed)
    a, b = INVOKE["act5"], INVOKE["act3"]
    return [
        (a + noise(gen, 20), "act5"),  # activated from position 0
        (noise(gen, 13) + a + noise(gen, 9), "act5"),  # in the middle
        (noise(gen, 30) + b, "act3"),  # the invocation ends the prompt
        (noise(gen, 6) + b + noise(gen, 11) + b + noise(gen, 4), "act3"),  # twice: the last
        (noise(gen, 5) + a + noise(gen, 3) + a + noise(gen, 17), "act5"),
        (noise(gen, 15), "lora8"),
        (noise(gen, 9) + a + noise(gen, 3), None),  # the base model ignores invocations
        (noise(gen, 25) + b + noise(gen, 2), "act3"),
    ]


def run(engine, prompts):
    return run_dora(engine, prompts, NEW_TOKENS)


def reference(model_dir, adapters, prompt: list[int], ids: list[int], name: str | None):
    """transformers + PEFT's logits at every position of `ids` (the prompt and our tokens), the
    activation found by PEFT in the prompt alone, as its `generate` finds it."""
    from peft.tuners.lora.variants import calculate_alora_offsets

    model = _peft_model(model_dir, tuple(sorted(adapters.items())))
    kwargs = {}
    if name is None:
        ctx = model.disable_adapter()
    else:
        model.set_adapter(name)
        ctx = torch.inference_mode()  # any context: the adapter is set
        if name in INVOKE:
            (offset,) = calculate_alora_offsets(model.peft_config, name, torch.tensor([prompt]))
            assert offset is not None  # PEFT finds the invocation too
            start = len(prompt) - offset
            kwargs["alora_offsets"] = [len(ids) - start]
    with ctx, torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), **kwargs).logits[0].float()


def check_against_peft(model_dir, adapters, prompts, results) -> None:
    """Teacher-forced: our greedy choice is the reference's argmax (or a near tie) at every
    generated position, and every logprob we report matches its log-softmax within TOL."""
    for (prompt, name), out in zip(prompts, results):
        ids = prompt + out.new_token_ids
        logits = reference(model_dir, adapters, prompt, ids, name)
        ref = torch.log_softmax(logits, dim=-1)  # [len, V]
        scored = out.prompt_logprobs[1:] + out.logprobs  # predicts ids[1:]
        assert [s.token_id for s in scored] == ids[1:]
        for pos, s in enumerate(scored):
            assert abs(s.logprob - float(ref[pos][ids[pos + 1]])) < TOL, (name, pos)
            got_top = torch.tensor([lp for _, lp in s.top])
            assert torch.allclose(got_top, ref[pos].topk(TOP).values, atol=TOL), (name, pos)
        for pos in range(len(prompt) - 1, len(ids) - 1):  # the greedy choices
            top2 = torch.topk(logits[pos], 2).values
            if ids[pos + 1] != int(logits[pos].argmax()):
                assert float(top2[0] - top2[1]) < MARGIN, (name, pos, "greedy token differs")
                break


def test_activation_starts_at_the_last_invocation_as_peft_finds_it(llama):
    """Our search agrees with PEFT's on every prompt shape of the tests."""
    from peft.tuners.lora.variants import calculate_alora_offsets

    from toppings.gpu_lora.alora import activation_start

    model_dir, adapters = llama
    model = _peft_model(model_dir, tuple(sorted(adapters.items())))
    for prompt, name in mixed_prompts(seed=1):
        if name not in INVOKE:
            continue
        (offset,) = calculate_alora_offsets(model.peft_config, name, torch.tensor([prompt]))
        assert activation_start(prompt, INVOKE[name]) == len(prompt) - offset


@pytest.mark.parametrize("lora_mode", ["cached", "on-demand", "on-demand-sync", "cpu-assisted"])
@pytest.mark.parametrize("kernel", ["mbgmv", "bgmv"])
def test_activated_lora_mixed_batch_matches_peft(llama, kernel, lora_mode):
    model_dir, adapters = llama
    link = slow_link(adapters, 0.5) if lora_mode != "cached" else 0.0
    with running_engine(
        model_dir, adapters, kernel=kernel, lora_mode=lora_mode, max_total_tokens=4096,
        max_batch_size=16, link_gbps=link,
    ) as engine:  # fmt: skip
        prompts = mixed_prompts(seed=2)
        results = run(engine, prompts)
        if lora_mode == "cpu-assisted":
            assert engine.lora.host_stats.calls > 0, "no layer ran on the host"
    check_against_peft(model_dir, adapters, prompts, results)


@pytest.mark.parametrize(("kernel", "lora_mode", "workers"),
                         [("mbgmv", "cpu-assisted", 2), ("bgmv", "cached", 0)])  # fmt: skip
def test_activated_lora_with_chunked_prefill_across_the_activation(llama, kernel, lora_mode,
                                                                   workers):  # fmt: skip
    """Steps of at most 12 tokens, decodes first: prompts are cut into chunks of 4 to 12
    tokens, so activations fall inside chunks, at their edges, or several chunks in; the host
    path in CPU worker processes."""
    model_dir, adapters = llama
    link = slow_link(adapters, 1.0) if lora_mode != "cached" else 0.0
    with running_engine(
        model_dir, adapters, kernel=kernel, lora_mode=lora_mode, max_total_tokens=4096,
        max_batch_size=8, chunked_prefill=True, max_num_batched_tokens=12, link_gbps=link,
        num_cpu_workers=workers,
    ) as engine:  # fmt: skip
        prompts = mixed_prompts(seed=3)
        results = run(engine, prompts)
        if lora_mode == "cpu-assisted":
            assert engine.lora.host_stats.calls > 0, "no layer ran on the host"
    check_against_peft(model_dir, adapters, prompts, results)


def test_activated_lora_reuses_no_prefix_computed_under_another_activation(llama):
    """B's prompt extends A's and invokes again later: A's blocks past A's activation hold
    adapted KV where B needs the base model's. B reuses only A's blocks before A's activation
    (base-model KV)."""
    model_dir, adapters = llama
    gen = torch.Generator().manual_seed(4)
    a = INVOKE["act5"]
    first = noise(gen, 32) + a + noise(gen, 29)  # 64 tokens: four full blocks
    second = first + a + noise(gen, 5)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=TOP, prompt_logprobs=TOP)  # fmt: skip
    with running_engine(model_dir, adapters, max_total_tokens=4096, max_batch_size=4,
                        prefix_cache=True) as engine:  # fmt: skip
        # prompt_logprobs turn the prefix cache off for a request: the first is cached without
        plain = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
        engine.submit(GenerationRequest(list(first), plain, engine.resolve_adapter("act5"))).result(
            timeout_s=300
        )
        engine.submit(
            GenerationRequest(list(first), plain, engine.resolve_adapter("lora8"))
        ).result(timeout_s=300)
        again = engine.submit(
            GenerationRequest(list(first), plain, engine.resolve_adapter("lora8"))
        ).result(timeout_s=300)
        assert again.cached_tokens > 0  # the cache is on: a plain LoRA request reuses it
        handle = engine.submit(
            GenerationRequest(list(second), plain, engine.resolve_adapter("act5"))
        )
        out = handle.result(timeout_s=300)
        assert out.cached_tokens == 32  # the two blocks before A's activation at 32
        scored = engine.submit(
            GenerationRequest(list(second), params, engine.resolve_adapter("act5"))
        ).result(300)
    assert scored.new_token_ids[:2] == out.new_token_ids
    check_against_peft(model_dir, adapters, [(second, "act5")], [scored])


def test_prompt_without_the_invocation_is_a_400(llama):
    from toppings.server.api.app import create_app

    model_dir, adapters = llama
    with running_engine(model_dir, adapters, max_total_tokens=1024) as engine:
        params = SamplingParams(max_new_tokens=2)
        with pytest.raises(RequestError) as caught:
            engine.submit(
                GenerationRequest([20, 21, 7, 8, 22], params, engine.resolve_adapter("act5"))
            )  # 9 missing
        assert caught.value.code == 400
        assert "alora_invocation_tokens" in str(caught.value) and "[7, 8, 9]" in str(caught.value)
        client = create_app(engine).test_client()
        reply = client.post("/generate", json={"adapter": "act3", "input_ids": [30, 31, 12, 11],
                                               "max_new_tokens": 2})  # fmt: skip
        assert reply.status_code == 400
        error = reply.get_json()["error"]
        assert "act3" in error["message"] and "[11, 12]" in error["message"]
        ok = client.post("/generate", json={"adapter": "act3", "input_ids": [30, 11, 12, 31],
                                            "max_new_tokens": 2})  # fmt: skip
        assert ok.status_code == 200, ok.get_data(as_text=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernel", ["mbgmv", "bgmv"])
def test_activated_lora_matches_peft_on_cuda(llama, kernel):
    """The engine on the GPU (Triton kernels, decode graphs: every decode row is activated)."""
    model_dir, adapters = llama
    with running_engine(
        model_dir, adapters, device="cuda", kernel=kernel, max_total_tokens=4096,
        max_batch_size=16,
    ) as engine:  # fmt: skip
        prompts = mixed_prompts(seed=5)
        results = run(engine, prompts)
    check_against_peft(model_dir, adapters, prompts, results)
