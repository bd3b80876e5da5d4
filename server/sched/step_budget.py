"""The token budget of a chunked-prefill step (`--max-num-batched-tokens` when it is 0).

A mixed step's time grows with the tokens it computes, and every running stream waits for the
whole step between two of its tokens. So the budget is what the batch's decodes plus the most
prompt tokens whose modelled step time stays within an inter-token target take:
`--itl-target-ms`, or by default `ITL_MULTIPLE` times the modelled decode step at the batch the
engine runs now (a step may add two decode steps' worth of prompt work to the decode it would
run anyway: a stream's largest gap stays within a few of its usual ones, and a long prompt
beside 16 streams takes a few dozen steps, not hundreds; before any step ran, at
`--max-batch-size`). The model is linear: a decode step of B requests takes
`decode_ms + decode_ms_per_request * B`, each prompt token beside it `ms_per_token` more, and
`ms_per_token_past` more for each token of past it attends to. The engine measures it at
start-up on its own model and machine (server.model.step_timing), a prior that the steps it
really runs then correct within a few dozen steps (server.sched.step_refit); the defaults here
are bench/sim_engine.py's fit of SmolLM2, float32, on a 2-core Xeon VM, for the simulator and
for tests.

The budget is at least the batch's decodes plus `MIN_CHUNK` prompt tokens, and plus as many
prompt tokens as a step's fixed cost (`decode_ms`, and a step with prompt tokens' extra,
`mixed_fixed_ms`) is worth, so that a chunk's work is never smaller than the per-step overhead
it pays: on a GPU, where a prompt token costs microseconds, that floor is in the thousands; on a
CPU, where a prompt token costs about as much as a decode row, it is a few dozen and the
inter-token target decides. At most `max_prefill_tokens` (or a
full batch plus `MIN_CHUNK`, where that is more).

A step of few decodes has few streams waiting on it, and a prompt being chunked pays the step's
fixed cost (the decodes beside it, a step's extra for prompt tokens) once per chunk: a step of `b`
decodes is sized so that its fixed cost is at most `(b + 1) x FIXED_SHARE` of it, where that gives
more than the target does. Every request waiting on the step has a say: without decodes the fixed
cost is at most a tenth of the step (the prompt's wait alone decides), beside one stream a fifth,
and from nine decodes on the target alone. On a CPU the target's budget for every step cut a long
prompt into many small chunks, each reading the weights again (the cost of its past shrinks each
chunk further), so the prompt and every prompt behind it waited several times its unchunked prefill
(docs/features.md, chunked prefill, has the measurements). Beside one stream the step is then about
5x its fixed cost: the stream's gap grows from one decode step to five, still a small part of the
step an unchunked long prompt takes. A step with decodes is held within the stall bound all the
same, `TILE_STALL` times the inter-token target (the bound a chunk raised to a tile keeps,
server.sched.tiles), whatever its fixed cost: that cost is the refit's, and a misfit lands in its
intercept (`mixed_fixed_ms`: a long prompt's first chunks slower than modelled, beside a busy
neighbour, moved it several-fold at once), which this rule alone turned into a larger budget, a
multi-second step beside one stream, and the steps after it larger again (docs/features.md, chunked
prefill, has the trace): past where the bound binds, a step found slower makes the steps streams
wait on smaller, not larger. Only the budget's floor goes past the bound, where a step's fixed cost
alone exceeds it: a step is then at most twice its fixed cost (a chunk's work equal to it), as a
step of smaller chunks would pay more overhead than work, and a prompt held at `MIN_CHUNK` tokens a
step (where a busy machine's steps with prompt tokens cost far more than its decode steps) took
seconds past its prefill. A target given by `--itl-target-ms` is the operator's bound on every step
a stream waits on: it is kept there (steps without decodes are still sized by their fixed cost; the
floor holds there too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from toppings.server.sched.tiles import TILE_STALL

MIN_CHUNK = 16  # prompt tokens a full batch of decodes leaves a step at least
ITL_MULTIPLE = 3.0  # the default inter-token target, in decode steps at the current batch
# most of a step its fixed cost may be, for each request waiting on it (its decodes and the prompt)
FIXED_SHARE = 0.1


class StepPoints(Protocol):
    """Measured step times in ms (server.model.step_timing.StepTimes)."""

    decode_ms: dict[int, float]  # decode steps by batch size
    chunk_ms: dict[int, float]  # a chunk of chunk_tokens by the length of its past
    mixed_ms: dict[int, float]  # mixed_rows decodes beside prompt tokens, by prompt tokens
    mixed_rows: int
    chunk_tokens: int

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
        return cls(
            ms_per_token=max(ms_per_token, 1e-6),
            decode_ms=fixed,
            decode_ms_per_request=max(per_request, 0.0),
            ms_per_token_past=max(chunk_slope / points.chunk_tokens, 0.0),
            mixed_ms_per_request=max(extra, 0.0),
            source=points.describe(),
        )

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
    # the budgets of steps of 0, 1, ... decodes, where their fixed cost's share sizes them
    # (FIXED_SHARE); a step of more decodes: `tokens`. (): `tokens` for all (a given budget)
    few_decodes: tuple[int, ...] = ()
    # most a long prompt's chunk raised to a tile may take its step's cost to, in multiples of
    # the step's budget (server.sched.tiles): TILE_STALL for a derived budget, 1 where the
    # operator bounded the steps (--max-num-batched-tokens, --itl-target-ms)
    tile_stall: float = 1.0

    @property
    def lone_tokens(self) -> int:
        """The budget of a step without decodes (0: `tokens`, a budget given by the flag)."""
        return self.few_decodes[0] if self.few_decodes else 0


def fixed_share_tokens(model: StepTimeModel, num_decodes: int) -> int | None:
    """The budget of a step of `num_decodes` decodes whose fixed cost (what it takes beside its
    prompt tokens) is `(num_decodes + 1) x FIXED_SHARE` of it; None from where that share is
    the whole step (the target alone sizes it)."""
    share = (num_decodes + 1) * FIXED_SHARE
    if share >= 1:
        return None
    fixed_ms = max(model.mixed_step_ms(num_decodes, 1) - model.ms_per_token, 0.0)
    return num_decodes + math.ceil(fixed_ms / model.ms_per_token * (1 / share - 1))


def choose_step_budget(
    max_batch_size: int,
    max_prefill_tokens: int,
    max_num_batched_tokens: int = 0,
    itl_target_ms: float = 0.0,
    model: StepTimeModel | None = None,
) -> StepBudget:
    """The step token budget: `max_num_batched_tokens` when given, else derived from the step
    time model and the inter-token target (0: ITL_MULTIPLE x the decode step at the model's
    current batch, or at max_batch_size before it has one) for the model's current batch, and
    for steps of few decodes from their fixed cost's share (see the module docstring)."""
    if max_num_batched_tokens:  # the target is not used (0 unless given)
        how = "given by --max-num-batched-tokens"
        return StepBudget(max_num_batched_tokens, itl_target_ms, how)
    model = model or StepTimeModel()
    batch = min(max(model.batch_size, 1), max_batch_size) if model.batch_size else max_batch_size
    target = itl_target_ms or ITL_MULTIPLE * model.decode_step_ms(batch)
    modelled = batch + model.prompt_tokens_within(target, batch)
    ceiling = max(max_prefill_tokens, max_batch_size + MIN_CHUNK)
    floor = min(batch + max(MIN_CHUNK, model.overhead_tokens()), ceiling)
    tokens = max(floor, min(modelled, ceiling))
    few: list[int] = []
    stall_ms = TILE_STALL * target  # the most a step a stream waits on is modelled to take
    # an operator's target binds every step a stream waits on: then only a step without
    # decodes is sized by its fixed cost
    for num_decodes in range(1 if itl_target_ms else max_batch_size + 1):
        sized = fixed_share_tokens(model, num_decodes)
        if sized is None:
            break
        if num_decodes:  # streams wait on it: within the stall bound, whatever its fixed cost
            sized = min(sized, num_decodes + model.prompt_tokens_within(stall_ms, num_decodes))
        few.append(max(tokens, min(sized, ceiling)))
    while len(few) > 1 and few[-1] == tokens:
        few.pop()  # steps of that many decodes take `tokens` anyway
    source = "--itl-target-ms" if itl_target_ms else f"{ITL_MULTIPLE:g}x the decode step"
    sizes = "/".join(str(n) for n in few)
    decodes = f"0..{len(few) - 1}" if len(few) > 1 else "0"
    how = (
        f"{batch} decodes (a {model.decode_step_ms(batch):.0f} ms step, modelled) and the "
        f"prompt tokens ({model.ms_per_token:.3g} ms each) that keep the step within an "
        f"inter-token target of {target:.0f} ms ({source} at a batch of {batch}): {modelled}, "
        f"clamped to [{floor}, {ceiling}]; {sizes} in a step of {decodes} decodes (its fixed "
        f"cost at most {FIXED_SHARE:g} of it for each request waiting on it, a step with "
        f"decodes within {TILE_STALL:g}x the target); a prompt token "
        f"after a past of P counts 1 + {model.past_weight():.2g} x P; step model: {model.source}"
    )
    stall = 1.0 if itl_target_ms else TILE_STALL
    return StepBudget(tokens, target, how, model.past_weight(), tuple(few), stall)
