"""Prompt-token and output-token logprobs (and ranks) of mixed-adapter batches equal transformers +
PEFT's log-softmax (fp32, within 1e-4), for both kernels and every LoRA mode.

Each request is scored alone by the reference on its prompt plus the tokens our engine chose,
so the check covers every position our engine computed, whatever it sampled.
"""

from __future__ import annotations

import pytest
import torch

from tests.server.engine.test_exactness import (
    _nullcontext,
    _peft_model,
    make_adapters,
    mixed_prompts,
)
from toppings.server.requests.request import GenerationRequest, SamplingParams

TOL = 1e-4
NEW_TOKENS = 6
TOP = 3


def reference_logprobs(base_dir, adapters, ids: list[int], adapter: str | None) -> torch.Tensor:
    """log_softmax of transformers + PEFT's logits at every position of `ids`, [len, V]."""
    model = _peft_model(base_dir, tuple(sorted(adapters.items())))
    ctx = model.disable_adapter() if adapter is None else _nullcontext()
    if adapter is not None:
        model.set_adapter(adapter)
    with ctx, torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_against_reference(model_dir, adapters, prompts, results) -> None:
    for (prompt, name), out in zip(prompts, results):
        ids = prompt + out.new_token_ids
        ref = reference_logprobs(model_dir, adapters, ids, name)  # [len, V]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        scored = out.prompt_logprobs[1:] + out.logprobs  # predicts ids[1:]
        assert [s.token_id for s in scored] == ids[1:]
        for pos, s in enumerate(scored):
            want = ref[pos]
            value = want[ids[pos + 1]]
            assert abs(s.logprob - float(value)) < TOL, (name, pos)
            above = int((want > value + TOL).sum()), int((want > value - TOL).sum())
            assert above[0] + 1 <= s.rank <= above[1] + 1, (name, pos)  # ties within TOL
            top_ids = [t for t, _ in s.top]
            assert len(top_ids) == TOP
            got_top = torch.tensor([lp for _, lp in s.top])
            assert torch.allclose(got_top, want[top_ids], atol=TOL), (name, pos)
            assert torch.allclose(got_top, want.topk(TOP).values, atol=TOL), (name, pos)


def run_scored(engine, prompts, temperature: float):
    params = SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=temperature, seed=7, ignore_eos=True,
        logprobs=TOP, prompt_logprobs=TOP,
    )  # fmt: skip
    handles = [
        engine.submit(GenerationRequest(list(p), params, engine.resolve_adapter(a)))
        for p, a in prompts
    ]
    return [h.result(timeout_s=300) for h in handles]


@pytest.mark.parametrize("lora_mode", ["cached", "on-demand", "cpu-assisted"])
@pytest.mark.parametrize("kernel", ["mbgmv", "bgmv"])
def test_logprobs_match_peft(tmp_path_factory, tiny_model_dir, tiny_engine, kernel, lora_mode):
    adapters = make_adapters(tmp_path_factory.mktemp("adapters"), tiny_model_dir)
    # A slow emulated link keeps loads in flight, so cpu-assisted runs layers on the host.
    link = 64 * 128 * 4 * 7 * 2 * 8 / 0.5 / 1e9 if lora_mode != "cached" else 0.0
    with tiny_engine(
        adapters, kernel=kernel, lora_mode=lora_mode, max_total_tokens=4096, max_batch_size=16,
        link_gbps=link,
    ) as engine:  # fmt: skip
        prompts = mixed_prompts(200, seed=5)
        results = run_scored(engine, prompts, temperature=0.8)  # sampled: not only argmaxes
        if lora_mode == "cpu-assisted":
            assert engine.lora.host_stats.calls > 0, "no layer ran on the host"
    check_against_reference(tiny_model_dir, adapters, prompts, results)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernel", ["mbgmv", "bgmv"])
def test_logprobs_match_peft_on_cuda(tmp_path_factory, tiny_model_dir, tiny_engine, kernel):
    """The engine on the GPU (Triton kernels, logits and log-softmax on the device)."""
    adapters = make_adapters(tmp_path_factory.mktemp("adapters_cuda"), tiny_model_dir)
    with tiny_engine(
        adapters, device="cuda", kernel=kernel, max_total_tokens=4096, max_batch_size=16
    ) as engine:
        prompts = mixed_prompts(200, seed=6)
        results = run_scored(engine, prompts, temperature=0.8)
    check_against_reference(tiny_model_dir, adapters, prompts, results)


def test_prompt_only_scoring_generates_nothing(tiny_engine):
    """max_new_tokens 0: the prompt is scored, no token is generated, the KV row is freed."""
    with tiny_engine(max_total_tokens=512) as engine:
        params = SamplingParams(max_new_tokens=0, prompt_logprobs=1)
        out = engine.submit(GenerationRequest([5, 9, 30, 7], params)).result(timeout_s=60)
        stats = engine.stats().to_json()
    assert out.new_token_ids == [] and out.finish_reason == "length"
    assert out.prompt_logprobs[0] is None and [p.token_id for p in out.prompt_logprobs[1:]] == [
        9,
        30,
        7,
    ]
    assert stats["free_kv_tokens"] == stats["max_total_tokens"]


class _RowCounter:
    """The LM head with every call's row count recorded."""

    def __init__(self, head):
        self.head, self.rows = head, []

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        self.rows.append(h.shape[0])
        return self.head(h)


def test_a_long_prompt_is_scored_by_chunks_of_logits(tiny_model_dir, tiny_engine):
    """A prompt of two chunks' tokens (the tiny model holds 512), scored beside one that is
    not: its logprobs equal transformers' log-softmax at every position, and the LM head never
    makes more than a chunk's rows of logits at once (not [prompt, V]: 4.2 GB for 8k tokens of
    a 128k vocabulary)."""
    from transformers import AutoModelForCausalLM

    from toppings.server.sampling.logits import LOGPROB_CHUNK_ROWS

    long = torch.randint(
        0, 256, (LOGPROB_CHUNK_ROWS + 150,), generator=torch.Generator().manual_seed(3)
    ).tolist()
    with tiny_engine(max_total_tokens=4096) as engine:
        counter = _RowCounter(engine.model.lm_head)
        engine.model.lm_head = counter
        scored = SamplingParams(max_new_tokens=2, prompt_logprobs=TOP, ignore_eos=True)
        plain = SamplingParams(max_new_tokens=2, ignore_eos=True)
        handles = [
            engine.submit(GenerationRequest(long, scored)),
            engine.submit(GenerationRequest(long[:40], plain)),
        ]
        out, other = [h.result(timeout_s=120) for h in handles]
    assert max(counter.rows) <= LOGPROB_CHUNK_ROWS
    assert other.prompt_logprobs is None and len(other.new_token_ids) == 2
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.inference_mode():
        want = torch.log_softmax(model(input_ids=torch.tensor([long])).logits[0].float(), -1)
    got = out.prompt_logprobs
    assert got[0] is None and [s.token_id for s in got[1:]] == long[1:]
    values = torch.tensor([s.logprob for s in got[1:]])
    assert torch.allclose(values, want[torch.arange(len(long) - 1), long[1:]], atol=TOL)
    tops = torch.tensor([[lp for _, lp in s.top] for s in got[1:]])
    assert torch.allclose(tops, want[:-1].topk(TOP).values, atol=TOL)
