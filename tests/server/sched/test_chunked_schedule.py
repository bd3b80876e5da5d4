"""Chunked prefill in the Scheduler, without a model: mixed steps put every running decode
first, then prompt chunks within the step's token budget; a request being prefilled keeps its
place; a long prompt arriving beside many decoding streams never takes a step from them."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tests.server.sched.test_scheduler import BLOCK, EOS, Adapters, Memory, Tokenizer, submit
from toppings.server.config import SchedulingConfig
from toppings.server.sched.gate_limits import GateLimits
from toppings.server.sched.plan import StepPlan, StepResult
from toppings.server.sched.policies import make_queue_policy
from toppings.server.sched.scheduler import Scheduler
from toppings.server.sched.step_budget import (
    FLOOR_STALL,
    GEMM_TOKENS,
    ITL_TARGET_MS,
    MIN_CHUNK,
    StepBudget,
    StepTimeModel,
    choose_step_budget,
    gemm_floor,
)
from toppings.server.sched.step_refit import scaled
from toppings.server.sched.tiles import ATTENTION_TILE, TILE_STALL


def make_chunked(
    budget: int, max_batch=40, num_blocks=4096, policy="fcfs", queue=None, past_weight=0.0,
    tile_stall=1.0,
):  # fmt: skip
    """tile_stall: StepBudget.tile_stall (1: a given budget; TILE_STALL: a derived one)."""
    config = SchedulingConfig(queue_policy=policy)
    memory, adapters = Memory(num_blocks), Adapters()
    limits = GateLimits(max_batch, 8192, budget, past_weight, tile_stall=tile_stall)
    clock = iter(range(1_000_000)).__next__
    if queue is None:
        queue = make_queue_policy(config, num_blocks * BLOCK)
    return Scheduler(queue, memory, adapters, limits, {EOS}, 4096, clock), memory, adapters


def unfloored(model: StepTimeModel | None = None) -> StepTimeModel:
    """`model` on a machine whose products cost the same a row at any rows (no GEMM floor): the
    budget is the target's and its own floors'."""
    return replace(model or StepTimeModel(), gemm_floors=((0, 0),))


def step(sched) -> StepPlan | None:
    plan = sched.schedule()
    if plan is not None:
        sched.update(plan, StepResult([5] * len(plan.sampled)))
    return plan


def tokens_of(plan: StepPlan) -> dict:
    """Each request's tokens this step (1 for every request of a pure decode step)."""
    return dict(zip(plan.seqs, plan.tokens))


@pytest.mark.parametrize("policy", ["fcfs", "chameleon"])
def test_decodes_first_then_chunks_within_the_budget(policy):
    sched, memory, adapters = make_chunked(budget=16, max_batch=8, policy=policy)
    short = [submit(sched, prompt_len=6, max_new=20, ignore_eos=True) for _ in range(3)]
    plan = step(sched)  # three whole prompts: 18 tokens do not fit 16
    assert plan.is_prefill and sum(plan.tokens) == 16
    assert plan.sampled == tuple(s for s in plan.seqs if s.is_prefilled)
    long = submit(sched, prompt_len=50, max_new=2, ignore_eos=True)
    for _ in range(6):
        decoding = [s for s in short if s.output_ids]
        got = tokens_of(step(sched))
        assert sum(got.values()) <= 16
        assert all(got.get(s) == 1 for s in decoding), "a decode missed a step"
    assert all(s.is_prefilled for s in short)
    while sched.has_work():
        step(sched)
    assert long.output_ids == [5, 5] and all(len(s.output_ids) == 20 for s in short)
    assert memory.reserved == 0 and all(n == 0 for n in adapters.refs.values())


def test_a_partly_prefilled_request_keeps_its_place():
    sched, _, _ = make_chunked(budget=20, max_batch=8)
    first = submit(sched, prompt_len=45, max_new=2, ignore_eos=True)
    second = submit(sched, prompt_len=30, max_new=2, ignore_eos=True)
    plan = step(sched)
    assert tokens_of(plan) == {first: 20}  # the budget ends with the first prompt's chunk
    assert first in sched.running and first not in sched.queue
    plan = step(sched)
    assert tokens_of(plan) == {first: 20}  # still first: the second waits behind it
    plan = step(sched)
    assert tokens_of(plan) == {first: 5, second: 15}  # first's last chunk, then the second's
    assert plan.sampled == (first,)
    plan = step(sched)
    assert tokens_of(plan) == {first: 1, second: 15}
    assert set(plan.sampled) == {first, second}


def test_prompt_logprobs_requests_are_chunked_like_any():
    """A request scoring its prompt takes the budget's chunks as any prompt does (each chunk's
    rows are scored as it is computed): it never makes a step past the budget, which every
    running stream would wait for."""
    from toppings.server.requests.request import GenerationRequest, RequestHandle, SamplingParams
    from toppings.server.requests.sequence import Sequence

    sched, _, _ = make_chunked(budget=20, max_batch=8)
    params = SamplingParams(2, temperature=0.0, prompt_logprobs=1)
    request = GenerationRequest(list(range(2, 42)), params, None)
    scored = Sequence(request, RequestHandle(request, lambda _id: None), Tokenizer(), 0.0)
    sched.add(scored)
    plan = step(sched)
    assert tokens_of(plan) == {scored: 20} and plan.sampled == ()
    plan = step(sched)
    assert tokens_of(plan) == {scored: 20} and plan.sampled == (scored,)
    request = GenerationRequest(list(range(2, 32)), params, None)
    late = Sequence(request, RequestHandle(request, lambda _id: None), Tokenizer(), 0.0)
    sched.add(late)
    plan = step(sched)
    assert tokens_of(plan) == {scored: 1, late: 19}


