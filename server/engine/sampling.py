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
) -> list[int]:
    """Pick one token per row. logits float32 [B, V]; returns B token ids."""
    chosen = logits.argmax(dim=-1).tolist()
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
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        outside = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        pick = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=gen)
        return int(order[pick])
    return int(torch.multinomial(probs, 1, generator=gen))
