"""A long prompt beside decoding streams on the real engine, with the step budget derived from a
step-time model that its refit corrects (server/sched/step_refit.py): every step while the
prompt is prefilled stays within the inter-token target and its prompt tokens within the
budget, and the prompt finishes in the steps the budget allows.

Deterministic: the engine (a tiny random Llama) is driven step by step, and the refit sees each
step's time as a known model (TRUE, SmolLM2 float32 on a 2-core CPU, roughly) gives it for the
step's shape instead of the tiny model's wall time, so no assertion rests on a timing. The
engine starts from a prior 10x too slow (a start-up measurement beside a busy neighbour)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.server.sched.test_chunked_schedule import unfloored
from toppings.server.config import EngineConfig
from toppings.server.engine.engine import Engine
from toppings.server.model.loader import load_checkpoint
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.requests.sequence import Sequence
from toppings.server.sched.gate_limits import GateLimits
from toppings.server.sched.plan import StepPlan
from toppings.server.sched.step_budget import GEMM_TOKENS, StepTimeModel
from toppings.server.sched.step_refit import StepRefit, StepShape, modelled_ms, scaled

TRUE = StepTimeModel(
    ms_per_token=1.0, decode_ms=60.0, decode_ms_per_request=2.0, ms_per_token_past=0.0004,
    mixed_ms_per_request=0.3, mixed_fixed_ms=5.0,
)  # fmt: skip
# the same machine without a GEMM floor (products that cost the same a row at any rows): the
# target sizes the steps beside the streams
UNFLOORED = unfloored(TRUE)
STREAMS, PROMPT = 16, 3000
TARGET_MS = 3 * TRUE.decode_step_ms(STREAMS)


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_long"), max_position_embeddings=4096)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_long_prompt_beside_16_streams_keeps_every_step_within_the_target(
    long_model_dir, monkeypatch, dtype
):
    observe = StepRefit.observe

    def observe_true(self, shape: StepShape, ms: float) -> StepTimeModel | None:
        return observe(self, shape, modelled_ms(TRUE, shape))  # the step as TRUE times it

    monkeypatch.setattr(StepRefit, "observe", observe_true)
    # a target of 3x TRUE's decode step beside 16 streams (276 ms), which prompt tokens fit
    # under: at the default (150 ms) TRUE's fixed-cost floor sizes these steps, not the target
    config = EngineConfig(dtype=dtype, max_total_tokens=8192, max_batch_size=32,
                          chunked_prefill=True, max_prefill_tokens=4096,
                          itl_target_ms=TARGET_MS)  # fmt: skip
    prior = scaled(UNFLOORED, 10.0)
    engine = Engine(config, load_checkpoint(str(long_model_dir)), step_model=prior)
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)
    try:
        for _ in range(STREAMS):
            prompt = torch.randint(3, 200, (8,), generator=gen).tolist()
            engine.submit(GenerationRequest(prompt, params))
        for _ in range(12):  # the streams decode; the refit corrects the prior from their steps
            engine.step()
        decoding = list(engine.scheduler.running)
        assert len(decoding) == STREAMS and all(s.output_ids for s in decoding)
        long_prompt = torch.randint(3, 200, (PROMPT,), generator=gen).tolist()
        engine.submit(GenerationRequest(long_prompt, SamplingParams(max_new_tokens=2)))
        steps, long_seq, past = 0, None, 0
        while True:
            budget, model = engine.step_budget, engine.step_model
            before = [len(s.output_ids) for s in decoding]
            plan = engine.step()
            steps += 1
            assert [len(s.output_ids) for s in decoding] == [n + 1 for n in before]
            long_seq = long_seq or next(s for s in plan.seqs if s.prompt_len == PROMPT)
            tokens = long_seq.num_prefilled - past
            assert tokens > 0  # it advances every step
            shape = StepShape(STREAMS, tokens, tokens * (past + (tokens - 1) / 2))
            limits = GateLimits(config.max_batch_size, config.max_prefill_tokens)
            cost = limits.with_budget(budget).chunk_cost(tokens, past)
            assert STREAMS + cost <= budget.tokens  # the prompt tokens within the budget
            assert modelled_ms(model, shape) <= budget.itl_target_ms * 1.01  # and the target
            # the model the step was planned with is the machine's: so is the step's time
            assert modelled_ms(TRUE, shape) <= 1.1 * TARGET_MS
            past = long_seq.num_prefilled
            if long_seq.output_ids:
                break
        # each step takes two decode steps' worth of prompt work: ~170 tokens at its start,
        # fewer as its past grows (0.0004 x 3,000 = 1.2 ms more a token at its end): 28 steps
        # here, where the refit of before (a prior 10x too slow kept) took 39
        work = PROMPT * TRUE.ms_per_token + TRUE.ms_per_token_past * PROMPT**2 / 2
        spare = 2 * TRUE.decode_step_ms(STREAMS) - TRUE.mixed_fixed_ms - 0.3 * STREAMS
        assert math.ceil(work / spare) <= steps <= math.ceil(1.15 * work / spare)
    finally:
        engine.shutdown()


def test_short_prompts_behind_a_long_one_beside_one_stream_get_their_first_tokens_at_once(
    long_model_dir, monkeypatch
):
    """One stream decodes, a 3,000-token prompt arrives, then three short prompts: each short one
    has its first token within a few steps of arriving (not after the long prompt), and the long
    one is computed in chunks of the GEMM floor beside one decode (GEMM_TOKENS:
    server.sched.step_budget), not in chunks that cost little more than the step's fixed cost;
    no step is more than a quarter of the long prompt's unchunked step."""
    observe = StepRefit.observe

    def observe_true(self, shape: StepShape, ms: float) -> StepTimeModel | None:
        return observe(self, shape, modelled_ms(TRUE, shape))

    monkeypatch.setattr(StepRefit, "observe", observe_true)
    config = EngineConfig(dtype="float32", max_total_tokens=8192, max_batch_size=32,
                          chunked_prefill=True, max_prefill_tokens=4096)  # fmt: skip
    engine = Engine(config, load_checkpoint(str(long_model_dir)), step_model=TRUE)
    gen = torch.Generator().manual_seed(5)
    try:
        stream_params = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
        engine.submit(GenerationRequest(torch.randint(3, 200, (8,), generator=gen).tolist(),
                                        stream_params))  # fmt: skip
        for _ in range(12):
            engine.step()
        (stream,) = engine.scheduler.running
        long_prompt = torch.randint(3, 200, (PROMPT,), generator=gen).tolist()
        engine.submit(GenerationRequest(long_prompt, SamplingParams(max_new_tokens=2)))
        engine.step()
        engine.step()
        shorts = [torch.randint(3, 200, (40,), generator=gen).tolist() for _ in range(3)]
        for prompt in shorts:
            engine.submit(GenerationRequest(prompt, SamplingParams(max_new_tokens=2)))
        first: dict[Sequence, int] = {}  # each prompt -> the step that gave its first token
        whole_ms = modelled_ms(TRUE, StepShape(1, PROMPT, PROMPT * (PROMPT - 1) / 2))
        steps = 2
        while not any(s.prompt_len == PROMPT for s in first):
            before = len(stream.output_ids)
            plan = engine.step()
            steps += 1
            assert len(stream.output_ids) == before + 1  # the stream decodes every step
            assert modelled_ms(TRUE, shape_run(plan)) <= 0.25 * whole_ms
            for seq, start, sampled in zip(plan.seqs, plan.starts, plan.samples):
                if sampled and start < seq.prompt_len:
                    first[seq] = steps
        short_steps = sorted(n for s, n in first.items() if s.prompt_len == 40)
        long_steps = max(first.values())
        assert len(short_steps) == 3 and short_steps[-1] <= 2 + 4 < long_steps
        # beside one decode a step's prompt work is GEMM_TOKENS tokens' (less after a past)
        chunk_ms = GEMM_TOKENS * TRUE.ms_per_token
        work = PROMPT * TRUE.ms_per_token + TRUE.ms_per_token_past * PROMPT**2 / 2
        work += 3 * 40 * TRUE.ms_per_token
        assert long_steps - 2 <= math.ceil(1.2 * work / chunk_ms)
    finally:
        engine.shutdown()


