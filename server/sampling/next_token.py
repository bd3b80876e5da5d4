"""Next-token choice for a batch: greedy rows in one argmax, sampled rows with their own seeds."""

from __future__ import annotations

import torch

from toppings.server.requests.request import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A per-request generator so a seeded request samples the same tokens in any batch."""
    if params.is_greedy:
        return None
    gen = torch.Generator()
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def sample_next(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    argmax: list[int] | None = None,
) -> list[int]:
    """Pick one token per row. logits float32 [B, V]; argmax: each row's, where the caller has
    it (else computed here); returns B token ids."""
    chosen = list(argmax) if argmax is not None else logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.is_greedy:
            chosen[row] = _sample_row(logits[row].cpu(), p, gen)
    return chosen


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """Temperature, then min-p, then top-k, then top-p (nucleus) over one row [V], in vLLM's
    order. Min-p drops the tokens whose probability (after temperature) is under min_p times the
    most likely token's."""
    scaled = logits / p.temperature
    if p.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_k > 0 and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        top, order = nucleus(probs, p.top_p)
        return int(order[draw(top, gen)])
    return draw(probs, gen)


def nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest prefix of probs [V] sorted descending whose mass reaches top_p (the first
    token always stays): (its probabilities [k], their token ids [k]), probabilities past the
    prefix zeroed. A sort of the whole vocabulary costs milliseconds on a CPU, so the largest
    probabilities are taken by top-k with k growing until their mass reaches top_p: the same
    prefix."""
    vocab, k = probs.numel(), 64
    while True:
        top, order = torch.topk(probs, min(k, vocab))  # descending
        mass = top.cumsum(-1)
        if mass[-1] >= top_p or k >= vocab:
            break
        k *= 8
    return top.masked_fill(mass - top >= top_p, 0.0), order


def draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """An index of probs [n] (>= 0, not all 0) drawn with probability proportional to its
    value, by one uniform number through the float64 cumulative sum: torch.multinomial draws an
    exponential for every entry, which over a whole vocabulary costs more than the rest of the
    sampling together (docs/benchmarks.md)."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand((), dtype=torch.float64, generator=gen) * cdf[-1]
    # the first index whose cumulative sum passes u: never a zero-probability entry
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.numel() - 1)
