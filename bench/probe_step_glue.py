"""The Python around a decode step, warm and cold: how much of it is the caches' doing.

One SmolLM2 stream decodes `--new-tokens` after a 128-token prompt, `--rounds` times in each of
three modes, in turn; per decode step, the microseconds outside the native call:
  real   the engine as it runs (the native one-call step streams the weights);
  warm   the native call replaced by a write of its scan of the logits (every row finite, token
         0: a greedy request reads nothing else), so the Python runs with its code and data in
         cache;
  cold   the same after a read of `--stream-mb` of memory, as the weights' stream leaves the
         caches (the read is not counted).
What real and cold take beyond warm is cache misses: the weights' stream evicts the Python's
working set every step (docs/benchmarks.md, session 33). The real steps' native call is reported
too (`native_ms_real`), and the OpenMP environment it ran under.

    python -m bench.probe_step_glue [--precision bfloat16] [--quantization none] [--stream-mb 256]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import torch

from bench.envelope import describe_device, write_result
from toppings.server import native
from toppings.server.config import EngineConfig, Quantization
from toppings.server.engine.engine import Engine
from toppings.server.model.loader import load_checkpoint, resolve_model_dir
from toppings.server.requests.request import GenerationRequest, SamplingParams

MODES = ("real", "warm", "cold")


def fake_step(stream: torch.Tensor | None):
    """decode_layers' stand-in: the step's scan written (every row finite, token 0), nothing
    computed; after a read of `stream` where given (timed with the call: not counted)."""

    def decode_layers(step_ref, layers, num_layers, lora, is_bf16, threads) -> int:
        if stream is not None:
            stream.sum()
        step = step_ref._obj  # the DecodeStep struct byref() wraps
        ctypes.memset(step.finite, 1, step.T)
        ctypes.memset(step.argmax, 0, 8 * step.T)
        return 0

    return decode_layers


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precision", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument(
        "--quantization",
        default="none",
        choices=[q.value for q in Quantization],
        help="weight-only quantization of the base weights",
    )
    p.add_argument("--stream-mb", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=4, help="per mode; the first a warm-up")
    p.add_argument("--out", default="bench/results/step_glue.json")
    args = p.parse_args(argv)
    config = EngineConfig(dtype=args.precision, quantization=args.quantization, adapt_threads=False)
    engine = Engine(config, load_checkpoint(str(resolve_model_dir("smollm2"))))
    lib = native.library()
    if engine.model.decode_path is None or not engine.model.decode_path.whole_step:
        raise SystemExit("probe_step_glue: no one-call decode step here")
    real = lib.decode_layers
    stream = torch.ones(args.stream_mb * (1 << 20) // 4)
    fakes = {"real": real, "warm": fake_step(None), "cold": fake_step(stream)}
    native_s, mode = [0.0], ["real"]

    def timed(*a):
        began = time.perf_counter()
        failed = fakes[mode[0]](*a)
        native_s[0] += time.perf_counter() - began
        return failed

    lib.decode_layers = timed
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    glue: dict[str, list[float]] = {m: [] for m in MODES}
    real_step_ms: list[float] = []  # the native call of the real steps
    try:
        for round_idx in range(args.rounds):
            for name in MODES:
                mode[0] = name
                engine.submit(GenerationRequest(list(range(100, 228)), params, None))
                engine.step()
                while any(not s.is_prefilled for s in engine.scheduler.running):
                    engine.step()
                native_s[0], steps, began = 0.0, 0, time.perf_counter()
                while engine.scheduler.has_work():
                    engine.step()
                    steps += 1
                outside = time.perf_counter() - began - native_s[0]
                if round_idx:
                    glue[name].append(1e6 * outside / steps)
                    if name == "real":
                        real_step_ms.append(1e3 * native_s[0] / steps)
    finally:
        lib.decode_layers = real
        engine.shutdown()
    metrics = {f"glue_us_{m}": round(statistics.median(v), 1) for m, v in glue.items()}
    metrics |= {f"glue_us_{m}_rounds": [round(x, 1) for x in v] for m, v in glue.items()}
    metrics["native_ms_real"] = round(statistics.median(real_step_ms), 3)
    print(metrics)
    config = vars(args) | {
        env: os.environ.get(env, "default") for env in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    }  # what OpenMP's threads do between the step's parallel regions
    write_result(args.out, "step_glue", "probe_step_glue", device=describe_device(),
                 config=config, metrics=metrics, argv=argv)  # fmt: skip


if __name__ == "__main__":
    main()
