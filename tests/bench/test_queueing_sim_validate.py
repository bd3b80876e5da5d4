"""bench/queueing_sim end to end on a short sweep: the headline keys land in its JSON, and
`--validate` against a result of the same setup finds every capacity within the 10% rule."""

from __future__ import annotations

import json
from dataclasses import asdict

from bench.queueing_sim import main
from toppings.server.sched.step_budget import StepTimeModel

SHORT = ["--per-rank", "1", "--duration", "15", "--rounds", "1", "--loads", "0.5,1.0",
         "--alone", "2", "--burst", "6", "--max-output-len", "32"]  # fmt: skip


def test_a_sweep_writes_the_headlines_and_validates_against_itself(tmp_path):
    out, plot = tmp_path / "sim.json", tmp_path / "sim.png"
    main([*SHORT, "--out", str(out), "--plot", str(plot)])
    metrics = json.loads(out.read_text())["metrics"]
    for key in ("sustained_load_ratio_vs_slora", "p99_ttft_ratio_vs_slora",
                "sustained_load_ratio_vs_fcfs", "p99_ttft_ratio_vs_fcfs_overload"):  # fmt: skip
        assert key in metrics
    assert set(metrics["per_load"]) == {"slora", "chameleon-nocache", "chameleon-nosched",
                                        "chameleon"}  # fmt: skip
    assert metrics["load_fractions_of_baseline_capacity"] == [0.5, 1.0, 1.25]
    assert plot.stat().st_size > 0
    checked = tmp_path / "validate.json"
    main(
        [
            "--rounds",
            "1",
            "--validate",
            str(out),
            "--out",
            str(checked),
            "--plot",
            str(tmp_path / "validate.png"),
        ]
    )
    validation = json.loads(checked.read_text())["metrics"]
    assert (tmp_path / "validate.png").stat().st_size > 0  # real and simulated points
    assert validation["capacity_rps"]["all_within"]
    assert set(validation["capacity_rps"]["per_config"]) == set(metrics["per_load"])
    assert all(r["ratio"] == 1.0 for r in validation["capacity_rps"]["per_config"].values())


def test_validation_runs_on_the_step_model_the_real_engines_ended_with(tmp_path):
    out = tmp_path / "sim.json"
    main([*SHORT, "--out", str(out), "--plot", str(tmp_path / "sim.png")])
    real = json.loads(out.read_text())
    slower = StepTimeModel(ms_per_token=3.0, decode_ms=200.0, decode_ms_per_request=8.0)
    real["metrics"]["step_models"] = {"slora": None, "chameleon-nosched": asdict(slower)}
    out.write_text(json.dumps(real))
    checked = tmp_path / "validate.json"
    main(
        [
            "--rounds",
            "1",
            "--validate",
            str(out),
            "--out",
            str(checked),
            "--plot",
            str(tmp_path / "validate.png"),
        ]
    )
    result = json.loads(checked.read_text())
    assert "chameleon-nosched" in result["config"]["step_model"]["source"]
    assert result["config"]["step_model"]["decode_ms"] == 200.0
    per_config = result["metrics"]["capacity_rps"]["per_config"]
    assert all(r["ratio"] < 0.5 for r in per_config.values())  # slower steps, less capacity


def test_each_configuration_is_validated_on_its_own_engines_step_model(tmp_path):
    out = tmp_path / "sim.json"
    main([*SHORT, "--out", str(out), "--plot", str(tmp_path / "sim.png")])
    real = json.loads(out.read_text())
    same = StepTimeModel(**{k: v for k, v in real["config"]["step_model"].items()
                            if k in StepTimeModel.__dataclass_fields__})  # fmt: skip
    slower = StepTimeModel(ms_per_token=3.0, decode_ms=200.0, decode_ms_per_request=8.0)
    real["metrics"]["step_models"] = {"slora": asdict(slower), "chameleon-nosched": asdict(same)}
    out.write_text(json.dumps(real))
    checked = tmp_path / "validate.json"
    main(
        [
            "--rounds",
            "1",
            "--validate",
            str(out),
            "--out",
            str(checked),
            "--plot",
            str(tmp_path / "validate.png"),
        ]
    )
    per_config = json.loads(checked.read_text())["metrics"]["capacity_rps"]["per_config"]
    assert per_config["slora"]["ratio"] < 0.5  # its engine's slower steps
    # the others on chameleon-nosched's (the baseline's): the sim's own model but for the cost
    # of a step of prompt tokens alone, which an engine's model derives from its decode step
    assert all(abs(per_config[n]["ratio"] - 1) < 0.05 for n in per_config if n != "slora")
