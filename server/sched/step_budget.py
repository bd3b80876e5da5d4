"""The token budget of a chunked-prefill step (`--max-num-batched-tokens` when it is 0).

Every running stream waits for the whole step between two of its tokens, so the budget follows a
stated inter-token SLO, `--itl-target-ms` (`ITL_TARGET_MS` by default): a step of `d` decodes
takes the most prompt tokens whose modelled step time stays within it. The default is a fixed
number, not a multiple of the step the engine runs: a multiple of a fast step gave a few dozen
prompt tokens a step beside a few streams, and each chunk paid the step's fixed cost again
(bench_chunked_prefill before issue 64: P99 TTFT well above unchunked; docs/benchmarks.md,
"Measurements behind the code"). The value: 150 ms a gap is 6-7 tokens a second, about as fast as
people read, and it is a bound on the slowest gaps (those of steps that carry a prompt chunk), not
on the median gap, which stays a decode step; llama.cpp's server (CPU users' pick) puts up to 2,048
prompt tokens beside its decodes with no bound at all.

One number, `tokens`, the budget at the batch the engine runs now, and named adjustments for
the steps where the target is the wrong rule:
- `whole prompts`: a step without decodes has no stream waiting on it; its budget is
  `max_prefill_tokens` (a waiting prompt goes whole, as without chunking);
- `GEMM floor`: beside `d` decodes a chunk is at least `gemm_tokens(d)` prompt tokens, the
  fewest at which a prompt cut into such chunks costs near its best rate per token: the streams
  pay a longer gap (a step of that many prompt tokens beside theirs) so that a prompt is not cut
  into many inefficient chunks that each read the weights again and each carry the decodes'
  step. It is measured at start-up with the step times: the fewest of their ladder of rows (256
  to 2,048) at which a chunk's step, the model's projections at those rows plus the decode step
  it carries (of `d` decodes, at least FEW_DECODES), costs at most `GEMM_SLACK` more a prompt
  token than the cheapest (`gemm_floor`), so that a long prompt chunked beside streams takes at
  most about that much longer than whole; GEMM_TOKENS without that measurement; the
  operator's `--chunk-floor-tokens` in place of both (server.sched.step_budget_keeper). Both parts
  matter: bf16 SmolLM2 shapes cost ~35 us a row and layer at 16-32 rows on an EPYC, ~17 from
  256 on, where the decode step of 8 a 256-token chunk carries still adds ~10% a token (a floor
  of the products alone, 256 there, gave P99 TTFT 1.25-1.28x unchunked at 0.3 and 0.5 of
  capacity); on a 2-core AMX Xeon oneDNN's products cost 1.4-2x more a row below ~1,344 rows
  than above, so there a 256-token chunk beside a few streams made a long prompt's prefill cost
  1.26x its whole one. Beside more streams the target alone gave chunks of 50-60 tokens (at
  0.7 of capacity on the EPYC, 9-14 streams beside a long prompt's late chunks): each cost 2.5x
  a token of the whole prompt, and P99 TTFT was 1.40-1.45x unchunked; with the floor at every
  batch it was 1.10-1.16x (docs/benchmarks.md, "Measurements behind the code"). So on a machine
  whose target allows fewer tokens than the floor (a CPU), a step that carries a chunk takes
  longer than the target: the target bounds the gaps only where it can without wasting the
  prompt's work. It is a number of tokens, not of milliseconds: on a machine slowed by a
  neighbour a target in milliseconds alone cut chunks so small that the chunked engine fell
  behind its arrivals (`chunked_prefill_issue64_run1.json`); and, chosen once from the start-up
  measurement (the refit keeps it), it cannot feed on a misfit fixed cost as session 28's
  fixed-share floor did. It counts a chunk's rows: in a step whose budget it set, a chunk's past
  is priced only past FLOOR_STALL times its rows (`gemm_steps`; server.sched.gate_limits), where
  pricing it cut a long prompt's late chunks beside 12 streams to 91-190 tokens (its prefill
  3.18 s against 2.68 whole; in 512-token chunks 2.87 s: bench/probe_long_prompt_steps.py,
  docs/benchmarks.md);
- `fixed-cost floor`: a chunk's work is at least the step's fixed cost (`MIN_CHUNK` tokens at
  the least), where a busy machine's steps with prompt tokens cost so much more than its decode
  steps that the target leaves no room: a step is then at most twice its fixed cost;
- `ceiling`: at most `max_prefill_tokens` (or a full batch plus `MIN_CHUNK`, where that is more).

The step-time model is linear: a decode step of B requests takes `decode_ms +
decode_ms_per_request * B`, each prompt token beside it `ms_per_token` more, and
`ms_per_token_past` more for each token of past it attends to. The engine measures it at start-up
on its own model and machine (server.model.step_timing), a prior that the steps it really runs
then correct within a few dozen steps (server.sched.step_refit); the defaults here are
bench/sim_engine.py's fit of SmolLM2, float32, on a 2-core Xeon VM, for the simulator and for
tests. The refit moves the budget: the target is fixed, the step's cost is what is learnt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol

from toppings.server.sched.tiles import TILE_STALL

MIN_CHUNK = 16  # prompt tokens a full batch of decodes leaves a step at least
ITL_TARGET_MS = 150.0  # the default inter-token SLO (--itl-target-ms)
GEMM_TOKENS = 256  # the GEMM floor where it was not measured (StepTimeModel.gemm_tokens)
GEMM_SLACK = 0.15  # how much more a prompt token the GEMM floor's chunks may cost than the cheapest
FEW_DECODES = 8  # the GEMM floor's chunk carries the decode step of at least this many
FLOOR_DECODES = 1024  # the GEMM floor is found for steps of up to this many decodes
GEMM = "GEMM floor"  # the name of that adjustment
FLOOR_STALL = 4.0  # most a GEMM floor step's chunk may cost, its past priced, in budgets


class StepPoints(Protocol):
    """Measured step times in ms (server.model.step_timing.StepTimes)."""

    decode_ms: dict[int, float]  # decode steps by batch size
    chunk_ms: dict[int, float]  # a chunk of chunk_tokens by the length of its past
    mixed_ms: dict[int, float]  # mixed_rows decodes beside prompt tokens, by prompt tokens
    mixed_rows: int
    chunk_tokens: int
    gemm_ms: dict[int, float]  # the model's projections by rows ({}: not measured)

    def describe(self) -> str: ...


@dataclass(frozen=True)
class StepTimeModel:
    """Linear step times in ms (see the module docstring for where the defaults come from)."""

    ms_per_token: float = 1.09
    decode_ms: float = 64.6
    decode_ms_per_request: float = 2.09
    # more per prompt token for each token of its past it attends to (a late chunk of a long
    # prompt); 0: not measured
    ms_per_token_past: float = 0.0
    # more a decode row costs in a step with prompt tokens than in a decode step
    mixed_ms_per_request: float = 0.0
    # more a step with prompt tokens costs, fixed (what the forward alone does not show:
    # server.sched.step_refit measures it on the running engine)
    mixed_fixed_ms: float = 0.0
    source: str = (
        "bench/sim_engine.py's fit of SmolLM2 float32 on a 2-core Xeon VM, not this machine's"
    )
    # the decode batch the engine runs now (server.sched.step_refit); 0: not seen yet
    batch_size: int = 0
    # the GEMM floor by the decodes of a step: ((fewest decodes, tokens), ...), ascending; a
    # chunk beside d decodes is at least the tokens of the last pair of at most d (gemm_tokens)
    gemm_floors: tuple[tuple[int, int], ...] = ((0, GEMM_TOKENS),)

    @classmethod
    def fit(cls, points: StepPoints) -> StepTimeModel:
        """The model through measured points (least squares): the decode line from the decode
        steps, a prompt token's cost from the mixed steps, a decode row's extra in them from
        their intercept, and the past's weight from the chunks (none with one chunk point).

        A negative slope of the mixed steps (timing noise: a start-up beside a busy neighbour
        measured the full batch of decodes beside more prompt tokens faster than beside fewer)
        does not make a prompt token free: its cost is then what the chunk after no past took
        beyond the smallest decode step. A free token made the past's weight (a ratio to it)
        hundreds of times too large and the budget one prompt token a step, and the refit,
        which keeps a prompt token's cost within a band of the prior's, could not correct it
        (tests/server/sched/test_chunked_schedule.py has the points).

        Nor does a slope far too steep make a prompt token dear: it costs at most what a row of
        the largest decode step measured costs (that step's time over its rows). A decode row
        is one more token through every weight, as a prompt token is, and it also attends to
        its past and goes through the LM head, which a prompt token that samples nothing does
        not; so this holds on any device. A start-up beside a neighbour's burst measured a prompt
        token ten times a decode row, and the refit's band, centred on the prior, then held it
        there for the engine's life, every budget at its floor
        (tests/server/sched/test_step_refit.py has the points).

        A decode step of no request takes no less than nothing: a line through disturbed decode
        points (one step far slower than its neighbours) can cross zero at a few rows, and the
        refit, which reads the machine's speed as real decode steps over the prior's, would take
        that speed as infinite and a prompt token's cost as unbounded."""
        per_request, fixed = _line(points.decode_ms)
        fixed = max(fixed, 0.0)
        ms_per_token, mixed_fixed = _line(points.mixed_ms)
        if ms_per_token <= 0 and points.chunk_ms:
            one = points.decode_ms[min(points.decode_ms)]  # the smallest decode step measured
            ms_per_token = (points.chunk_ms[min(points.chunk_ms)] - one) / points.chunk_tokens
        rows = max(points.decode_ms)
        if ms_per_token > (per_row := points.decode_ms[rows] / rows):
            least = min(points.mixed_ms)  # the line through the less disturbed point
            ms_per_token, mixed_fixed = per_row, points.mixed_ms[least] - per_row * least
        chunk_slope = _line(points.chunk_ms)[0] if len(points.chunk_ms) > 1 else 0.0
        mixed_rows = points.mixed_rows
        extra = (mixed_fixed - fixed - per_request * mixed_rows) / mixed_rows
        model = cls(
            ms_per_token=max(ms_per_token, 1e-6),
            decode_ms=fixed,
            decode_ms_per_request=max(per_request, 0.0),
            ms_per_token_past=max(chunk_slope / points.chunk_tokens, 0.0),
            mixed_ms_per_request=max(extra, 0.0),
            source=points.describe(),
        )
        return replace(model, gemm_floors=gemm_floors(points.gemm_ms, model))

    def gemm_tokens(self, num_decodes: int) -> int:
        """The GEMM floor of a step of `num_decodes` decodes (the module docstring)."""
        return next(n for d, n in reversed(self.gemm_floors) if d <= num_decodes)

    def past_weight(self) -> float:
        """Budget tokens a prompt token costs more for each token of past it attends to."""
        return self.ms_per_token_past / self.ms_per_token

    def decode_step_ms(self, batch_size: int) -> float:
        return self.decode_ms + self.decode_ms_per_request * batch_size

    def overhead_tokens(self) -> int:
        """Prompt tokens whose work equals a step's fixed cost (`decode_ms`, and the extra of a
        step with prompt tokens, `mixed_fixed_ms`, where it is positive)."""
        fixed = max(self.decode_ms, 0.0) + max(self.mixed_fixed_ms, 0.0)
        return math.ceil(fixed / self.ms_per_token)

    def _mixed_decodes_ms(self, batch_size: int) -> float:
        """What batch_size decodes cost a step that also computes prompt tokens."""
        extra = self.mixed_ms_per_request * batch_size + self.mixed_fixed_ms
        return self.decode_step_ms(batch_size) + extra

    def mixed_step_ms(self, batch_size: int, prompt_tokens: int) -> float:
        """A step of batch_size decodes and prompt_tokens prompt tokens (at no past)."""
        if not prompt_tokens:
            return self.decode_step_ms(batch_size)
        return self._mixed_decodes_ms(batch_size) + self.ms_per_token * prompt_tokens

    def prompt_tokens_within(self, target_ms: float, batch_size: int) -> int:
        """The most prompt tokens a step of batch_size decodes takes on within target_ms."""
        # never less than their decode step: a fit's negative fixed extra is the noise of a
        # window, and taken as it was it gave a whole long prompt one multi-second step
        decodes = max(self._mixed_decodes_ms(batch_size), self.decode_step_ms(batch_size))
        tokens = (target_ms - decodes) / self.ms_per_token
        return max(0, int(tokens)) if math.isfinite(tokens) else 0  # 0: the budget's floor


def gemm_floor(gemm_ms: dict[int, float], step_ms: float = 0.0) -> int:
    """The fewest rows n whose chunk step, the model's projections at n rows ({rows: ms}) plus
    `step_ms` (the decodes it carries), costs at most GEMM_SLACK more a prompt token than the
    cheapest rows measured; GEMM_TOKENS where nothing was measured."""
    step_ms = max(step_ms, 0.0) if math.isfinite(step_ms) else 0.0
    per_token = {n: (ms + step_ms) / n for n, ms in gemm_ms.items()
                 if n > 0 and math.isfinite(ms) and ms > 0}  # fmt: skip
    if not per_token:
        return GEMM_TOKENS
    cheapest = min(per_token.values())
    return min(n for n, cost in per_token.items() if cost <= (1 + GEMM_SLACK) * cheapest)


def gemm_floors(gemm_ms: dict[int, float], model: StepTimeModel) -> tuple[tuple[int, int], ...]:
    """The GEMM floor at every number of decodes up to FLOOR_DECODES, from the ladder
    `gemm_ms` and `model`'s decode line, as StepTimeModel.gemm_floors keeps it (it grows with the
    decode step a chunk carries)."""
    floors = [(0, gemm_floor(gemm_ms, model.decode_step_ms(FEW_DECODES)))]
    for d in range(FEW_DECODES + 1, FLOOR_DECODES + 1):
        if (tokens := gemm_floor(gemm_ms, model.decode_step_ms(d))) != floors[-1][1]:
            floors.append((d, tokens))
    return tuple(floors)


def _line(points: dict[int, float]) -> tuple[float, float]:
    """Slope and intercept of the least-squares line through {x: y}."""
    xs, ys = list(points), list(points.values())
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return slope, mean_y - slope * mean_x


@dataclass(frozen=True)
class StepBudget:
    """The chosen budget and how it was derived (logged at start-up)."""

    tokens: int
    itl_target_ms: float
    how: str
    # a prompt token counts 1 + past_weight x its past against the budget (GateLimits); 0: 1
    past_weight: float = 0.0
    # the budgets of steps of 0, 1, ... decodes (the adjustments of the module docstring); a
    # step of more decodes: `tokens`. (): `tokens` for all (a given budget)
    few_decodes: tuple[int, ...] = ()
    # the numbers of decodes whose steps' budget the GEMM floor set, ascending: there a chunk
    # counts its rows, its past priced only past FLOOR_STALL (server.sched.gate_limits)
    gemm_steps: tuple[int, ...] = ()
    # most a long prompt's chunk raised to a tile may take its step's cost to, in multiples of
    # the step's budget (server.sched.tiles): TILE_STALL for a derived budget, 1 for one given
    # by --max-num-batched-tokens
    tile_stall: float = 1.0
    # what a token of a scored prompt (its logprobs asked) costs more than another, as a share
    # of it: its row through the LM head (server.model.config.ModelConfig.scored_token_weight)
    scored_weight: float = 0.0

    @property
    def lone_tokens(self) -> int:
        """The budget of a step without decodes (0: `tokens`, a budget given by the flag)."""
        return self.few_decodes[0] if self.few_decodes else 0


def tokens_for(
    model: StepTimeModel, num_decodes: int, target_ms: float, ceiling: int
) -> tuple[int, str]:
    """The budget of a step of `num_decodes` decodes under an inter-token target of
    `target_ms`, at most `ceiling`, and the name of the rule that set it (module docstring)."""
    if not num_decodes:
        return ceiling, "whole prompts"
    tokens, rule = num_decodes + model.prompt_tokens_within(target_ms, num_decodes), "target"
    fixed = num_decodes + max(MIN_CHUNK, model.overhead_tokens())
    if fixed > tokens:
        tokens, rule = fixed, "fixed-cost floor"
    if num_decodes + (floor := model.gemm_tokens(num_decodes)) > tokens:
        tokens, rule = num_decodes + floor, GEMM
    if tokens >= ceiling:
        return ceiling, "ceiling"
    return tokens, rule


def choose_step_budget(
    max_batch_size: int,
    max_prefill_tokens: int,
    max_num_batched_tokens: int = 0,
    itl_target_ms: float = ITL_TARGET_MS,
    model: StepTimeModel | None = None,
    scored_weight: float = 0.0,
) -> StepBudget:
    """The step token budget: `max_num_batched_tokens` when given, else derived from the step
    time model and the inter-token target for every number of decodes a step may have; its
    `tokens` at the model's current batch (max_batch_size before it has one). See the module
    docstring."""
    if max_num_batched_tokens:  # the target is not used
        how = f"{max_num_batched_tokens} tokens a step, given by --max-num-batched-tokens"
        return StepBudget(max_num_batched_tokens, itl_target_ms, how, scored_weight=scored_weight)
    model = model or StepTimeModel()
    batch = min(max(model.batch_size, 1), max_batch_size) if model.batch_size else max_batch_size
    ceiling = max(max_prefill_tokens, max_batch_size + MIN_CHUNK)
    sized = [tokens_for(model, d, itl_target_ms, ceiling) for d in range(max_batch_size + 1)]
    tokens, rule = sized[batch]
    few = [n for n, _ in sized]
    while len(few) > 1 and few[-1] == tokens:
        few.pop()  # steps of that many decodes take `tokens` anyway
    floor = ""
    if any(how_set == GEMM for _, how_set in sized):
        first, *more = [(d, n) for d, n in model.gemm_floors if d <= max_batch_size]
        floor = f", chunks of at least {first[1]} tokens" + "".join(
            f", {n} beside {d} decodes or more" for d, n in more
        )
    beside = f"{batch} decode" + ("s" if batch > 1 else "")
    how = (f"{tokens} tokens a step beside {beside} ({rule}, {itl_target_ms:g} ms target), "
           f"whole prompts with no decodes{floor}")  # fmt: skip
    gemm_steps = tuple(d for d, (_, how_set) in enumerate(sized) if how_set == GEMM)
    return StepBudget(tokens, itl_target_ms, how, model.past_weight(), tuple(few), gemm_steps,
                      TILE_STALL, scored_weight)  # fmt: skip
