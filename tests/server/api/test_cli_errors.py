"""A user's mistake on a console command: one `error:` line on stderr, exit status 2, no
traceback. Each command runs in a subprocess, as a user would start it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

COMMANDS = {
    "toppings-serve": "toppings.server.cli",
    "toppings-scheduler": "toppings.scheduler.cli",
    "toppings-launch": "toppings.scripts.launch.cli",
}


def run(command: str, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """The installed console script next to this Python, else its module with -m."""
    script = Path(sys.executable).parent / command
    argv = [str(script)] if script.is_file() else [sys.executable, "-m", COMMANDS[command]]
    return subprocess.run(argv + list(args), capture_output=True, text=True, timeout=timeout_s)


def assert_refused(result: subprocess.CompletedProcess, command: str, *words: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if f"{command}: error:" in line]
    assert len(errors) == 1, result.stderr
    for word in words:
        assert word in errors[0], errors[0]


def test_serve_wrong_lora_path(tiny_model_dir, tmp_path):
    missing = tmp_path / "no_such_adapter"
    result = run("toppings-serve", "--model", str(tiny_model_dir), "--port", "0",
                 "--lora", f"mine={missing}")  # fmt: skip
    assert_refused(result, "toppings-serve", "mine", str(missing), "does not exist")


def test_serve_invalid_adapter(tiny_model_dir, tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "PREFIX_TUNING"}')
    result = run("toppings-serve", "--model", str(tiny_model_dir), "--port", "0",
                 "--lora", f"mine={tmp_path}")  # fmt: skip
    assert_refused(result, "toppings-serve", "mine", "peft_type")


def test_serve_missing_model(tmp_path):
    missing = tmp_path / "no_such_model"
    assert_refused(run("toppings-serve", "--model", str(missing)), "toppings-serve", str(missing))


def test_serve_config_transformers_rejects(tmp_path):
    # transformers validates config fields with errors that are no ValueError of its own
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": "abc"}')
    result = run("toppings-serve", "--model", str(tmp_path), "--port", "0")
    assert_refused(result, "toppings-serve", "config.json", "hidden_size")


def test_serve_port_in_use(tiny_model_dir, taken_port):
    result = run("toppings-serve", "--model", str(tiny_model_dir), "--port", str(taken_port))
    assert_refused(result, "toppings-serve", str(taken_port), "already in use")


def test_serve_bad_flag_value(tiny_model_dir):
    result = run("toppings-serve", "--model", str(tiny_model_dir), "--log-level", "loud")
    assert_refused(result, "toppings-serve", "--log-level")


def test_scheduler_port_in_use(tmp_path, taken_port):
    result = run("toppings-scheduler", "--registry", str(tmp_path / "r.sqlite"),
                 "--port", str(taken_port))  # fmt: skip
    assert_refused(result, "toppings-scheduler", str(taken_port), "already in use")
    assert not (tmp_path / "r.sqlite").exists()  # refused before the registry is made


def test_scheduler_missing_perf_model(tmp_path):
    result = run("toppings-scheduler", "--registry", str(tmp_path / "r.sqlite"),
                 "--perf-model", str(tmp_path / "none.json"))  # fmt: skip
    assert_refused(result, "toppings-scheduler", "none.json")


def test_scheduler_refuses_a_benchmark_result_as_its_perf_model(tmp_path):
    bench_result = Path(__file__).resolve().parents[3] / "bench" / "results" / "perf_model.json"
    result = run("toppings-scheduler", "--registry", str(tmp_path / "r.sqlite"),
                 "--perf-model", str(bench_result))  # fmt: skip
    assert_refused(result, "toppings-scheduler", "a benchmark result, not a perf-model file",
                   "perf_model_smollm2_cpu.json")  # fmt: skip


def test_launch_refuses_before_starting_anything(tiny_model_dir, tmp_path, taken_port):
    missing = tmp_path / "no_such_model"
    logs = tmp_path / "logs"
    result = run("toppings-launch", "--model", str(missing), "--log-dir", str(logs))
    assert_refused(result, "toppings-launch", str(missing))
    result = run("toppings-launch", "--model", str(tiny_model_dir), "--lora", f"x={missing}")
    assert_refused(result, "toppings-launch", str(missing))
    result = run("toppings-launch", "--model", str(tiny_model_dir), "--base-port", str(taken_port))
    assert_refused(result, "toppings-launch", str(taken_port), "already in use")


def test_serve_bad_memory_flags(tiny_model_dir):
    result = run("toppings-serve", "--model", str(tiny_model_dir), "--memory-bytes", "-1")
    assert_refused(result, "toppings-serve", "memory_bytes")
    result = run("toppings-serve", "--model", str(tiny_model_dir), "--prefix-cache", "maybe")
    assert_refused(result, "toppings-serve", "--prefix-cache")


def test_serve_refuses_cuda_graphs_on_a_cpu(tiny_model_dir):
    result = run("toppings-serve", "--model", str(tiny_model_dir), "--cuda-graphs", "on")
    assert_refused(result, "toppings-serve", "--cuda-graphs on needs --device cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_serve_refuses_cuda_without_a_gpu(tiny_model_dir):
    """One line before the model loads (it was a 36-line traceback from torch)."""
    result = run("toppings-serve", "--model", str(tiny_model_dir), "--device", "cuda")
    assert_refused(result, "toppings-serve", "--device cuda: this torch")
