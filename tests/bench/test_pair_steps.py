"""bench/pair_steps.py pairs one side's decode step with the other's: each pair has one step of
each side, the warm-up round counts none, and the change is left on; the whole-step change flips
the decode path's one-call step."""

from __future__ import annotations

import pytest

from bench import pair_steps
from tests.server.model.tiny_families import make_tiny_family


@pytest.mark.parametrize(("change", "rank"), [("none", 0), ("whole-step", 4)])
def test_pairs_hold_one_step_of_each_side(tmp_path, monkeypatch, change, rank):
    model_dir = str(make_tiny_family(tmp_path / "llama3", "llama3"))
    args = pair_steps.parse_args(
        ["--change", change, "--rounds", "3", "--new-tokens", "7", "--prompt-len", "8"]
    )
    sides = []
    make_toggle = pair_steps.CHANGES[change]

    def spy(engine):
        path = engine.model.decode_path
        if change == "whole-step" and (path is None or not path.whole_step):
            pytest.skip("no whole-step native call here")
        toggle = make_toggle(engine)

        def recorded(on):
            toggle(on)
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
    if change == "whole-step":
        assert {on for on, _ in sides} == {whole for _, whole in sides} == {True, False}
        assert all(on == whole for on, whole in sides)
