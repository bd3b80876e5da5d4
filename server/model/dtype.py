"""`--dtype auto`: the dtype the base model runs fastest in on this machine.

On CUDA: bfloat16. On a CPU, bfloat16 only pays where the CPU multiplies it natively (the
`avx512_bf16` or `amx_bf16` flags); even then it is not always faster than float32 (an Intel Xeon
with avx512_bf16 ran the engine faster in float32, an AMD EPYC with it far faster in bfloat16:
docs/benchmarks.md, "Measurements behind the code"). So the choice is measured once at start-up: the
model's largest projections (gate/up, [I, H]) through the same packed linear the engine uses
(server.linear, its GEMV's copy included), at a decode batch and a prefill chunk, in both dtypes,
alternating; bfloat16 wins only when it takes under `MARGIN` of float32's time. With
`--quantization int8/int4` the timed projection is the quantized one (server.model.quant), at
decode rows (QUANTIZED_ROWS): torch's packed kernels run far faster with bfloat16 activations
than with float32 ones.
"""

from __future__ import annotations

import time

import torch

from toppings.gpu_lora.kernels.native_build import cpu_flags
from toppings.server.config import Quantization
from toppings.server.model.linear import Linear
from toppings.server.model.quant import QuantizedLinear, quantize

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
ROWS = (16, 128)  # a decode step's batch and a prefill chunk
# Quantized: one stream's decode and a batch's; a prefill multiplies by the dequantized float32
# weight in either dtype (server.model.quant), so it does not tell them apart.
QUANTIZED_ROWS = (1, 16)
ROUNDS = 5
MARGIN = 0.9  # bfloat16 must be at least 10% faster: the rest of a step gains less


def projections(
    dtype: torch.dtype,
    hidden: int,
    intermediate: int,
    quantization: Quantization = Quantization.NONE,
):
    """The engine's linear for a random W [I, H] (quantized as the engine's would be) and one
    input x [rows, H] per row count."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(intermediate, hidden, generator=gen)
    rows_timed = ROWS
    if quantization is Quantization.NONE:
        # with the GEMV's copy, as the engine keeps it where it is affordable: at decode rows
        # bfloat16 may run on AMX's tiles, which oneDNN's packed product does not show
        linear: Linear | QuantizedLinear = Linear(weight.to(dtype), plain_gemv=True)
    else:
        linear = QuantizedLinear(quantize(weight, quantization), dtype)
        rows_timed = QUANTIZED_ROWS
    inputs = [torch.randn(rows, hidden, generator=gen).to(dtype) for rows in rows_timed]
    for x in inputs:
        linear(x)  # warm-up: oneDNN picks its kernel on the first call
    return linear, inputs


def time_projection(linear: Linear | QuantizedLinear, x: torch.Tensor) -> float:
    """Seconds of one linear(x) (best of 3)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        linear(x)
        best = min(best, time.perf_counter() - start)
    return best


def choose_dtype(
    device: str,
    hidden: int,
    intermediate: int,
    flags: set[str] | None = None,
    quantization: Quantization = Quantization.NONE,
):
    """(dtype name, why) for `--dtype auto`; `quantization`: the base weights' (timed as such)."""
    if device == "cuda":
        return "bfloat16", "cuda"
    flags = cpu_flags() if flags is None else flags
    if not any(f in flags for f in NATIVE_BF16_FLAGS):
        return "float32", "this CPU has no native bfloat16 (avx512_bf16 / amx_bf16)"
    setups = {
        dtype: projections(dtype, hidden, intermediate, quantization)
        for dtype in (torch.float32, torch.bfloat16)
    }
    totals = dict.fromkeys(setups, 0.0)
    for _ in range(ROUNDS):  # the two dtypes alternate, so drift in the machine hits both
        for dtype, (linear, inputs) in setups.items():
            totals[dtype] += sum(time_projection(linear, x) for x in inputs)
    ratio = totals[torch.bfloat16] / totals[torch.float32]
    kind = "" if quantization is Quantization.NONE else f"{quantization.value} "
    why = (
        f"a [{intermediate}, {hidden}] {kind}projection takes {ratio:.2f}x float32's time in "
        "bfloat16"
    )
    return ("bfloat16" if ratio < MARGIN else "float32"), why
