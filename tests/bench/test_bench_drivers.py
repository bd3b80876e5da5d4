"""Every benchmark driver under bench/ imports on a CPU and parses its arguments, so a refactor
that breaks one fails here rather than on a GPU session's few minutes; bench_cuda_graphs, whose
GPU run is the only one it has, also runs its CPU `--quick` (the eager engine, a few steps).

A driver is a module of bench/ with a top-level `main`; each is imported once, in process, and
`main(["--help"])` must print its usage and exit 0."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def drivers() -> list[str]:
    """The modules of bench/ that define a top-level `main` (read from their source, so that a
    driver that no longer imports is still listed, and fails)."""
    names = []
    for path in sorted(BENCH.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            names.append(path.stem)
    return names


DRIVERS = drivers()


def test_the_drivers_are_found():
    assert {"bench_cuda_graphs", "bench_kernels", "bench_cpu_assisted"} <= set(DRIVERS)


@pytest.mark.parametrize("name", DRIVERS)
def test_a_driver_imports_and_prints_its_usage(name, capsys):
    module = importlib.import_module(f"bench.{name}")
    params = list(inspect.signature(module.main).parameters)
    assert params[:1] == ["argv"], f"bench.{name}.main takes no argv: a test cannot drive it"
    source = (BENCH / f"{name}.py").read_text()
    assert 'if __name__ == "__main__":' in source, f"bench.{name} cannot run as python -m"
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out


def test_cuda_graphs_quick_runs_the_eager_engine_on_a_cpu(tiny_model_dir, tmp_path):
    from bench import bench_cuda_graphs

    out = tmp_path / "cuda_graphs.json"
    argv = ["--device", "cpu", "--quick", "--dtype", "float32", "--model", str(tiny_model_dir),
            "--adapter-dir", str(tmp_path / "adapters"), "--out", str(out)]  # fmt: skip
    returned = bench_cuda_graphs.main(argv)
    result = json.loads(out.read_text())
    assert result == returned
    assert result["name"] == "cuda_graphs"
    assert result["device"].startswith("cpu")
    assert result["config"]["quick"] and result["config"]["device"] == "cpu"
    metrics = result["metrics"]
    new_tokens = bench_cuda_graphs.QUICK["new_tokens"]
    assert set(metrics) == {"batch_1", "batch_2"}  # no graphs on a CPU: no capture counters
    for batch in metrics.values():
        assert "decode_step_ms_eager" in batch
        # the prompts fit one prefill step, which samples the first token: the rest are decodes
        assert batch["decode_steps_eager"] == [new_tokens - 1]
        assert not any("graphs" in key for key in batch)
    assert len(list((tmp_path / "adapters").iterdir())) == bench_cuda_graphs.QUICK["num_adapters"]


def test_host_overhead_quick_times_decode_steps_of_both_forwards(tmp_path):
    from bench import bench_host_overhead

    out = tmp_path / "host_overhead.json"
    result = bench_host_overhead.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    metrics = result["metrics"]
    for forward in bench_host_overhead.FORWARDS:
        per_batch = metrics[forward]["per_batch"]
        assert set(per_batch) == {"1", "8"}
        assert all(b["step_us"] > 0 and len(b["rounds"]) == 1 for b in per_batch.values())
    assert metrics["host_us_per_request"] == metrics["real"]["host_us_per_request"]


def test_async_scheduling_quick_compares_both_loops_on_a_stand_in_device(tmp_path):
    from bench import bench_async_scheduling

    out = tmp_path / "async_scheduling.json"
    result = bench_async_scheduling.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    metrics = result["metrics"]
    assert set(metrics["cases"]) == {"device_2ms_batch_1", "device_2ms_batch_8"}
    for case in metrics["cases"].values():
        assert case["sync_ms"] > 0 and case["async_ms"] > 0 and case["host_ms"] > 0
    assert metrics["step_ratio_async_vs_bound"] == max(
        round(c["async_vs_bound"], 3) for c in metrics["cases"].values()
    )


def test_prefix_routing_quick_runs_a_fleet_and_writes_its_metrics(tmp_path):
    from bench import bench_prefix_routing

    out = tmp_path / "prefix_routing.json"
    argv = ["--quick", "--adapter-dir", str(tmp_path / "adapters"), "--out", str(out)]
    result = bench_prefix_routing.main(argv)
    assert json.loads(out.read_text()) == result
    metrics = result["metrics"]
    assert 0.0 <= metrics["prefix_hit_rate"] <= 1.0
    assert 0.0 <= metrics["prefix_hit_rate_off"] <= 1.0
    for key in ("ttft_ratio_prefix_routing_vs_off", "checker_ttft_ratio_vs_base_same_prefix"):
        assert metrics[key]["median"] > 0 and len(metrics[key]["rounds"]) == 1
    quick = bench_prefix_routing.QUICK
    (on,) = metrics["rounds"]["on"]
    later = quick["adapters"] * (quick["turns"] - 1) + 2 * quick["pipelines"]
    assert on["num_later"] == later


def test_adapter_scale_quick_runs_every_mode_layout_and_assignment(tiny_model_dir, tmp_path):
    from bench import bench_adapter_scale as bench

    out = tmp_path / "adapter_scale.json"
    argv = ["--quick", "--model", str(tiny_model_dir), "--dtype", "float32",
            "--adapter-dir", str(tmp_path / "adapters"), "--out", str(out)]  # fmt: skip
    result = bench.main(argv)
    assert json.loads(out.read_text()) == result
    quick = bench.QUICK
    adapters = sorted(p.name for p in (tmp_path / "adapters").iterdir())
    assert adapters == sorted(bench.adapter_names(quick["num_adapters"]))
    contents = {(tmp_path / "adapters" / n / "adapter_model.safetensors").read_bytes()
                for n in adapters}  # fmt: skip
    assert len(contents) == len(adapters)  # each its own weights: no host copy is shared
    metrics = result["metrics"]
    assert set(metrics["modes"]) == {"on-demand", "cpu-assisted"}
    assert bench.DEFAULT_MODE == "cpu-assisted"  # what auto picks on a CPU: the top-level ratios
    assert metrics["layout"] == bench.DEFAULT_LAYOUT == "pool"  # the server's default layout
    default = metrics["modes"]["cpu-assisted"]
    for key in ("p99_ttft_ratio_distinct_vs_identical", "p99_ttft_ratio_zipf_vs_identical",
                "throughput_ratio_distinct_vs_identical"):  # fmt: skip
        assert metrics[key] == default[key] == default["layouts"]["pool"][key]
        assert key in default["layouts"]["static"]
    num = quick["num_requests"]
    every = [lay for m in metrics["modes"].values() for lay in m["layouts"].values()]
    assert len(every) == 4
    for layout in every:
        runs = {a: layout["assignments"][a]["runs"] for a in bench.ASSIGNMENTS}
        assert all(len(r) == quick["rounds"] for r in runs.values())
        for run in (r for rs in runs.values() for r in rs):
            assert run["num_requests"] == num
        # identical: every request names one adapter, so one resolution loads it for all
        assert runs["identical"][0]["server"]["lora_resolutions_loaded"] == 1
        # distinct: every request names an adapter no earlier one did
        distinct = runs["distinct"][0]["server"]
        tried = sum(v for k, v in distinct.items() if k.startswith("lora_resolutions_"))
        assert tried == num
        for bound in ("max_loading", "max_adapters"):  # the resolver's waits, by bound
            assert f"lora_resolver_wait_seconds_count_{bound}" in distinct
    refused = sum(p["num_refused"] for lay in every for p in lay["assignments"].values())
    assert metrics["num_refused"] == refused


def test_first_request_quick_times_a_fresh_server_s_first_requests(tiny_model_dir, tmp_path):
    from bench import bench_first_request as bench

    out = tmp_path / "first_request.json"
    argv = ["--quick", "--model", str(tiny_model_dir), "--dtype", "float32", "--out", str(out)]
    result = bench.main(argv)
    assert json.loads(out.read_text()) == result
    metrics = result["metrics"]
    (one,) = metrics["rounds"]  # one fresh server
    assert one["startup_s"] > 0
    for kind in bench.KINDS:  # the base model and the adapter, each first, warm and new
        row = one[kind]
        for what in ("first", "warm", "new"):
            assert 0 < row[f"{what}_ttft_ms"] <= row[f"{what}_total_ms"]
        ratio = row["first_ttft_ms"] / row["warm_ttft_ms"]
        assert row["first_over_warm_ttft"] == pytest.approx(ratio, rel=0.01)
        assert metrics[kind]["new_over_warm_total"]["all"] == [row["new_over_warm_total"]]


def test_scored_prompt_quick_times_the_streams_beside_both_prompts(tiny_model_dir, tmp_path):
    from bench import bench_scored_prompt as bench

    out = tmp_path / "scored_prompt.json"
    argv = ["--quick", "--model", str(tiny_model_dir), "--dtype", "float32", "--out", str(out)]
    result = bench.main(argv)
    assert json.loads(out.read_text()) == result
    metrics = result["metrics"]
    for kind in bench.KINDS:
        (row,) = metrics[kind]["rounds"]
        assert 0 < row["median_gap_ms"] <= row["max_gap_ms"] and row["request_s"] > 0
    ratio = metrics["scored"]["max_gap_ms"] / metrics["plain"]["max_gap_ms"]
    assert metrics["max_gap_ratio_scored_vs_plain"]["median"] == pytest.approx(ratio, rel=0.01)


def test_logprobs_quick_times_each_path(tiny_model_dir, tmp_path, monkeypatch):
    from bench import bench_logprobs as bench
    from toppings.server.sampling import logits

    paths = []
    native = logits.native_library
    monkeypatch.setattr(logits, "native_library", lambda: paths.append("native") or native())
    out = tmp_path / "logprobs.json"
    argv = ["--quick", "--model", str(tiny_model_dir), "--dtype", "float32", "--out", str(out)]
    result = bench.main(argv)
    assert json.loads(out.read_text()) == result
    assert paths and logits.native_library is not native  # the torch kind put it back
    metrics = result["metrics"]
    for kind in bench.KINDS:
        (row,) = metrics[kind]["rounds"]
        assert row["decode_tokens_per_s"] > 0 and row["scored_prompt_s"] > 0
    ratio = metrics["native"]["decode_tokens_per_s"] / metrics["torch"]["decode_tokens_per_s"]
    assert metrics["decode_ratio_native_vs_torch"]["median"] == pytest.approx(ratio, rel=0.01)


def test_full_size_quick_times_base_and_adapter_decode_steps(tmp_path):
    from bench import bench_full_size as bench

    out = tmp_path / "full_size.json"
    result = bench.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    metrics = result["metrics"]
    batches = [int(b) for b in bench.QUICK["batches"].split(",")]
    assert metrics["headline_batch"] == batches[-1]
    for batch in batches:
        row = metrics[f"batch_{batch}"]
        for kind in bench.KINDS:
            assert row[kind]["step_ms"] > 0 and row[kind]["roofline_fraction"] > 0
            assert row[kind]["tokens_per_s"] == pytest.approx(batch / row[kind]["step_ms"] * 1e3,
                                                              rel=0.01)  # fmt: skip
        # every used adapter's rows are read: none on the base model
        assert row["base"]["bytes"]["adapters"] == 0 < row["lora"]["bytes"]["adapters"]
    assert len(result["config"]["adapters"]) == bench.QUICK["adapters"]


def test_mixed_plan_quick_times_both_plans_in_mixed_steps(tmp_path):
    from bench import bench_mixed_plan

    out = tmp_path / "mixed_plan.json"
    result = bench_mixed_plan.main(["--quick", "--batches", "4", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    batch = result["metrics"]["batch_4"]
    assert set(batch["step_us"]) == set(batch["plan_us"]) == set(bench_mixed_plan.KINDS)
    assert all(v > 0 for v in [*batch["step_us"].values(), *batch["plan_us"].values()])
    from toppings.server.engine import model_runner
    from toppings.server.memory.past_table import PastTable

    assert model_runner.PastTable is PastTable  # the swap undone
