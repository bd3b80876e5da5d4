"""bench/queueing_sim end to end on a short sweep: the headline keys land in its JSON, and
`--validate` against a result of the same setup finds every capacity within the 10% rule."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from bench.queueing_sim import main
from toppings.server.sched.step_budget import StepTimeModel

SLOWER = StepTimeModel(ms_per_token=3.0, decode_ms=200.0, decode_ms_per_request=8.0)
SHORT = ["--per-rank", "1", "--duration", "15", "--rounds", "1", "--loads", "0.5,1.0",
         "--alone", "2", "--burst", "6", "--max-output-len", "32"]  # fmt: skip


def sweep(tmp_path, **step_models) -> tuple[Path, dict]:
    """A short sweep's JSON and its content; step_models: as bench_queueing records them
    (each configuration's engine's model at the end), written into it."""
    out = tmp_path / "sim.json"
    main([*SHORT, "--out", str(out), "--plot", str(tmp_path / "sim.png")])
    result = json.loads(out.read_text())
    if step_models:
        result["metrics"]["step_models"] = step_models
        out.write_text(json.dumps(result))
    return out, result


def validate(real: Path, tmp_path) -> Path:
    """`--validate real` into tmp_path; the JSON it wrote."""
    checked = tmp_path / "validate.json"
    main(["--rounds", "1", "--validate", str(real), "--out", str(checked),
          "--plot", str(tmp_path / "validate.png")])  # fmt: skip
    return checked


def test_a_sweep_writes_the_headlines_and_validates_against_itself(tmp_path):
    out, result = sweep(tmp_path)
    metrics = result["metrics"]
    for key in ("sustained_load_ratio_vs_slora", "p99_ttft_ratio_vs_slora",
                "sustained_load_ratio_vs_fcfs", "p99_ttft_ratio_vs_fcfs_overload",
                "sustained_load_ratio_vs_slora_sync", "p99_ttft_ratio_vs_slora_sync"):  # fmt: skip
        assert key in metrics
    assert set(metrics["per_load"]) == {"slora", "slora-sync", "chameleon-nocache",
                                        "chameleon-nosched", "chameleon"}  # fmt: skip
    assert metrics["load_fractions_of_baseline_capacity"] == [0.5, 1.0, 1.25]
    assert (tmp_path / "sim.png").stat().st_size > 0
    checked = validate(out, tmp_path)
    validation = json.loads(checked.read_text())["metrics"]
    assert (tmp_path / "validate.png").stat().st_size > 0  # real and simulated points
    assert validation["capacity_rps"]["all_within"]
    assert set(validation["capacity_rps"]["per_config"]) == set(metrics["per_load"])
    assert all(r["ratio"] == 1.0 for r in validation["capacity_rps"]["per_config"].values())


def test_validation_runs_on_the_step_model_the_real_engines_ended_with(tmp_path):
    out, _ = sweep(tmp_path, slora=None, **{"chameleon-nosched": asdict(SLOWER)})
    checked = validate(out, tmp_path)
    result = json.loads(checked.read_text())
    assert "chameleon-nosched" in result["config"]["step_model"]["source"]
    assert result["config"]["step_model"]["decode_ms"] == 200.0
    per_config = result["metrics"]["capacity_rps"]["per_config"]
    assert all(r["ratio"] < 0.5 for r in per_config.values())  # slower steps, less capacity


def test_each_configuration_is_validated_on_its_own_engines_step_model(tmp_path):
    _, plain = sweep(tmp_path)
    same = {k: v for k, v in plain["config"]["step_model"].items()
            if k in StepTimeModel.__dataclass_fields__}  # fmt: skip
    out, _ = sweep(tmp_path, slora=asdict(SLOWER), **{"chameleon-nosched": same})
    checked = validate(out, tmp_path)
    per_config = json.loads(checked.read_text())["metrics"]["capacity_rps"]["per_config"]
    assert per_config["slora"]["ratio"] < 0.5  # its engine's slower steps
    # the others on chameleon-nosched's (the baseline's): the sim's own model but for the cost
    # of a step of prompt tokens alone, which an engine's model derives from its decode step
    assert all(abs(per_config[n]["ratio"] - 1) < 0.05 for n in per_config if n != "slora")