def shape_run(plan: StepPlan) -> StepShape:
    """The shape of a plan that has run (`starts`: each request's computed tokens before it)."""
    decodes = sum(1 for s, start in zip(plan.seqs, plan.starts) if start >= s.prompt_len)
    chunks = [(n, start) for s, n, start in zip(plan.seqs, plan.tokens, plan.starts)
              if start < s.prompt_len]  # fmt: skip
    past = sum(n * (start + (n - 1) / 2) for n, start in chunks)
    return StepShape(decodes, sum(n for n, _ in chunks), past)


def test_a_given_chunk_floor_reaches_the_engines_budget(long_model_dir):
    """`--chunk-floor-tokens` replaces the step model's GEMM floor (256 here) in the engine's
    budget, beside the few decodes the target sizes and the many it cannot."""
    config = EngineConfig(max_total_tokens=8192, max_batch_size=32, chunked_prefill=True,
                          chunk_floor_tokens=128)  # fmt: skip
    engine = Engine(config, load_checkpoint(str(long_model_dir)), step_model=TRUE)
    try:
        assert engine.step_model.gemm_floors == ((0, 128),)
        assert "chunks of at least 128 tokens" in engine.step_budget.how
        assert engine.step_budget.few_decodes[32 - 1] == 31 + 128  # the target allows fewer
    finally:
        engine.shutdown()