def test_long_prompt_never_stalls_32_decoding_streams():
    """The stall test in step terms: the stated target is one token per stream per step. A
    1,000-token prompt arriving while 32 streams decode, budget 64: every step while it is
    prefilled gives each stream its token, and the prompt takes ceil(1000 / (64 - 32)) steps
    (the decodes take 32 of each step's 64 tokens)."""
    budget, streams = 64, 32
    sched, memory, _ = make_chunked(budget=budget, max_batch=streams + 1)
    decoding = [submit(sched, prompt_len=8, max_new=200, ignore_eos=True) for _ in range(streams)]
    while not all(s.output_ids for s in decoding):
        step(sched)
    long = submit(sched, prompt_len=1000, max_new=4, ignore_eos=True)
    steps = 0
    while not long.output_ids:
        before = [len(s.output_ids) for s in decoding]
        plan = step(sched)
        steps += 1
        assert [len(s.output_ids) for s in decoding] == [n + 1 for n in before]
        assert sum(tokens_of(plan).values()) <= budget
    assert steps == math.ceil(1000 / (budget - streams))


def test_unchunked_steps_stay_whole_prompt_prefills():
    sched, _, _ = make_chunked(budget=None, max_batch=8)
    seqs = [submit(sched, prompt_len=50, max_new=2) for _ in range(2)]
    plan = step(sched)
    assert plan.is_prefill and set(plan.seqs) == set(seqs)
    assert plan.tokens == (50, 50) and all(plan.samples) and plan.starts == (0, 0)
    # the same path as chunked: the running decodes go beside the next whole prompt
    late = submit(sched, prompt_len=70, max_new=2)
    plan = step(sched)
    assert tokens_of(plan) == {seqs[0]: 1, seqs[1]: 1, late: 70} and all(plan.samples)
    assert dict(zip(plan.seqs, plan.starts)) == {seqs[0]: 50, seqs[1]: 50, late: 0}


def test_the_default_budget_follows_a_fixed_inter_token_target():
    """The target is ITL_TARGET_MS whatever the batch (not a multiple of its decode step); the
    budget is the batch's decodes plus the prompt tokens whose modelled step stays within it."""
    model = unfloored()  # a decode step of B: 64.6 + 2.09 B ms, a prompt token 1.09 ms
    budget = choose_step_budget(max_batch_size=128, max_prefill_tokens=8192, model=model)
    assert budget.itl_target_ms == ITL_TARGET_MS == SchedulingConfig().itl_target_ms
    # no batch run yet: at 128 the decode step (332 ms) is over the target; the floor holds
    assert budget.tokens == 128 + math.ceil(64.6 / 1.09)
    cpu = unfloored(StepTimeModel(ms_per_token=0.5, decode_ms=20.0, decode_ms_per_request=1.0))
    for batch in (12, 16):
        now = choose_step_budget(128, 8192, model=replace(cpu, batch_size=batch))
        assert now.itl_target_ms == ITL_TARGET_MS
        assert now.tokens == batch + int((ITL_TARGET_MS - cpu.decode_step_ms(batch)) / 0.5)
        assert "150 ms target" in now.how and now.how.count(".") == 0  # one short sentence
    # a given target, below the decode step: the fixed-cost floor (64.6 / 1.09 -> 60)
    assert choose_step_budget(12, 8192, itl_target_ms=50.0, model=model).tokens == 12 + 60
    assert choose_step_budget(8, 8192, max_num_batched_tokens=100).tokens == 100
    assert choose_step_budget(400, 8192).tokens >= 400 + MIN_CHUNK


def test_budget_floor_follows_the_cost_of_a_prompt_token():
    # a CPU: a prompt token costs about a decode row; the target decides, MIN_CHUNK at least
    cpu = unfloored(StepTimeModel(ms_per_token=0.85, decode_ms=8.0, decode_ms_per_request=0.5))
    assert choose_step_budget(32, 8192, model=cpu).tokens == 32 + int((150 - 24) / 0.85)
    assert choose_step_budget(32, 8192, itl_target_ms=10.0, model=cpu).tokens == 32 + MIN_CHUNK
    # a GPU: a prompt token costs microseconds, so a chunk is at least the step's fixed cost
    gpu = unfloored(StepTimeModel(ms_per_token=0.004, decode_ms=6.0, decode_ms_per_request=0.01))
    assert choose_step_budget(32, 8192, itl_target_ms=6.5, model=gpu).tokens == 32 + 1500
    # never above max_prefill_tokens
    assert choose_step_budget(32, 1024, model=gpu).tokens == 1024


def test_a_step_without_decodes_takes_whole_prompts():
    """No stream waits on a step without decodes: its budget is max_prefill_tokens, whatever
    the target. A budget given by the flag is the same for all."""
    cpu = StepTimeModel(ms_per_token=0.25, decode_ms=8.0, decode_ms_per_request=0.4,
                        mixed_fixed_ms=5.0)  # fmt: skip
    assert choose_step_budget(32, 8192, model=cpu).lone_tokens == 8192
    assert choose_step_budget(32, 8192, itl_target_ms=20.0, model=cpu).lone_tokens == 8192
    assert choose_step_budget(32, 256, model=cpu).lone_tokens == 256  # at most the prefill's
    assert choose_step_budget(32, 8192, max_num_batched_tokens=100, model=cpu).lone_tokens == 0
    # the scheduler: a 3,000-token prompt with no stream beside it runs in one step
    sched, _, _ = make_chunked(budget=60, max_batch=8)
    sched.set_step_budget(choose_step_budget(8, 8192, model=cpu))
    long = submit(sched, prompt_len=3000, max_new=2, ignore_eos=True)
    assert tokens_of(step(sched)) == {long: 3000} and long.output_ids


