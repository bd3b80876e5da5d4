"""Chameleon's opportunistic bypass (MICRO'25, sec. 4.3.3): who may go ahead of a request that
waits for adapter memory, and the budget of squashed work.

A younger request may bypass it when the budget is not spent and it is predicted to end before
the first running adapter request does (when adapter memory should free up). A bypasser is
squashed (it waits again and resumes where it was: `Sequence.resume`, its prefill computed
again) when the bypassed request would fit by releasing its adapter, as long as the squashed
tokens stay within `SQUASH_SHARE` of all tokens processed. Any request may bypass, random ones
too: a resumed request goes on after the tokens it sent, none sent twice or changed.
"""

from __future__ import annotations

from dataclasses import dataclass

SQUASH_SHARE = 0.05  # the paper's bound: at most 5% of the work is squashed


@dataclass
class SquashBudget:
    """Tokens processed (prompt + output) by every request that left the batch, and the share
    of them thrown away by squashes."""

    work_tokens: int = 0
    wasted_tokens: int = 0

    def allows(self, work: int) -> bool:
        """Whether squashing a request that has processed `work` tokens stays within budget."""
        return self.wasted_tokens + work <= SQUASH_SHARE * (self.work_tokens + work)

    def left(self, work: int, squashed: bool = False) -> None:
        """A request that processed `work` tokens left the batch (thrown away if squashed)."""
        self.work_tokens += work
        self.wasted_tokens += work if squashed else 0

    @property
    def spent(self) -> bool:
        """Whether the squashed share is past the bound already."""
        return self.wasted_tokens > SQUASH_SHARE * self.work_tokens

    @property
    def share(self) -> float:
        return self.wasted_tokens / max(self.work_tokens, 1)


def may_bypass(predicted_out: float, remaining: list[float], budget: SquashBudget) -> bool:
    """Whether a request predicted to make `predicted_out` tokens may bypass one waiting for
    adapter memory; `remaining`: predicted tokens left of each running adapter request."""
    if budget.spent:
        return False
    soonest = max(min(remaining), 0.0) if remaining else 0.0
    return predicted_out <= soonest
