"""Sampled rows (server/sampling/next_token.py) against references written here in plain torch:
top-p keeps what a sort of the whole vocabulary keeps, and a draw follows the row's
probabilities and never picks a token they give 0."""

from __future__ import annotations

import pytest
import torch

from toppings.server.requests.request import SamplingParams
from toppings.server.sampling.next_token import draw, nucleus, sample_next


def reference_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p filter over a full descending sort, [V]: kept probabilities, 0 elsewhere."""
    ordered, order = probs.double().sort(descending=True)
    outside = ordered.cumsum(-1) - ordered >= top_p
    kept = torch.zeros_like(probs, dtype=torch.float64)
    kept[order[~outside]] = ordered[~outside]
    return kept


# (vocabulary, logit scale, top_p)
NUCLEI = [
    (64, 3.0, 0.8), (5000, 0.5, 0.9), (5000, 4.0, 0.5), (300, 0.0, 0.95), (300, 2.0, 1 - 1e-6),
]  # fmt: skip


@pytest.mark.parametrize("vocab, scale, top_p", NUCLEI)
def test_nucleus_keeps_what_a_full_sort_keeps(vocab, scale, top_p):
    # scale 0.5 over 5,000 tokens: the nucleus needs thousands of tokens (k grows past 64);
    # scale 0: all equal, the prefix of a tie
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * scale
    probs = torch.softmax(logits, dim=-1)
    top, order = nucleus(probs, top_p)
    got = torch.zeros(vocab, dtype=torch.float64)
    got[order] = top.double()
    ref = reference_nucleus(probs, top_p)
    assert int((got > 0).sum()) == int((ref > 0).sum())
    if scale > 0:  # without ties the kept tokens are the same ones
        assert torch.equal(got > 0, ref > 0)
        assert torch.allclose(got, ref, atol=1e-7)


def test_draw_follows_the_probabilities_and_skips_zeros():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    gen = torch.Generator().manual_seed(0)
    draws = torch.tensor([draw(probs, gen) for _ in range(4000)])
    counts = torch.bincount(draws, minlength=6).double() / len(draws)
    assert set(draws.tolist()) == {1, 3, 4}
    assert torch.allclose(counts, probs.double(), atol=0.03), counts
    assert draw(torch.tensor([0.0, 0.0, 1.0]), gen) == 2  # unnormalized mass: still its token


@pytest.mark.parametrize("top_k, top_p", [(0, 0.7), (5, 1.0), (5, 0.6)])
def test_sampled_rows_follow_the_filtered_distribution(top_k, top_p):
    logits = torch.randn(64, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p)
    scaled = logits.double() / 0.9
    if top_k:
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[-1], float("-inf"))
    ref = reference_nucleus(torch.softmax(scaled, dim=-1), top_p)
    ref = ref / ref.sum()
    gens = [torch.Generator().manual_seed(s) for s in range(4000)]
    draws = torch.tensor([sample_next(logits[None], [params], [g])[0] for g in gens])
    counts = torch.bincount(draws, minlength=64).double() / len(draws)
    assert set(draws.tolist()) <= set(torch.nonzero(ref).flatten().tolist())
    assert torch.allclose(counts, ref, atol=0.03), (counts, ref)
