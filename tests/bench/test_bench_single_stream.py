"""bench_single_stream's adapter floor: the adapter bytes a decode step reads are the bytes of
the adapter the bench writes (every projection, every layer), and the floor follows from them;
its ratios and roofline fractions are taken within each round."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from bench.bench_single_stream import (
    TARGETS,
    adapter_bytes_per_step,
    add_adapter_floor,
    paired_ratio,
    roofline_fraction,
)
from bench.common import write_random_adapter


def test_adapter_bytes_are_the_written_adapters(tiny_model_dir, tmp_path):
    path = write_random_adapter(tmp_path / "ad", str(tiny_model_dir), 5, TARGETS, seed=0)
    (weights,) = path.glob("*.safetensors")
    stored = load_file(str(weights))
    elements = sum(t.numel() for t in stored.values())
    assert adapter_bytes_per_step(str(tiny_model_dir), 5, torch.float32) == 4 * elements
    assert adapter_bytes_per_step(str(tiny_model_dir), 5, torch.bfloat16) == 2 * elements


def test_the_floor_is_the_adapter_read_over_the_base_step(tiny_model_dir):
    class Args:
        model, rank, quantization_dtype = str(tiny_model_dir), 8, "bfloat16"

    metrics = {"tpot_ms_batch1": {"float32": 2.0, "int8": 1.0}}
    add_adapter_floor(metrics, Args, ["float32", "int8", "int4"], bandwidth=10.0)
    f32 = adapter_bytes_per_step(Args.model, 8, torch.float32)
    assert metrics["adapter_bytes_per_step"]["int8"] == f32 // 2  # bf16 activations
    ms = f32 / 10e9 * 1e3
    assert metrics["tpot_ratio_adapter_vs_base_floor_batch1"] == {
        "float32": round(1 + ms / 2.0, 3), "int8": round(1 + ms / 2 / 1.0, 3),
    }  # fmt: skip


def test_ratios_are_paired_by_round():
    # the machine slows 2x in round 2 and 3x in round 3: the ratio of the rows' medians would
    # read 10 / 15, the rows' ratio within each round is 0.5
    new, llama = ("bfloat16", "new", False, 1), ("bfloat16", "llama", False, 1)
    times = {
        new: [{"round": 1, "tpot_ms": 5.0}, {"round": 2, "tpot_ms": 10.0},
              {"round": 3, "tpot_ms": 15.0}],
        llama: [{"round": 1, "tpot_ms": 10.0}, {"round": 2, "tpot_ms": 20.0},
                {"round": 3, "tpot_ms": 30.0}, {"round": 4, "tpot_ms": 1.0}],
    }  # fmt: skip
    assert paired_ratio(times, new, llama) == 0.5
    assert paired_ratio(times, new, ("bfloat16", "llama", True, 1)) is None


def test_roofline_fractions_take_each_rounds_bandwidth():
    # 1 GB a step; round 1 reads at 100 GB/s and steps in 20 ms (0.5 of its roofline), round 2
    # at 50 GB/s in 25 ms (0.8), round 3 at 100 GB/s in 12.5 ms (0.8): the median is 0.8, where
    # the best bandwidth against the median step (20 ms) would read 0.5
    row = ("bfloat16", "new", False, 1)
    times = {row: [{"round": 1, "tpot_ms": 20.0}, {"round": 2, "tpot_ms": 25.0},
                   {"round": 3, "tpot_ms": 12.5}, {"round": 4, "tpot_ms": 1.0}]}  # fmt: skip
    bandwidths = {1: 100.0, 2: 50.0, 3: 100.0}  # round 4 read none: left out
    assert roofline_fraction(times, row, 10**9, bandwidths) == 0.8
    assert roofline_fraction(times, ("int8", "new", False, 1), 10**9, bandwidths) is None