def test_a_lone_prompt_takes_the_bigger_chunks_until_a_decode_runs_beside_it():
    sched, memory, _ = make_chunked(budget=56, max_batch=3)
    sched.set_step_budget(StepBudget(56, 0.0, "test", few_decodes=(400,)))
    long = submit(sched, prompt_len=1000, max_new=2, ignore_eos=True)
    assert tokens_of(step(sched)) == {long: 400}
    short = submit(sched, prompt_len=10, max_new=20, ignore_eos=True)
    got = tokens_of(step(sched))  # the short one shares the lone step's room, then decodes
    # the long one's 390 in whole tiles of the blocked attention kernel (server.sched.tiles)
    assert got[short] == 10 and got[long] == 384
    got = tokens_of(step(sched))
    assert got[short] == 1 and sum(got.values()) == 56
    while sched.has_work():
        step(sched)
    assert memory.reserved == 0


def test_budget_must_exceed_the_batch_size():
    from toppings.server.settings import validate

    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        validate(SchedulingConfig(chunked_prefill=True, max_num_batched_tokens=8, max_batch_size=8))


def test_a_chunk_floor_is_refused_beside_a_given_budget():
    from toppings.server.settings import validate

    validate(SchedulingConfig(chunk_floor_tokens=128))
    with pytest.raises(ValueError, match="chunk_floor_tokens"):
        validate(SchedulingConfig(chunk_floor_tokens=128, max_num_batched_tokens=512))


def test_simulator_runs_chunked_steps():
    """bench/sim_engine.py drives the real Scheduler with chunked steps too: every request gets
    its first token; under FCFS the long prompt keeps its place (a chunk every step), and the
    short requests behind it take the room kept for short prompts: they sample before it does,
    where whole-prompt steps prefill it first."""
    from types import SimpleNamespace

    from bench.sim_engine import SimLimits, StepModel, simulate
    from toppings.server.sched.queueing import FcfsQueue

    trace = [SimpleNamespace(prompt=[0] * 2000, max_tokens=8, arrival_s=0.0, model="a")]
    trace += [SimpleNamespace(prompt=[0] * 20, max_tokens=8, arrival_s=0.001 * (i + 1),
                              model="a") for i in range(8)]  # fmt: skip
    ttfts = {}
    for budget in (None, 256):
        sized = budget and StepBudget(budget, 0.0, "test")
        limits = SimLimits(1 << 20, 16, 8192, {"a": 8}, budget=sized)
        records = simulate(FcfsQueue(SchedulingConfig(), 1 << 20), limits, trace, StepModel())
        assert len(records) == len(trace) and all(t > 0 for t, _, _ in records)
        ttfts[budget] = [t + e.arrival_s for (t, _, _), e in zip(records, trace)]  # first token
    assert all(t < ttfts[256][0] for t in ttfts[256][1:])
    assert all(t >= ttfts[None][0] for t in ttfts[None][1:])


def test_a_squashed_partly_prefilled_request_leaves_the_step_and_starts_over():
    """A policy that squashes a running request mid-prompt (as Chameleon squashes a bypasser):
    it computes nothing in that step and, admitted again, prefills from the start of what is
    not cached."""
    from toppings.server.sched.queueing import FcfsQueue

    class SquashOnce(FcfsQueue):
        victim = None

        def select(self, gate, running, now):
            if self.victim is not None and self.victim in running:
                gate.squash(self.victim)
                self.push(self.victim, now)
                self.victim = None
                return []
            return super().select(gate, running, now)

    queue = SquashOnce(SchedulingConfig(), 4096 * BLOCK)
    sched, memory, adapters = make_chunked(budget=20, max_batch=8, queue=queue)
    long = submit(sched, prompt_len=50, max_new=2, ignore_eos=True)
    other = submit(sched, prompt_len=10, max_new=2, ignore_eos=True)
    assert tokens_of(step(sched)) == {long: 20}
    queue.victim = long
    plan = step(sched)
    assert plan is None and long.num_prefilled == 0 and long in queue and not sched.running
    # It waits again in its place, ahead of `other` (which arrived after it), and prefills from
    # the start; then the shorter `other` shares the room with what it has left.
    assert tokens_of(step(sched)) == {long: 20}
    assert tokens_of(step(sched)) == {long: 10, other: 10}
    while sched.has_work():
        step(sched)
    assert long.output_ids == [5, 5] and other.output_ids == [5, 5]
    assert memory.reserved == 0 and all(n == 0 for n in adapters.refs.values())


