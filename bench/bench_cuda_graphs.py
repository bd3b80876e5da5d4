"""Decode step time with CUDA graphs on and off (`--cuda-graphs`), side by side, on a GPU.

For each batch size B: B requests (adapters drawn in turn from `--num-adapters` random ones of
rank `--rank`, every fourth request on the base model) decode `--new-tokens` tokens together;
the metric is the engine's mean decode step time (`Engine.step_stats`, prefill excluded). One
engine per setting; each batch size runs once untimed first (it captures that run's graphs:
their count and time are reported apart), then `--rounds` timed rounds alternating which setting
goes first. The result file is rewritten after every batch size, so a run stopped by a time
limit keeps the sizes it finished. Example (SmolLM2's shapes, random weights, as
bench/gpu_checks.sh makes them):

    python -m bench.bench_cuda_graphs --model /tmp/smol-shaped --batch-sizes 1,8,32,64

`--device cpu` runs the eager engine alone (a CPU has no graphs to capture): the baseline's
code path, without a GPU. `--quick` shrinks the run to a few steps (batch sizes 1 and 2, 4 new
tokens, 2 adapters of rank 4, one round) to check the driver:

    python -m bench.bench_cuda_graphs --device cpu --quick --model /tmp/tiny --out /tmp/g.json
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
from pathlib import Path

import torch

from bench.envelope import describe_device, write_result
from toppings.scripts.make_adapters import make_random_adapter
from toppings.server.config import EngineConfig
from toppings.server.engine.engine import Engine
from toppings.server.model.loader import resolve_model_dir
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine

log = logging.getLogger("bench_cuda_graphs")

QUICK = {"batch_sizes": "1,2", "num_adapters": 2, "rank": 4, "prompt_len": 8, "new_tokens": 4,
         "rounds": 1}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DecodeRun:
    """One run of a batch: its mean decode step time and how many decode steps it counted."""

    step_ms: float
    decode_steps: int


def decode_run(engine: Engine, batch: int, args: argparse.Namespace, seed: int) -> DecodeRun:
    """`batch` requests decoding together on `engine`, to the end of every request."""
    gen = torch.Generator().manual_seed(seed)
    refs = [engine.resolve_adapter(a["name"]) for a in engine.adapters()] or [None]
    vocab = min(engine.model_config.vocab_size, 1000)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    requests = [
        GenerationRequest(torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist(),
                          params, None if i % 4 == 3 else refs[i % len(refs)])
        for i in range(batch)
    ]  # fmt: skip
    engine.step_stats.reset()
    for handle in engine.submit_all(requests):
        handle.result(timeout_s=600)
    st = engine.step_stats
    return DecodeRun(1000 * st.decode_s / max(st.decode_steps, 1), st.decode_steps)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: the eager engine alone (no graphs on a CPU)")  # fmt: skip
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto: bfloat16 on cuda, the engine's choice on a cpu")  # fmt: skip
    p.add_argument("--kernel", default="mbgmv", choices=["bgmv", "mbgmv"])
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true",
                   help="a few steps that check the driver: " +
                   ", ".join(f"{k}={v}" for k, v in QUICK.items()))  # fmt: skip
    p.add_argument("--adapter-dir", default="/tmp/toppings-graph-adapters")
    p.add_argument("--out", default="bench/results/cuda_graphs.json")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def make_adapters(args: argparse.Namespace, model_dir: Path) -> dict[str, str]:
    """`--num-adapters` random adapters of rank `--rank` for the model, made once and reused."""
    adapters = {}
    for i in range(args.num_adapters):
        path = Path(args.adapter_dir) / f"{model_dir.name}-r{args.rank}-{i}"
        if not (path / "adapter_config.json").is_file():
            make_random_adapter(path, model_dir, rank=args.rank, seed=i)
        adapters[f"a{i}"] = str(path)
    return adapters


def batch_metrics(runs: dict[bool, list[DecodeRun]]) -> dict:
    """One batch size's figures: the median step time of each setting that ran, and with both
    the speed-up of graphs over eager."""
    out: dict = {}
    for on, name in ((True, "graphs"), (False, "eager")):
        if runs.get(on):
            out[f"decode_step_ms_{name}"] = statistics.median(r.step_ms for r in runs[on])
            out[f"rounds_{name}"] = [r.step_ms for r in runs[on]]
            out[f"decode_steps_{name}"] = [r.decode_steps for r in runs[on]]
    if runs.get(True) and runs.get(False):
        out["speedup_graphs_vs_eager"] = out["decode_step_ms_eager"] / out["decode_step_ms_graphs"]
    return out


def graph_metrics(engines: dict[bool, Engine]) -> dict:
    """The captures, their seconds and the replay counters of the engine with graphs on (none
    where no engine has graphs: the eager engine's runner holds none)."""
    for on, engine in engines.items():
        graphs = engine.runner.graphs
        if graphs is None:
            continue
        if not graphs.counters.replays:
            log.warning("graphs on (%s), but no decode step replayed one: %s", on, graphs.counters)
        return {"captures": graphs.counters.captures, "capture_s": graphs.capture_s,
                "graph_counters": graphs.counters.to_json()}  # fmt: skip
    return {}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model_dir = Path(resolve_model_dir(args.model))
    adapters = make_adapters(args, model_dir)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    config = EngineConfig(device=args.device, dtype=args.dtype, kernel=args.kernel,
                          max_batch_size=max(batches))  # fmt: skip
    settings = (True, False) if args.device == "cuda" else (False,)
    engines = {on: build_engine(str(model_dir), dataclasses.replace(config, cuda_graphs=on),
                                adapters) for on in settings}  # fmt: skip
    metrics: dict = {}
    result: dict = {}
    try:
        for batch in batches:
            runs: dict[bool, list[DecodeRun]] = {on: [] for on in settings}
            for engine in engines.values():
                decode_run(engine, batch, args, seed=0)  # untimed: captures the graphs
            for r in range(args.rounds):
                for on in settings if r % 2 == 0 else settings[::-1]:
                    runs[on].append(decode_run(engines[on], batch, args, seed=1 + r))
            metrics[f"batch_{batch}"] = figures = batch_metrics(runs)
            log.info("batch %d: %s", batch, figures)
            metrics.update(graph_metrics(engines))
            result = write_result(
                args.out, "cuda_graphs", "bench_cuda_graphs", device=describe_device(args.device),
                config=vars(args), metrics=metrics, argv=argv,
            )  # fmt: skip
    finally:
        for engine in engines.values():
            engine.shutdown()
    return result


if __name__ == "__main__":
    main()
