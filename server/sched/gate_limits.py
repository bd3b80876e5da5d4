"""The configuration numbers admission reads: the batch's rows, the prompt budget and, with
chunked prefill, the step budget and what a prompt chunk costs of it.

A chunk's cost grows with the past it attends to (`past_weight`, server.sched.step_budget):
`chunk_cost` is that cost and `chunk_within` its inverse, the most tokens a cost allows. In a
step whose budget the GEMM floor set (`counts_rows`) a chunk costs its rows, or its priced cost
over FLOOR_STALL where that is more: a long prompt's late chunks keep the floor's rows (priced,
they came out at 91-190 tokens beside 12 streams and the prompt took 1.19x its whole time;
docs/benchmarks.md), and only a past several times longer (a prompt of tens of thousands of
tokens, whose steps of the floor's rows would each take seconds) makes them smaller. A chunk of
a prompt whose logprobs are asked (`scored`) costs 1 + `scored_weight` times as much: each of
its rows goes through the LM head too (ModelConfig.scored_token_weight: about a quarter more
on SmolLM2), which the step model, fitted on prompts scoring their last row only, does not see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from toppings.server.sched.step_budget import FLOOR_STALL

if TYPE_CHECKING:
    from toppings.server.config import SchedulingConfig
    from toppings.server.sched.step_budget import StepBudget


@dataclass(frozen=True)
class GateLimits:
    """The configuration numbers admission reads."""

    max_batch_size: int
    max_prefill_tokens: int
    # Chunked prefill: the tokens one step computes (decodes and prompt chunks together);
    # None: a step prefills whole prompts up to max_prefill_tokens (chunked prefill off).
    max_step_tokens: int | None = None
    # Chunked prefill: what a prompt token costs more of the budget for each token of past it
    # attends to (server.sched.step_budget); 0: every token costs one.
    past_weight: float = 0.0
    # Chunked prefill: the budgets of steps of 0, 1, ... decodes (StepBudget.few_decodes); a
    # step of more decodes: max_step_tokens.
    few_decode_tokens: tuple[int, ...] = ()
    # Chunked prefill: most a chunk raised to a tile may take a step's cost to, in multiples of
    # its budget (StepBudget.tile_stall)
    tile_stall: float = 1.0
    # Chunked prefill: the numbers of decodes whose steps' budget the GEMM floor set, where a
    # chunk counts its rows (StepBudget.gemm_steps)
    gemm_steps: tuple[int, ...] = ()
    # Chunked prefill: whether this step's chunks count their rows (for_step; module docstring)
    counts_rows: bool = False
    # Chunked prefill: what a token of a prompt whose logprobs are asked (its row goes through
    # the LM head) costs more than another, as a share of it (StepBudget.scored_weight)
    scored_weight: float = 0.0
    # Whether a request's KV is reserved as its adapter's output history expects (--kv-admission
    # expected: `Scheduler.add`), not for all of max_new_tokens
    expected_kv: bool = False

    @classmethod
    def from_config(cls, config: SchedulingConfig, budget: StepBudget | None = None) -> GateLimits:
        """budget: the step budget the engine chose (None: chunked prefill off)."""
        return cls(
            config.max_batch_size, config.max_prefill_tokens,
            expected_kv=config.kv_admission == "expected",
        ).with_budget(budget)  # fmt: skip

    def with_budget(self, budget: StepBudget | None) -> GateLimits:
        """These limits with chunked prefill's steps sized by `budget` (None: off)."""
        if budget is None:
            return replace(self, max_step_tokens=None, past_weight=0.0, few_decode_tokens=(),
                           tile_stall=1.0, gemm_steps=(), scored_weight=0.0)  # fmt: skip
        return replace(self, max_step_tokens=budget.tokens, past_weight=budget.past_weight,
                       few_decode_tokens=budget.few_decodes, tile_stall=budget.tile_stall,
                       gemm_steps=budget.gemm_steps,
                       scored_weight=budget.scored_weight)  # fmt: skip

    def for_step(self, num_decodes: int) -> GateLimits:
        """These limits for a chunked-prefill step of `num_decodes` decodes: its budget, and
        its chunks counting their rows where the GEMM floor set that budget."""
        return replace(self, max_step_tokens=self.step_tokens(num_decodes),
                       counts_rows=num_decodes in self.gemm_steps)  # fmt: skip

    def step_tokens(self, num_decodes: int) -> int:
        """The budget of a chunked-prefill step with `num_decodes` decodes in it."""
        if num_decodes < len(self.few_decode_tokens):
            return self.few_decode_tokens[num_decodes]
        return self.max_step_tokens

    def chunk_cost(self, tokens: int, past: int, scored: bool = False) -> int:
        """Budget tokens of a chunk of `tokens` prompt tokens after `past` computed ones: each
        counts 1 + past_weight x what it attends to before it (the past, its chunk's earlier
        tokens); where the step counts rows, its rows or that over FLOOR_STALL, the more. A
        `scored` chunk's (its prompt's logprobs asked) counts 1 + scored_weight times that."""
        cost = self._unscored_cost(tokens, past)
        return math.ceil(cost * (1 + self.scored_weight)) if scored else cost

    def _unscored_cost(self, tokens: int, past: int) -> int:
        if not self.past_weight or tokens <= 0:
            return max(tokens, 0)
        priced = math.ceil(tokens * (1 + self.past_weight * (past + (tokens - 1) / 2)))
        return max(tokens, math.ceil(priced / FLOOR_STALL)) if self.counts_rows else priced

    def chunk_within(self, cost: int, past: int, scored: bool = False) -> int:
        """The most prompt tokens after `past` whose chunk_cost (`scored` or not) is within
        `cost` (at least one, so that every planned prompt advances)."""
        unscored = int(cost / (1 + self.scored_weight)) if scored else cost
        tokens = self._within(unscored, past)
        while tokens > 1 and self.chunk_cost(tokens, past, scored) > cost:
            tokens -= 1
        return tokens

    def _within(self, cost: int, past: int) -> int:
        """chunk_within of an unscored chunk."""
        w = self.past_weight
        if not w:
            return max(cost, 1)
        priced = cost * FLOOR_STALL if self.counts_rows else cost
        b = 1 + w * (past - 0.5)  # priced cost(t) = t * b + w * t^2 / 2
        tokens = max(int((math.sqrt(b * b + 2 * w * priced) - b) / w), 1)
        tokens = min(tokens, cost) if self.counts_rows else tokens
        while tokens > 1 and self.chunk_cost(tokens, past) > cost:
            tokens -= 1
        return tokens