def test_the_step_model_is_fitted_through_measured_points():
    from types import SimpleNamespace

    def points(decode, mixed, chunk):
        return SimpleNamespace(decode_ms=decode, mixed_ms=mixed, chunk_ms=chunk, mixed_rows=32,
                               chunk_tokens=32, gemm_ms={}, describe=lambda: "")  # fmt: skip

    # decode: 10 + 0.5 B; beside 32 decodes (26 ms) a prompt token 40/128 ms and each decode
    # row 0.25 ms more than in a decode step; a 32-token chunk 32 ms more after 1,024 tokens
    got = StepTimeModel.fit(points({1: 10.5, 16: 18.0, 32: 26.0}, {32: 44.0, 160: 84.0},
                                   {0: 20.0, 1024: 52.0}))  # fmt: skip
    assert got.decode_ms_per_request == pytest.approx(0.5, abs=0.01)
    assert got.decode_ms == pytest.approx(10.0, abs=0.1)
    assert got.ms_per_token == pytest.approx(40 / 128)
    assert got.mixed_ms_per_request == pytest.approx(0.25, abs=0.01)
    assert got.mixed_step_ms(32, 100) == pytest.approx(26.0 + 32 * 0.25 + 100 * 40 / 128, 0.01)
    assert got.ms_per_token_past == pytest.approx(32 / 1024 / 32)
    assert got.past_weight() == pytest.approx(got.ms_per_token_past / got.ms_per_token)
    # timing noise that makes a slope negative is never a negative cost; a prompt token then
    # costs what the chunk alone took beyond a decode step of one (20 - 10 ms for 32 tokens)
    noisy = StepTimeModel.fit(points({1: 10.0, 8: 9.9}, {32: 20.0, 160: 19.0}, {0: 20.0}))
    assert noisy.decode_ms_per_request == 0.0
    assert noisy.ms_per_token == pytest.approx(10 / 32, rel=0.01)
    assert noisy.ms_per_token_past == 0.0  # one chunk point: no past term


def test_a_disturbed_start_up_does_not_make_prompt_tokens_free():
    """Points a start-up beside a busy neighbour measured (bf16 int4 SmolLM2, 2-core EPYC):
    128 decodes beside 160 prompt tokens faster than beside 32. The fit took a prompt token as
    free (1e-6 ms), the past's weight as 720 and the budget as one token a step; now a token
    costs what the 32-token chunk took beyond a decode step, and a prompt alone gets its chunk."""
    from types import SimpleNamespace

    measured = SimpleNamespace(
        decode_ms={1: 13.58, 64: 427.09, 128: 709.30}, chunk_ms={0: 49.07, 1024: 72.77},
        mixed_ms={32: 794.08, 160: 686.43}, mixed_rows=128, chunk_tokens=32, gemm_ms={},
        describe=lambda: "measured",
    )  # fmt: skip
    model = StepTimeModel.fit(measured)
    assert 0.5 < model.ms_per_token < 2.0  # (49.07 - a decode step of one) / 32
    assert model.past_weight() < 0.01
    limits = GateLimits(128, 8192).with_budget(choose_step_budget(128, 8192, model=model))
    alone = limits.step_tokens(0)  # a prompt with no stream decoding beside it
    assert limits.chunk_within(alone, 0) >= 128  # a 128-token prompt in one step


def test_a_token_counts_more_of_the_budget_the_longer_its_past():
    limits = GateLimits(8, 8192, 100, past_weight=0.001)
    assert limits.chunk_cost(10, 0) == math.ceil(10 * (1 + 0.001 * 4.5))
    assert limits.chunk_cost(10, 2000) == math.ceil(10 * (1 + 0.001 * 2004.5))  # 3x
    for past in (0, 100, 2000, 7000):
        for cost in (1, 16, 100, 500):
            n = limits.chunk_within(cost, past)
            assert n >= 1 and (limits.chunk_cost(n, past) <= cost or n == 1)
            assert limits.chunk_cost(n + 1, past) > cost  # the most that fits
    plain = GateLimits(8, 8192, 100)
    assert plain.chunk_cost(10, 2000) == 10 and plain.chunk_within(37, 2000) == 37


def test_a_scored_chunk_counts_its_rows_through_the_lm_head():
    limits = GateLimits(8, 8192, 100, past_weight=0.001, scored_weight=0.25)
    assert limits.chunk_cost(10, 0, scored=True) == math.ceil(limits.chunk_cost(10, 0) * 1.25)
    for past in (0, 100, 2000):
        for cost in (1, 16, 100, 500):
            n = limits.chunk_within(cost, past, scored=True)
            assert n >= 1 and (limits.chunk_cost(n, past, True) <= cost or n == 1)
            assert limits.chunk_cost(n + 1, past, True) > cost  # the most that fits
            assert n <= limits.chunk_within(cost, past)


def test_a_scored_prompt_takes_smaller_chunks_and_no_step_passes_the_budget():
    """A request scoring its prompt (prompt_logprobs: each row through the LM head) takes a
    quarter fewer prompt tokens of a step whose head costs a quarter of a token's layers; the
    step's cost, its scored rows priced, stays within the budget."""
    from toppings.server.requests.request import GenerationRequest, RequestHandle, SamplingParams
    from toppings.server.requests.sequence import Sequence

    sched, _, _ = make_chunked(budget=100, max_batch=8)
    sched.limits = replace(sched.limits, scored_weight=0.25)
    stream = submit(sched, prompt_len=4, max_new=50, ignore_eos=True)
    step(sched)
    params = SamplingParams(2, temperature=0.0, prompt_logprobs=1)
    request = GenerationRequest(list(range(2, 402)), params, None)
    scored = Sequence(request, RequestHandle(request, lambda _id: None), Tokenizer(), 0.0)
    sched.add(scored)
    plan = step(sched)
    assert tokens_of(plan) == {stream: 1, scored: 79}  # (100 - 1) / 1.25
    submit(sched, prompt_len=400, max_new=2, ignore_eos=True)  # a plain prompt shares the room
    while not scored.output_ids:
        plan = step(sched)
        chunks = tokens_of(plan)
        cost = sum(
            sched.limits.chunk_cost(n, 0, scored=s.scores_prompt) if not s.is_prefilled else n
            for s, n in chunks.items()
        )
        assert cost <= 100 or len(chunks) == 1


