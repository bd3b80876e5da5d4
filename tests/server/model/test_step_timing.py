"""Step times measured at start-up (server/model/step_timing.py): the chunked-prefill budget
comes from this machine's measured steps, and measuring leaves the KV pool as it found it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.helpers import assert_memory_balanced
from toppings.server.model import step_timing
from toppings.server.model.step_timing import GEMM_LADDER, PROMPTS, gemm_times, measure_steps
from toppings.server.requests.request import GenerationRequest, SamplingParams


def generate(engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    handles = engine.submit_all([GenerationRequest(p, params) for p in prompts])
    return [h.result(timeout_s=60).new_token_ids for h in handles]


PROMPTS_IN = [[5 + i, 17, 33 + 2 * i, 9] * (3 + i) for i in range(4)]


def test_the_budget_comes_from_steps_measured_at_start_up(tiny_engine):
    with tiny_engine(chunked_prefill=True, max_batch_size=8) as engine:
        assert "measured at start-up" in engine.step_model.source
        assert engine.step_budget.tokens >= 8 + 16
        assert_memory_balanced(engine)  # every row and block taken for timing came back
        measured = generate(engine, PROMPTS_IN)
    with tiny_engine(chunked_prefill=True, max_batch_size=8, max_num_batched_tokens=64) as given:
        assert given.step_budget.tokens == 64
        assert "given by --max-num-batched-tokens" in given.step_budget.how
        assert generate(given, PROMPTS_IN) == measured


def test_the_points_are_timed_and_the_pool_is_given_back(tiny_engine):
    with tiny_engine(chunked_prefill=False, max_batch_size=8) as engine:
        free = engine.kv.num_free_blocks
        times = measure_steps(engine.model, engine.kv, 8)
        assert sorted(times.decode_ms) == [1, 4, 8]
        assert sorted(times.mixed_ms) == list(PROMPTS)
        assert times.mixed_rows == 8 and sorted(times.chunk_ms)[0] == 0
        assert sorted(times.gemm_ms) == list(GEMM_LADDER)
        measured = [times.decode_ms, times.mixed_ms, times.chunk_ms, times.gemm_ms]
        assert all(t > 0 for points in measured for t in points.values())
        assert engine.kv.num_free_blocks == free
        assert engine.kv.num_free_rows == len(engine.kv.lengths)
        assert_memory_balanced(engine)


@pytest.mark.parametrize("max_total_tokens", [96])
def test_a_pool_too_small_to_measure_keeps_the_default_model(tiny_engine, max_total_tokens):
    with tiny_engine(chunked_prefill=True, max_batch_size=4,
                     max_total_tokens=max_total_tokens) as engine:  # fmt: skip
        assert measure_steps(engine.model, engine.kv, 4) is None
        assert "not this machine's" in engine.step_model.source


def test_the_times_are_kept_and_read_at_the_next_start_up(tiny_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("TOPPINGS_CACHE", str(tmp_path))
    monkeypatch.delenv("TOPPINGS_STEP_TIMES", raising=False)
    with tiny_engine(chunked_prefill=False, max_batch_size=8) as engine:
        first = measure_steps(engine.model, engine.kv, 8)
        (kept,) = (tmp_path / "step_times").iterdir()
        again = measure_steps(engine.model, engine.kv, 8)
        assert first.cached_in is None and again.cached_in == str(kept)
        assert (again.decode_ms, again.mixed_ms, again.chunk_ms, again.gemm_ms) == (
            first.decode_ms, first.mixed_ms, first.chunk_ms, first.gemm_ms)  # fmt: skip
        assert "an earlier one's" in again.describe()
        # another batch size is another key; TOPPINGS_STEP_TIMES=measure measures again
        assert measure_steps(engine.model, engine.kv, 4).cached_in is None
        monkeypatch.setenv("TOPPINGS_STEP_TIMES", "measure")
        assert measure_steps(engine.model, engine.kv, 8).cached_in is None
        assert_memory_balanced(engine)


class _Projection:
    """A product whose call is cold where its last call had other rows (a primitive made)."""

    def __init__(self) -> None:
        self.in_features, self.rows, self.cold = 4, 0, False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.cold, self.rows = x.shape[0] != self.rows, x.shape[0]
        return x


def test_the_gemm_ladder_times_warm_products_and_counts_every_layer(monkeypatch):
    """Each timed call of the ladder comes right after one of its own shapes (a server bounds
    oneDNN's primitive cache to 16 shapes, the ladder's sizes in turn are 16: timed cold, every
    call paid a creation a step pays once for all its layers), and the time is the model's: one
    layer's, times its layers."""
    projections = [_Projection() for _ in range(4)]
    layer = SimpleNamespace(qkv=projections[0], o=projections[1], gate_up=projections[2],
                            down=projections[3])  # fmt: skip
    model = SimpleNamespace(layers=[layer] * 3, device="cpu", dtype=torch.float32)

    def timed(device, call) -> float:  # 1 ms a warm call, 100 a cold one
        call()
        return 100.0 if any(p.cold for p in projections) else 1.0

    monkeypatch.setattr(step_timing, "_once_ms", timed)
    assert gemm_times(model, torch.Generator()) == {n: 3.0 for n in GEMM_LADDER}


def test_a_forward_runs_before_the_first_request_and_gives_the_pool_back(tiny_engine, monkeypatch):
    """warm_forward: a prompt and a decode step run at start-up (with chunked prefill off no
    step is timed), so the first request meets no forward's one-time costs; every row and block
    comes back. Without a free row it runs nothing."""
    from toppings.server.model.llama import LlamaModel

    real, calls = LlamaModel.forward, []

    def counted(self, batch, kv, *args, **kwargs):
        calls.append((batch.is_prefill, batch.input_ids.numel()))
        return real(self, batch, kv, *args, **kwargs)

    monkeypatch.setattr(LlamaModel, "forward", counted)
    with tiny_engine(chunked_prefill=False, max_batch_size=4) as engine:
        assert calls == [(True, PROMPTS[0]), (False, 1)]
        assert engine.kv.num_free_rows == len(engine.kv.lengths)
        assert_memory_balanced(engine)
        rows = [engine.kv.new_row() for _ in range(engine.kv.num_free_rows)]
        assert not step_timing.warm_forward(engine.model, engine.kv)
        assert len(calls) == 2
        for row in rows:
            engine.kv.free_row(row)
        assert step_timing.warm_forward(engine.model, engine.kv) and len(calls) == 4
        assert_memory_balanced(engine)
