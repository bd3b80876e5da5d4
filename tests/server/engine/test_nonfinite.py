"""An adapter whose LoRA product overflows fails its own requests, never its batch neighbours.

The adapter passes the load check and then turns non-finite: its device weights are set to 3e38
(a finite float32) after it was registered (prefill) or once its request runs in the decode
batch (decode), so x @ A overflows to inf and the request's logits become inf/NaN. That request ends
with an error naming the adapter; the base model's and other adapters' requests of the same
steps get the tokens a run without it gives, and the engine keeps serving.
"""

from __future__ import annotations

import time

import pytest

from tests.helpers import assert_memory_balanced
from toppings.scripts.make_adapters import make_random_adapter
from toppings.server import native
from toppings.server.config import EngineConfig
from toppings.server.engine.engine import Engine
from toppings.server.model.loader import load_checkpoint
from toppings.server.requests.request import GenerationRequest, SamplingParams

HUGE = 3e38  # finite in float32 and bfloat16; its product with any activation is not
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=8, temperature=0.8, seed=7, ignore_eos=True)
# (prompt, adapter, params): the bad adapter's request sits between healthy ones of the base and
# other adapters, greedy and seeded (a seeded request draws the same tokens in any batch).
JOBS = [
    ([5, 6, 7, 8, 9], None, GREEDY),
    ([11, 12, 13], "good", GREEDY),
    ([21, 22, 23, 24], "bad", SEEDED),
    ([31, 32, 33, 34, 35, 36], "other", SEEDED),
    ([41, 42], "good", GREEDY),
]
BAD = 2
HEALTHY = [i for i, job in enumerate(JOBS) if job[1] != "bad"]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite")
    specs = {"good": (8, ("q_proj", "v_proj")), "bad": (16, None), "other": (4, ("o_proj",))}
    dirs = {}
    for seed, (name, (rank, targets)) in enumerate(specs.items()):
        extra = {} if targets is None else {"target_modules": targets}
        dirs[name] = str(make_random_adapter(root / name, tiny_model_dir, rank=rank, seed=seed,
                                             **extra))  # fmt: skip
    return dirs


@pytest.fixture(params=["mbgmv", "bgmv", "torch paths"])
def engine(request, tiny_model_dir, adapter_dirs, monkeypatch):
    """An engine this test drives step by step (its thread is not started); every adapter is
    on the device from its registration (cached), so all requests share the first prefill.
    "torch paths": no native library, so attention (decode: a gather of every request's keys
    padded to the longest, masked) runs as on a machine where it is not built."""
    if request.param == "torch paths":
        monkeypatch.setattr(native, "library", lambda: None)
    kernel = "bgmv" if request.param == "bgmv" else "mbgmv"
    config = EngineConfig(dtype="float32", max_total_tokens=4096, kernel=kernel,
                          lora_mode="cached", prefix_cache=False)  # fmt: skip
    eng = Engine(config, load_checkpoint(str(tiny_model_dir)))
    for name, path in adapter_dirs.items():
        eng.add_adapter(name, path)
    yield eng
    eng.shutdown()


def drive(engine, on_step=lambda plan: None, timeout_s: float = 60.0) -> None:
    """Run steps until every submitted request ended (on_step sees each plan run)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        plan = engine.step()
        if plan is None:
            if not engine.scheduler.has_work():
                return
            time.sleep(0.002)  # an adapter load in flight
        else:
            on_step(plan)
    raise AssertionError("requests did not end in time")


def submit(engine, jobs):
    return engine.submit_all(
        [GenerationRequest(list(p), params, engine.resolve_adapter(a)) for p, a, params in jobs]
    )


def poison(engine) -> None:
    """Set the bad adapter's A rows on the device to HUGE in every projection and layer."""
    pool = engine.lora.pool
    resident = pool.resident[engine.resolve_adapter("bad").id]
    rows = slice(resident.offset, resident.offset + resident.rank)
    for module in resident.targets:
        pool.lora_a[module][:, rows].fill_(HUGE)


def pinned_blocks(engine) -> int:
    return engine.stats().to_json()["memory"]["blocks"]["adapters_in_use"]


def check(engine, outs, pinned: int) -> None:
    """The bad request failed with the clear error, the others ran to their length with the
    tokens of a run without it, nothing is left held, and the engine serves on."""
    bad = outs[BAD]
    assert bad.finish_reason == "error", bad
    assert "adapter 'bad' produced non-finite logits" in bad.error
    healthy = [outs[i] for i in HEALTHY]
    assert all(o.finish_reason == "length" and o.error is None for o in healthy), healthy
    reference_handles = submit(engine, [JOBS[i] for i in HEALTHY])
    drive(engine)
    reference = [h.result(timeout_s=1).new_token_ids for h in reference_handles]
    assert [o.new_token_ids for o in healthy] == reference
    assert engine.scheduler.finished.get("error") == 1
    assert_memory_balanced(engine, pinned)


def test_non_finite_logits_at_prefill_fail_that_request_alone(engine):
    pinned = pinned_blocks(engine)
    poison(engine)
    handles = submit(engine, JOBS)
    plans = []
    drive(engine, plans.append)
    outs = [h.result(timeout_s=1) for h in handles]
    assert outs[BAD].new_token_ids == []  # failed in its prefill, before any token
    assert any(p.is_prefill and len(p.seqs) == len(JOBS) for p in plans)  # one batch
    check(engine, outs, pinned)


def test_non_finite_logits_in_decode_fail_that_request_alone(engine):
    pinned = pinned_blocks(engine)
    handles = submit(engine, JOBS)
    poisoned = []

    def poison_after_prefill(plan) -> None:
        if plan.is_prefill and not poisoned:
            assert len(plan.seqs) == len(JOBS)  # one batch
            poison(engine)
            poisoned.append(plan)

    drive(engine, poison_after_prefill)
    outs = [h.result(timeout_s=1) for h in handles]
    assert poisoned and len(outs[BAD].new_token_ids) == 1  # its prefill token, then the error
    check(engine, outs, pinned)
