"""`--dtype auto`: which dtype the engine picks, and that an engine built with it serves."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers import running_engine
from toppings.server.model.dtype import choose_dtype, cpu_flags
from toppings.server.requests.request import GenerationRequest, SamplingParams


def test_cuda_runs_bfloat16():
    assert choose_dtype("cuda", 64, 128)[0] == "bfloat16"


def test_a_cpu_without_native_bfloat16_runs_float32_without_measuring():
    dtype, why = choose_dtype("cpu", 64, 128, flags={"avx2", "avx512f"})
    assert dtype == "float32" and "no native bfloat16" in why


def test_a_cpu_with_native_bfloat16_measures_and_says_the_ratio():
    dtype, why = choose_dtype("cpu", 64, 128, flags={"avx512_bf16"})
    assert dtype in ("float32", "bfloat16") and "float32's time in bfloat16" in why


def test_quantized_weights_time_the_quantized_projection(monkeypatch):
    """With int8 / int4 the projection timed is the quantized one the engine would run."""
    from toppings.server.config import Quantization
    from toppings.server.model import dtype as dtype_module
    from toppings.server.model.quant import QuantizedLinear

    timed = []
    monkeypatch.setattr(
        dtype_module, "time_projection", lambda linear, x: timed.append(linear) or 1.0
    )
    _, why = choose_dtype("cpu", 64, 128, {"avx512_bf16"}, Quantization.INT4)
    assert timed and all(isinstance(t, QuantizedLinear) for t in timed)
    assert {t.dtype for t in timed} == {torch.float32, torch.bfloat16}
    assert "int4 projection takes 1.00x" in why


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512_bf16\n\nflags\t: other\n")
    assert cpu_flags(info) == {"fpu", "sse2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == set()


def test_an_engine_with_auto_dtype_resolves_it_and_serves(tiny_model_dir):
    with running_engine(tiny_model_dir, device="cpu", dtype="auto") as engine:
        assert engine.config.dtype in ("float32", "bfloat16")
        params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
        out = engine.submit(GenerationRequest([5, 6, 7], params, None)).result(timeout_s=60)
        assert len(out.new_token_ids) == 3
