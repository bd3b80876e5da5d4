"""bench/pair_steps.py pairs one side's decode step with the other's: each pair has one step of
each side, the warm-up round counts none, and the change is left on; the whole-step change flips
the decode path's one-call step, the scan-in-step change that call's scan of the logits; the
huge-pages and int8-weights changes swap in a second engine's decode path for one side's steps,
and shut that engine down with the first."""

from __future__ import annotations

import pytest

from bench import pair_steps
from tests.server.model.tiny_families import make_tiny_family

SWAPS = ("huge-pages", "int8-weights")  # changes that swap in a second engine's decode path
ONE_CALL = ("whole-step", "scan-in-step")  # changes of the one-call step's


@pytest.mark.parametrize(
    ("change", "rank"),
    [
        ("none", 0),
        ("whole-step", 4),
        ("scan-in-step", 0),
        ("huge-pages", 0),
        ("int8-weights", 0),
        ("int8-weights", 4),
    ],  # fmt: skip
)
def test_pairs_hold_one_step_of_each_side(tmp_path, monkeypatch, change, rank):
    model_dir = str(make_tiny_family(tmp_path / "llama3", "llama3"))
    args = pair_steps.parse_args(
        ["--change", change, "--rounds", "3", "--new-tokens", "7", "--prompt-len", "8"]
    )
    sides = []
    make_toggle = pair_steps.CHANGES[change]

    engines, stopped = [], []

    def spy(engine, build, keep):
        path = engine.model.decode_path
        if change in ONE_CALL and (path is None or not path.whole_step):
            pytest.skip("no whole-step native call here")
        if change in SWAPS and path is None:
            pytest.skip("no native decode path here")
        try:
            toggle = make_toggle(engine, build, keep)
        except SystemExit as e:  # the int8 engine's GEMV is not native here
            pytest.skip(str(e))
        engines.extend([engine, *keep])
        for made in engines:
            stop = made.shutdown
            made.shutdown = lambda made=made, stop=stop: (stopped.append(made), stop())

        def recorded(on):
            toggle(on)
            if change in SWAPS:  # whether the step runs the changed side's decode path
                own = engine.model.decode_path is path
                sides.append((on, own if change == "huge-pages" else not own))
            elif change == "scan-in-step":
                sides.append((on, path.scan_in_step))
            else:
                sides.append((on, path.whole_step if path is not None else None))

        return recorded

    monkeypatch.setitem(pair_steps.CHANGES, change, spy)
    metrics = pair_steps.run_one(args, model_dir, "bfloat16", rank)
    # 7 new tokens: the prompt's step gives the first, then 6 decode steps, 3 pairs a round
    assert metrics["pairs"] == 2 * 3
    # each round: the change on for the prompt, then its 6 decode steps in pairs A B, B A, A B
    assert len(sides) == 3 * 7 + 1
    for r in range(3):
        assert [on for on, _ in sides[7 * r : 7 * r + 7]] == [True, False, True, True, False,
                                                               False, True]  # fmt: skip
    assert sides[-1][0] is True  # the change is left on
    if change in (*ONE_CALL, *SWAPS):
        assert {on for on, _ in sides} == {flag for _, flag in sides} == {True, False}
        assert all(on == flag for on, flag in sides)
    if change in SWAPS:  # the second engine was made, and shut down with the first
        assert len(engines) == 2 and engines[1] is not engines[0]
        assert stopped == engines


def test_adapter_change_drops_the_rows_of_one_side_in_runs(tmp_path, monkeypatch):
    """--change adapter --block 2: the runner's LoRA step gets the request's entry on B steps
    and none on A steps, in runs of two (A A B B, B B A A, ...), and a pair is two runs."""
    model_dir = str(make_tiny_family(tmp_path / "llama3", "llama3"))
    args = pair_steps.parse_args(["--change", "adapter", "--rounds", "2", "--new-tokens", "9",
                                  "--prompt-len", "8", "--block", "2"])  # fmt: skip
    asked = []  # per forward pass: (the toggle's side, whether an adapter's entry was given)
    side = [True]
    make_toggle = pair_steps.CHANGES["adapter"]

    def spy(engine, build, keep):
        step = engine.runner.lora.step

        def recorded(entries, *a, **k):
            asked.append((side[0], any(entries)))
            return step(entries, *a, **k)

        engine.runner.lora.step = recorded
        toggle = make_toggle(engine, build, keep)
        return lambda on: (side.__setitem__(0, on), toggle(on))

    monkeypatch.setitem(pair_steps.CHANGES, "adapter", spy)
    metrics = pair_steps.run_one(args, model_dir, "bfloat16", 4)
    # 9 new tokens: the prompt's step gives the first, then 8 decode steps: 4 runs, 2 pairs
    assert metrics["pairs"] == 2
    assert all(on == has_entry for on, has_entry in asked)
    decode = [on for on, _ in asked[1:9]]  # round 0's decode steps
    assert decode == [False, False, True, True, True, True, False, False]
