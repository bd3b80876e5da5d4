"""Logit processors against naive per-token loops (vLLM's formulas), and the repetition penalty
against transformers' `generate(repetition_penalty=...)` on the same model."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import running_engine
from toppings.server.requests.request import GenerationRequest, RequestError, SamplingParams
from toppings.server.sampling.logits import process_row, token_logprobs


def naive(logits: list[float], p: SamplingParams, prompt, output, eos_ids) -> list[float]:
    row = list(logits)
    for token, bias in p.logit_bias:
        row[token] += bias
    if len(output) < p.min_tokens:
        for token in eos_ids:
            row[token] = -math.inf
    for token in set(prompt) | set(output):
        r = p.repetition_penalty
        row[token] = row[token] / r if row[token] > 0 else row[token] * r
    for token in set(output):
        row[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return row


@pytest.mark.parametrize(
    "changes",
    [dict(presence_penalty=0.7), dict(frequency_penalty=-0.4), dict(repetition_penalty=1.7),
     dict(repetition_penalty=0.6), dict(min_tokens=5), dict(logit_bias=((3, 5.0), (9, -100.0))),
     dict(presence_penalty=1.1, frequency_penalty=0.3, repetition_penalty=1.2, min_tokens=9,
          logit_bias=((0, 2.0), (31, 1.5)))],
)  # fmt: skip
def test_process_row_matches_the_formulas(changes):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, generator=gen) * 3
    params = SamplingParams(max_new_tokens=10, **changes)
    prompt, output, eos = [1, 2, 2, 5], [5, 7, 7, 7, 30], {0, 31}
    got = process_row(logits, params, prompt, output, eos)
    want = torch.tensor(naive(logits.tolist(), params, prompt, output, eos))
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.equal(logits, logits.clone()), "the input row is left alone"


def test_token_logprobs_are_log_softmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    out = token_logprobs(logits, [4, 0, 49], k=3)
    ref = torch.log_softmax(logits, -1)
    for row, (lp, token) in enumerate(zip(out, [4, 0, 49])):
        assert lp.token_id == token and lp.logprob == pytest.approx(float(ref[row, token]))
        assert [t for t, _ in lp.top] == ref[row].topk(3).indices.tolist()


def test_token_logprobs_in_chunks_equal_one_pass():
    logits = torch.randn(600, 40, generator=torch.Generator().manual_seed(2))  # 3 chunks
    ids = torch.randint(0, 40, (600,), generator=torch.Generator().manual_seed(3)).tolist()
    out = token_logprobs(logits, ids, k=2)
    ref = torch.log_softmax(logits, -1)
    assert [o.token_id for o in out] == ids
    assert torch.allclose(torch.tensor([o.logprob for o in out]), ref[range(600), ids])
    assert [o.top[0][0] for o in out] == ref.argmax(-1).tolist()


@pytest.mark.parametrize(
    "changes, words",
    [(dict(presence_penalty=2.5), "presence_penalty"), (dict(repetition_penalty=0), "repetition"),
     (dict(min_tokens=20), "min_tokens"), (dict(logprobs=21), "logprobs"),
     (dict(logit_bias=((1, 200.0),)), "logit_bias"), (dict(max_new_tokens=0), "max_new_tokens")],
)  # fmt: skip
def test_sampling_params_limits(changes, words):
    with pytest.raises(RequestError, match=words):
        SamplingParams(**{"max_new_tokens": 10, **changes})


def test_repetition_penalty_matches_transformers(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    prompt = [5, 9, 30, 9, 41, 5]
    new = 24
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with running_engine(tiny_model_dir, max_total_tokens=512) as engine:
        for penalty in (1.3, 2.0):
            with torch.inference_mode():
                ref = model.generate(
                    torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                    do_sample=False, repetition_penalty=penalty, pad_token_id=0,
                )[0, len(prompt):].tolist()  # fmt: skip
            params = SamplingParams(max_new_tokens=new, temperature=0, ignore_eos=True,
                                    repetition_penalty=penalty)  # fmt: skip
            ours = engine.submit(GenerationRequest(prompt, params)).result(timeout_s=60)
            assert ours.new_token_ids == ref, penalty