def test_late_chunks_of_a_long_prompt_are_smaller_and_no_step_costs_more_than_the_budget():
    sched, _, _ = make_chunked(budget=100, max_batch=8, past_weight=0.002, tile_stall=TILE_STALL)
    limits = sched.limits
    streams = [submit(sched, prompt_len=4, max_new=400, ignore_eos=True) for _ in range(4)]
    step(sched)
    long = submit(sched, prompt_len=2000, max_new=1, ignore_eos=True)
    sizes = []
    while not long.output_ids:
        past = long.num_prefilled
        plan = step(sched)
        got = tokens_of(plan)
        cost = sum(n if s is not long else limits.chunk_cost(n, past) for s, n in got.items())
        assert all(got[s] == 1 for s in streams)
        # within the budget, but for a chunk raised to a tile (server.sched.tiles): 2x at most
        raised = got[long] == min(ATTENTION_TILE, 2000 - past)
        assert cost <= 100 or (raised and cost <= TILE_STALL * 100)
        sizes.append(got[long])
    assert sizes[0] == limits.chunk_within(96, 0) == 88  # 96 planned, its own tokens' past
    # after ~1900 tokens of past a token counts ~5x: the budget's 19 are raised to a tile
    # the last ~1,500 tokens in whole tiles, and the tail of under a tile in one step
    assert limits.chunk_within(96, 1900) < ATTENTION_TILE == sizes[-2] < sizes[0] / 2
    assert sizes[-1] < ATTENTION_TILE and set(sizes[-40:-1]) == {ATTENTION_TILE}
    assert len(sizes) == 55  # before: 64, in rows chunks of 19-46 tokens from a past of 500 on
    assert sum(sizes) == 2000


@pytest.mark.parametrize("policy", ["fcfs", "chameleon"])
def test_a_short_prompt_is_not_held_for_a_long_prompts_whole_prefill(policy):
    sched, memory, adapters = make_chunked(budget=100, max_batch=8, policy=policy)
    streams = [submit(sched, prompt_len=4, max_new=200, ignore_eos=True) for _ in range(4)]
    step(sched)
    long = submit(sched, prompt_len=2000, max_new=1, ignore_eos=True)
    step(sched)
    assert 0 < long.num_prefilled < 2000
    short = submit(sched, prompt_len=30, max_new=1, ignore_eos=True)
    for _ in range(3):
        before = long.num_prefilled
        got = tokens_of(step(sched))
        assert got[long] > 0 and long.num_prefilled > before, "the long prompt keeps advancing"
        assert all(got[s] == 1 for s in streams) and sum(got.values()) <= 100
        if short.output_ids:
            break
    assert short.output_ids and not long.output_ids  # served within a few steps, long still going
    while sched.has_work():
        step(sched)
    assert long.output_ids and memory.reserved == 0
    assert all(n == 0 for n in adapters.refs.values())


def test_a_medium_prompt_shares_the_room_with_an_older_longer_one():
    # vLLM's partial prefills: a 300-token prompt behind a 2,000-token one is not held for the
    # long one's whole prefill (40 steps here), nor does it stop the long one (FCFS; chameleon
    # shares a step by its queues' quotas: test_step_quotas.py)
    sched, memory, _ = make_chunked(budget=100, max_batch=8)
    streams = [submit(sched, prompt_len=4, max_new=300, ignore_eos=True) for _ in range(4)]
    step(sched)
    long = submit(sched, prompt_len=2000, max_new=1, ignore_eos=True)
    step(sched)
    medium = submit(sched, prompt_len=300, max_new=1, ignore_eos=True)
    steps = 0
    while not medium.output_ids:
        before = long.num_prefilled
        got = tokens_of(step(sched))
        steps += 1
        assert long.num_prefilled > before, "the long prompt keeps advancing"
        assert all(got[s] == 1 for s in streams) and sum(got.values()) <= 100
    assert steps <= 2 * math.ceil(300 / 48) and not long.output_ids
    while sched.has_work():
        step(sched)
    assert long.output_ids and memory.reserved == 0


def test_a_prompt_no_shorter_than_what_the_older_one_has_left_waits_its_turn():
    sched, _, _ = make_chunked(budget=100, max_batch=8)
    long = submit(sched, prompt_len=2000, max_new=1, ignore_eos=True)
    step(sched)
    other = submit(sched, prompt_len=2500, max_new=1, ignore_eos=True)
    got = tokens_of(step(sched))
    assert got[long] == 100 and other not in got  # FCFS: the older prompt first
    # two equal prompts admitted together: the older one first, the other from what it leaves
    sched, _, _ = make_chunked(budget=100, max_batch=8)
    first, second = (submit(sched, prompt_len=150, max_new=1, ignore_eos=True) for _ in range(2))
    got = tokens_of(step(sched))
    assert got == {first: 100}
    got = tokens_of(step(sched))
    assert got[first] == 50 and got[second] == 50 and first.output_ids


