"""`min_p` (vLLM's semantics: after temperature, drop every token whose probability is under
min_p x the most likely token's, then top-k and top-p) against a reference sampler written here
in plain torch, and through the engine."""

from __future__ import annotations

import pytest
import torch

from toppings.server.requests.request import (
    GenerationRequest,
    RequestError,
    SamplingParams,
)
from toppings.server.sampling.next_token import sample_next


def reference_probs(logits: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
    """vLLM's MinPLogitsProcessor on a temperature-scaled row [V]: the kept tokens'
    probabilities, renormalized, and 0 elsewhere."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    keep = probs >= min_p * probs.max()
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum()


def draw(logits: torch.Tensor, params: SamplingParams, seed: int) -> int:
    gen = torch.Generator().manual_seed(seed)
    return sample_next(logits[None], [params], [gen])[0]


@pytest.mark.parametrize("min_p, temperature", [(0.05, 1.0), (0.2, 0.7), (0.5, 1.5), (0.9, 1.0)])
def test_min_p_keeps_what_the_reference_keeps_and_samples_its_distribution(min_p, temperature):
    logits = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 3  # [V]
    ref = reference_probs(logits, temperature, min_p)
    params = SamplingParams(temperature=temperature, min_p=min_p)
    draws = torch.tensor([draw(logits, params, seed) for seed in range(3000)])
    counts = torch.bincount(draws, minlength=64).double() / len(draws)
    assert set(draws.tolist()) <= set(torch.nonzero(ref).flatten().tolist())
    # every kept token with 2% or more of the mass is drawn, at its reference frequency
    assert torch.allclose(counts, ref, atol=0.03), (counts, ref)
    if min_p < 0.5:  # the filter does drop tokens a plain sampler draws
        plain = {draw(logits, SamplingParams(temperature=temperature), s) for s in range(3000)}
        assert plain - set(draws.tolist())


def test_min_p_draws_the_reference_token_for_the_same_seed():
    """With the same generator state, our sampler and the reference pick the same token: one
    uniform number u in [0, 1) from the request's generator, the first token whose cumulative
    probability passes u."""
    logits = torch.randn(500, generator=torch.Generator().manual_seed(7)) * 2
    ref = reference_probs(logits, 0.8, 0.1).tolist()
    params = SamplingParams(temperature=0.8, min_p=0.1)
    for seed in range(200):
        u = torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        expected, mass = 0, ref[0]
        while mass <= u:  # the reference's probabilities sum to 1
            expected += 1
            mass += ref[expected]
        assert draw(logits, params, seed) == expected


def test_min_p_zero_is_off_and_one_keeps_the_top_token():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(3))
    off, plain = SamplingParams(temperature=1.0, min_p=0.0), SamplingParams(temperature=1.0)
    assert [draw(logits, off, s) for s in range(50)] == [draw(logits, plain, s) for s in range(50)]
    top = SamplingParams(temperature=1.0, min_p=1.0)
    assert {draw(logits, top, s) for s in range(50)} == {int(logits.argmax())}


@pytest.mark.parametrize("min_p", [-0.1, 1.5])
def test_min_p_out_of_range_is_refused(min_p):
    with pytest.raises(RequestError, match=r"min_p must be in \[0, 1\]"):
        SamplingParams(min_p=min_p)


def test_min_p_one_through_the_engine_gives_the_greedy_tokens(tiny_engine):
    prompt = [5, 17, 33, 9, 12]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    top_only = SamplingParams(max_new_tokens=8, temperature=1.0, min_p=1.0, seed=3,
                              ignore_eos=True)  # fmt: skip
    with tiny_engine() as engine:
        want = engine.submit(GenerationRequest(prompt, greedy)).result(timeout_s=60)
        got = engine.submit(GenerationRequest(prompt, top_only)).result(timeout_s=60)
    assert got.new_token_ids == want.new_token_ids
