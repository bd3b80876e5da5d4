"""From the model's logits to each request's next token: prompt scoring, processors, sampling,
logprobs (the model runner's side of a step; `Sequence` keeps only the results).

Each sampled request has its own `torch.Generator` (server/engine/sampling.py), made at its
first sampled token and made again after a restart (`Sequence.num_restarts` moved), so a seeded
request draws the same tokens in any batch and again after a squash.
"""

from __future__ import annotations

import weakref

import torch

from toppings.server.engine.logits import process_row, token_logprobs
from toppings.server.engine.sampling import make_generator, sample_next
from toppings.server.requests.request import TokenLogprob
from toppings.server.requests.sequence import Sequence


def logit_rows(seqs: list[Sequence], seg_starts: list[int]) -> list[int] | None:
    """Prefill: the token rows whose logits the step needs, when a sequence wants its prompt
    scored (every row of its segment); None: each segment's last row only."""
    if all(s.request.params.prompt_logprobs is None for s in seqs):
        return None
    rows: list[int] = []
    for seq, start, end in zip(seqs, seg_starts[:-1], seg_starts[1:]):
        whole = seq.request.params.prompt_logprobs is not None
        rows.extend(range(start if whole else end - 1, end))
    return rows


def score_prompts(
    seqs: list[Sequence], logits: torch.Tensor, seg_starts: list[int]
) -> torch.Tensor:
    """Keep the prompt logprobs of the sequences that asked (logits of `logit_rows`, [R, V]);
    returns the logits of each sequence's last prompt token, [B, V]."""
    if logits.shape[0] == len(seqs):
        return logits
    last, offset = [], 0
    for seq, start, end in zip(seqs, seg_starts[:-1], seg_starts[1:]):
        k = seq.request.params.prompt_logprobs
        if k is not None:
            ids = seq.request.prompt_ids
            if end - start != len(ids):  # e.g. a reused prefix was not computed again
                raise RuntimeError("prompt logprobs need the whole prompt in the prefill")
            scored = token_logprobs(logits[offset : offset + len(ids) - 1], ids[1:], k)
            seq.set_prompt_logprobs(scored)
            offset += len(ids) - 1
        last.append(offset)
        offset += 1
    return logits[last]


class Sampler:
    """Next tokens of a batch; holds the random generators of the requests it samples."""

    def __init__(self, eos_ids: set[int]):
        self.eos_ids = eos_ids
        # request -> (its restart count when made, generator); entries go with their request
        self._generators: weakref.WeakKeyDictionary[
            Sequence, tuple[int, torch.Generator | None]
        ] = weakref.WeakKeyDictionary()

    def generator(self, seq: Sequence) -> torch.Generator | None:
        """The request's generator (None: greedy), made anew after a restart."""
        made = self._generators.get(seq)
        if made is None or made[0] != seq.num_restarts:
            made = (seq.num_restarts, make_generator(seq.request.params))
            self._generators[seq] = made
        return made[1]

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """Next token of each sequence from its row of logits [B, V] float32.

        Rows with penalties, a logit bias or min_tokens are processed first; the logprobs asked
        for are taken from the unprocessed rows (see server/engine/logits.py) and left in each
        sequence's `step_logprob`."""
        params = [s.request.params for s in seqs]
        chosen_from = logits
        if any(p.has_processors for p in params):
            chosen_from = logits.clone()
            for i, (seq, p) in enumerate(zip(seqs, params)):
                if p.has_processors:
                    prompt = seq.request.prompt_ids
                    chosen_from[i] = process_row(logits[i], p, prompt, seq.output_ids, self.eos_ids)
        tokens = sample_next(chosen_from, params, [self.generator(s) for s in seqs])
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            k = max(params[i].logprobs for i in want)
            scored = token_logprobs(logits[want], [tokens[i] for i in want], k)
            for i, lp in zip(want, scored):
                top = lp.top[: params[i].logprobs]
                seqs[i].step_logprob = TokenLogprob(lp.token_id, lp.logprob, top)
        return tokens
