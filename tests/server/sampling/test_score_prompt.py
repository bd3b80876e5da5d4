"""A prompt scored in prefill chunks (`sampler.score_prompt`): whatever the chunks, its logprobs
are the ones scoring it whole gives (`logits.token_logprobs` over every position), published
once the last chunk is in, and started over after a restart."""

from __future__ import annotations

import pytest
import torch

from tests.server.sched.test_scheduler import Tokenizer
from toppings.server.requests.request import GenerationRequest, RequestHandle, SamplingParams
from toppings.server.requests.sequence import Sequence
from toppings.server.sampling.logits import token_logprobs
from toppings.server.sampling.sampler import score_prompt

VOCAB, HIDDEN, TOP = 40, 8, 2


def _scoring_sequence(prompt: list[int]) -> Sequence:
    params = SamplingParams(2, temperature=0.0, prompt_logprobs=TOP)
    request = GenerationRequest(prompt, params, None)
    return Sequence(request, RequestHandle(request, lambda _id: None), Tokenizer(), 0.0)


def _published(seq: Sequence):
    return seq._prompt_logprobs  # what the next output sends


@pytest.mark.parametrize("chunks", [[9], [8, 1], [4, 4, 1], [1, 7, 1], [3, 6], [5, 3, 1]])
def test_chunks_score_as_the_whole_prompt_does(chunks):
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (9,), generator=gen).tolist()
    hidden = torch.randn(9, HIDDEN, generator=gen)  # every prompt position's
    weight = torch.randn(VOCAB, HIDDEN, generator=gen)
    head = lambda h: h @ weight.t()  # noqa: E731
    want = [None, *token_logprobs(head(hidden[:-1]), prompt[1:], TOP)]
    seq = _scoring_sequence(prompt)
    start = 0
    for n in chunks:
        assert _published(seq) is None  # nothing before the last chunk
        score_prompt(seq, start, hidden[start : start + n], head)
        start += n
    got = _published(seq)
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None and [g.token_id for g in got[1:]] == prompt[1:]
    for g, w in zip(got[1:], want[1:]):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5) and g.rank == w.rank
        assert [t for t, _ in g.top] == [t for t, _ in w.top]


def test_a_restart_scores_from_the_start_again_and_a_gap_is_an_error():
    prompt = list(range(3, 12))
    head = lambda h: torch.zeros(h.shape[0], VOCAB)  # noqa: E731
    seq = _scoring_sequence(prompt)
    score_prompt(seq, 0, torch.zeros(4, HIDDEN), head)
    score_prompt(seq, 0, torch.zeros(9, HIDDEN), head)  # restarted: the whole prompt again
    assert len(_published(seq)) == len(prompt)
    seq = _scoring_sequence(prompt)
    score_prompt(seq, 0, torch.zeros(4, HIDDEN), head)
    with pytest.raises(RuntimeError, match="in order"):
        score_prompt(seq, 6, torch.zeros(3, HIDDEN), head)