@pytest.mark.parametrize("past_weight", [0.0, 0.001])
def test_a_short_prompt_shares_even_a_budget_smaller_than_two_min_chunks(past_weight):
    # 16 prompt tokens beside 2 decodes (a busy machine's refit put the budget at its floor):
    # the short prompt gets half of them, not nothing until the long one's last chunk
    sched, memory, _ = make_chunked(budget=2 + MIN_CHUNK, max_batch=8, past_weight=past_weight)
    streams = [submit(sched, prompt_len=4, max_new=400, ignore_eos=True) for _ in range(2)]
    step(sched)
    long = submit(sched, prompt_len=2000, max_new=1, ignore_eos=True)
    step(sched)
    short = submit(sched, prompt_len=24, max_new=1, ignore_eos=True)
    steps = 0
    while not short.output_ids:
        before = long.num_prefilled
        got = tokens_of(step(sched))
        steps += 1
        assert long.num_prefilled > before, "the long prompt keeps advancing"
        assert all(got[s] == 1 for s in streams) and sum(got.values()) <= 2 + MIN_CHUNK
    # half the room a step (a token less of it after a past), once admitted
    assert steps <= math.ceil(24 / (MIN_CHUNK // 2 - 1)) + 1 and not long.output_ids
    while sched.has_work():
        step(sched)
    assert long.output_ids and memory.reserved == 0


def test_beside_any_decodes_a_chunk_keeps_the_gemms_efficient_size():
    """Beside any number of decodes a chunk is at least GEMM_TOKENS prompt tokens (no ladder
    measured) where the target leaves fewer; where the target leaves more, the target's. The
    floor is a number of tokens: a machine 4x slower keeps it (the target's budget, in
    milliseconds, shrinks there)."""
    cpu = StepTimeModel(ms_per_token=0.6, decode_ms=20.0, decode_ms_per_request=2.0,
                        mixed_fixed_ms=10.0, batch_size=4)  # fmt: skip
    budget = choose_step_budget(32, 8192, model=cpu)
    target = [b + int((ITL_TARGET_MS - 30 - 2 * b) / 0.6) for b in range(33)]  # 150 ms a step
    assert target[4] < 4 + GEMM_TOKENS == budget.tokens
    limits = GateLimits(32, 8192).with_budget(budget)
    want = [8192, *(b + max(GEMM_TOKENS, target[b] - b) for b in range(1, 33))]
    assert [limits.step_tokens(b) for b in range(33)] == want
    slow = GateLimits(32, 8192).with_budget(choose_step_budget(32, 8192, model=scaled(cpu, 4.0)))
    assert [slow.step_tokens(b) for b in (1, 12, 32)] == [b + GEMM_TOKENS for b in (1, 12, 32)]
    roomy = choose_step_budget(32, 8192, itl_target_ms=400.0, model=cpu)  # the target's, past it
    assert roomy.tokens == 4 + int((400.0 - 30 - 2 * 4) / 0.6) > 4 + GEMM_TOKENS
    # a given target is the same rule
    tight = choose_step_budget(32, 8192, itl_target_ms=66.0, model=cpu)
    assert tight.few_decodes[1] == 1 + GEMM_TOKENS and tight.lone_tokens == 8192
    # the scheduler: a long prompt beside one stream gets the GEMM floor's chunk
    sched, memory, _ = make_chunked(budget=budget.tokens, max_batch=8)
    sched.set_step_budget(budget)
    stream = submit(sched, prompt_len=4, max_new=400, ignore_eos=True)
    step(sched)
    long = submit(sched, prompt_len=2000, max_new=1, ignore_eos=True)
    got = tokens_of(step(sched))
    assert got == {stream: 1, long: GEMM_TOKENS}
    while sched.has_work():
        step(sched)
    assert long.output_ids and memory.reserved == 0


def test_a_chunk_of_the_gemm_floor_keeps_its_rows_however_long_its_past():
    """Where the GEMM floor sets a step's budget, a long prompt's late chunks are of the floor's
    rows too: pricing their past cut them to 91-190 tokens beside 12 streams (2.5x a token of
    the whole prompt), the long prompt 1.19x its whole time. Where the target sets it, the past
    is priced as before: late chunks come out smaller."""
    cpu = StepTimeModel(ms_per_token=0.6, decode_ms=20.0, decode_ms_per_request=2.0,
                        mixed_fixed_ms=10.0, ms_per_token_past=0.0006, batch_size=4)  # fmt: skip
    floored = choose_step_budget(32, 8192, model=cpu)
    roomy = choose_step_budget(32, 8192, itl_target_ms=1000.0, model=cpu)
    assert floored.past_weight == pytest.approx(0.001) and 1 in floored.gemm_steps
    assert 1 not in roomy.gemm_steps and 0 not in floored.gemm_steps  # whole prompts there

    def chunks(budget, prompt_len=2000):
        sched, memory, _ = make_chunked(budget=budget.tokens, max_batch=8)
        sched.set_step_budget(budget)
        stream = submit(sched, prompt_len=4, max_new=800, ignore_eos=True)
        step(sched)
        long = submit(sched, prompt_len=prompt_len, max_new=1, ignore_eos=True)
        sizes, priced = [], GateLimits(8, 8192, 1, floored.past_weight)
        while not long.output_ids:
            past = long.num_prefilled
            got = tokens_of(step(sched))
            assert got[stream] == 1
            sizes.append(got[long])
            if budget is floored and past + got[long] < prompt_len:  # within the stall bound
                assert priced.chunk_cost(got[long], past) <= FLOOR_STALL * GEMM_TOKENS
        while sched.has_work():
            step(sched)
        assert memory.reserved == 0 and sum(sizes) == prompt_len
        return sizes

    assert chunks(floored) == [GEMM_TOKENS] * 7 + [2000 - 7 * GEMM_TOKENS]
    late = chunks(roomy)
    assert late[0] > GEMM_TOKENS and late[1] < late[0] * 0.7  # the past priced: 1,055 then 672
    # a past several times longer: its steps of the floor's rows would cost over FLOOR_STALL
    # budgets each; the chunks shrink, priced within that
    very = chunks(floored, prompt_len=12000)
    assert very[:10] == [GEMM_TOKENS] * 10 and max(very[-10:-1]) < GEMM_TOKENS / 2


# The refit's model of a real engine (bf16 SmolLM2, 2-core EPYC, a busy neighbour) one step after
# a 2,989-token prompt arrived beside no stream: its first chunks took 2-3x what the model said,
# and the joint fit put the misfit in the fixed extra of steps with prompt tokens (18 -> 108 ms)
DISTURBED = StepTimeModel(
    ms_per_token=0.47512, decode_ms=16.03175, decode_ms_per_request=1.91138,
    ms_per_token_past=0.00038, mixed_fixed_ms=107.64182, batch_size=1,
)  # fmt: skip


@pytest.mark.parametrize("fixed_ms", [0.0, 17.6, 107.6, 400.0])
def test_every_step_with_decodes_is_planned_within_the_stall_bound(fixed_ms):
    """Whatever a step's fitted fixed cost, a step a stream waits on is given no more prompt
    tokens than keep its modelled time within TILE_STALL x the inter-token target (or the
    budget's own floor): the fixed-share rule for steps of few decodes turned a larger fitted
    fixed cost into a larger budget (1,059 tokens beside one stream: a 1.4 s gap). Now a step
    has the tokens of the target, of the fixed-cost floor or of the GEMM floor (a constant),
    whichever is more: a larger fitted fixed cost moves only the fixed-cost floor, by what the
    cost is worth in tokens (a step at most twice its fixed cost), never past that."""
    model = replace(DISTURBED, mixed_fixed_ms=fixed_ms)
    budget = choose_step_budget(32, 8192, model=model)
    stall_ms = TILE_STALL * budget.itl_target_ms
    limits = GateLimits(32, 8192).with_budget(budget)
    for b in range(1, 33):
        target = b + model.prompt_tokens_within(budget.itl_target_ms, b)
        floor = b + max(MIN_CHUNK, model.overhead_tokens())
        gemm = b + model.gemm_tokens(b)
        assert limits.step_tokens(b) == max(target, floor, gemm)
        if limits.step_tokens(b) == target > max(floor, gemm):
            assert model.mixed_step_ms(b, target - b) <= stall_ms
    # the scheduler: a long prompt arriving beside one stream
    sched, memory, _ = make_chunked(budget=budget.tokens, max_batch=8)
    sched.set_step_budget(budget)
    stream = submit(sched, prompt_len=4, max_new=400, ignore_eos=True)
    step(sched)
    long = submit(sched, prompt_len=2989, max_new=1, ignore_eos=True)
    while not long.output_ids:
        got = tokens_of(step(sched))
        assert got[stream] == 1
        chunk = got[long]
        if chunk > max(budget.tokens, ATTENTION_TILE):
            assert model.mixed_step_ms(1, chunk) <= stall_ms
    while sched.has_work():
        step(sched)
    assert memory.reserved == 0


def test_a_step_whose_fixed_cost_alone_passes_the_stall_bound_does_work_worth_it():
    """The refit's model of a real engine (bf16 SmolLM2, 2-core EPYC at a load of 3): steps with
    prompt tokens cost 126 ms more than decode steps of 17-21 ms, beyond the stall bound (2 x a
    63 ms target) before any prompt token. The budget held the long prompt at its floor (16
    prompt tokens a step: 20.8 s to its first token where unchunked took 4.4 s); its floor is now
    the prompt tokens whose work equals the step's fixed cost, the extra of a step with prompt
    tokens included: such a step is at most twice its fixed cost."""
    busy = StepTimeModel(
        ms_per_token=1.61669, decode_ms=16.33613, decode_ms_per_request=2.39658,
        ms_per_token_past=0.00025, mixed_fixed_ms=126.49033, batch_size=2,
    )  # fmt: skip
    budget = choose_step_budget(32, 8192, itl_target_ms=63.0, model=busy)
    assert busy.mixed_step_ms(2, 1) > TILE_STALL * budget.itl_target_ms
    limits = GateLimits(32, 8192).with_budget(budget)
    assert all(limits.step_tokens(b) == b + GEMM_TOKENS for b in (1, 2, 3, 9, 12))  # its floor
    # a machine without that floor: a chunk's work is worth the step's overhead
    budget = choose_step_budget(32, 8192, itl_target_ms=63.0, model=unfloored(busy))
    limits = GateLimits(32, 8192).with_budget(budget)
    for b in (9, 10, 12):
        work = (limits.step_tokens(b) - b) * busy.ms_per_token
        assert work >= busy.decode_ms + busy.mixed_fixed_ms
        assert busy.mixed_step_ms(b, limits.step_tokens(b) - b) <= 2.1 * busy.mixed_step_ms(b, 1)


def test_a_short_prompt_is_not_held_behind_a_second_long_one_waiting():
    # a long prompt being prefilled, a longer one waiting behind it, then a short one: the short
    # one shares the room within a few steps, not after the first long prompt's whole prefill
    sched, memory, _ = make_chunked(budget=100, max_batch=8)
    streams = [submit(sched, prompt_len=4, max_new=300, ignore_eos=True) for _ in range(4)]
    step(sched)
    first = submit(sched, prompt_len=2000, max_new=1, ignore_eos=True)
    step(sched)
    second = submit(sched, prompt_len=2500, max_new=1, ignore_eos=True)
    step(sched)
    short = submit(sched, prompt_len=30, max_new=1, ignore_eos=True)
    steps = 0
    while not short.output_ids:
        before = first.num_prefilled
        got = tokens_of(step(sched))
        steps += 1
        assert first.num_prefilled > before, "the first long prompt keeps advancing"
        assert all(got[s] == 1 for s in streams) and sum(got.values()) <= 100
    assert steps <= 4 and not first.output_ids and not second.output_ids
    while sched.has_work():
        step(sched)
    assert first.output_ids and second.output_ids and memory.reserved == 0


def test_the_gemm_floor_is_where_the_products_reach_their_rate_per_row():
    """The fewest rows of the ladder whose products cost at most GEMM_SLACK more a row than the
    cheapest: 2,048 where a row costs 1.5x below ~1,344 rows (an AMX Xeon's oneDNN products,
    SmolLM2's shapes, 2 threads), 256 where the rate is flat from there, GEMM_TOKENS unmeasured.
    A size a neighbour slowed (best of its repeats still slow) raises the floor at most to the
    next size that measured its rate, never lowers it; a budget log names the floor."""
    amx = {256: 1.23, 512: 2.36, 1024: 4.50, 2048: 6.04}  # ms, the projections
    flat = {256: 3.9, 512: 7.6, 1024: 15.1, 2048: 30.0}
    assert gemm_floor(amx) == 2048 and gemm_floor(flat) == 256 and gemm_floor({}) == GEMM_TOKENS
    assert gemm_floor({**flat, 256: 3.9 * 3}) == 512 and gemm_floor({**flat, 2048: 90.0}) == 256
    assert gemm_floor({256: float("inf"), 512: 7.6}) == 512
    points = SimpleNamespace(decode_ms={1: 20.0, 8: 30.0, 16: 40.0}, chunk_ms={0: 40.0},
                             mixed_ms={32: 60.0, 160: 110.0}, mixed_rows=16, chunk_tokens=32,
                             gemm_ms=amx, describe=lambda: "measured")  # fmt: skip
    model = StepTimeModel.fit(points)
    assert model.gemm_floors == ((0, 2048),)
    budget = choose_step_budget(16, 8192, model=replace(model, batch_size=2))
    limits = GateLimits(16, 8192).with_budget(budget)
    assert [limits.step_tokens(b) for b in (1, 2, 9, 16)] == [2049, 2050, 9 + 2048, 16 + 2048]
    assert "chunks of at least 2048 tokens" in budget.how
    ceiling = choose_step_budget(16, 1024, model=replace(model, batch_size=2))
    assert ceiling.tokens == 1024  # never past the prompt ceiling


def test_the_gemm_floor_counts_the_decode_step_each_chunk_carries():
    """A chunk's step also carries the decodes beside it: the floor is where the products plus
    that step cost at most GEMM_SLACK more a prompt token than the cheapest. The 2-core EPYC's
    bf16 SmolLM2 (the projections of its 30 layers 142 / 264 / 521 / 1,038 ms at 256 / 512 /
    1,024 / 2,048 rows, a decode step of 8 about 14.5 ms): the products alone put the floor at
    256 (1.10x the cheapest rate), with the step 256 is 1.19x a token and 512 1.06x. No step, a
    step that is not a time, a negative one: the products alone. The floor grows with the
    decodes a step carries (at least FEW_DECODES' step): with a decode step of 9.2 + 0.8 ms a
    request, 512 up to 49 decodes, 1,024 from 50 (a 49 ms step makes 512 1.151x a token), 2,048
    from 213; the budget of every batch keeps it."""
    epyc = {256: 142.0, 512: 264.0, 1024: 521.0, 2048: 1038.0}
    assert gemm_floor(epyc) == 256 and gemm_floor(epyc, 14.5) == 512
    assert gemm_floor(epyc, 150.0) == 1024  # a dear step wants longer chunks still
    for step in (0.0, -5.0, float("nan"), float("inf")):
        assert gemm_floor(epyc, step) == 256
    points = SimpleNamespace(decode_ms={1: 9.0, 64: 62.0, 128: 110.0}, chunk_ms={0: 30.0},
                             mixed_ms={32: 130.0, 160: 200.0}, mixed_rows=128, chunk_tokens=32,
                             gemm_ms=epyc, describe=lambda: "measured")  # fmt: skip
    model = StepTimeModel.fit(points)
    assert model.gemm_floors == ((0, 512), (50, 1024), (213, 2048))
    assert [model.gemm_tokens(d) for d in (0, 1, 8, 49, 50, 212, 213, 10_000)] == [
        512, 512, 512, 512, 1024, 1024, 2048, 2048]  # fmt: skip
    budget = choose_step_budget(64, 8192, model=replace(model, batch_size=2))
    limits = GateLimits(64, 8192).with_budget(budget)
    assert [limits.step_tokens(b) for b in (1, 49, 50, 64)] == [513, 49 + 512, 50 + 1024, 1088]
    assert budget.how.endswith("chunks of at least 512 tokens, 1024 beside 50 decodes or more")
