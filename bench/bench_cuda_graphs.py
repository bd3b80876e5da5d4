"""Decode step time with CUDA graphs on and off (`--cuda-graphs`), side by side, on a GPU.

For each batch size B: B requests (adapters drawn in turn from `--num-adapters` random ones of
rank `--rank`, every fourth request on the base model) decode `--new-tokens` tokens together;
the metric is the engine's mean decode step time (`Engine.step_stats`, prefill excluded). One
engine per setting; each batch size runs once untimed first (it captures that run's graphs:
their count and time are reported apart), then `--rounds` timed rounds alternating which setting
goes first. Example (the tiny 8-layer Llama-7B-shaped model of bench/GPU.md):

    python -m bench.bench_cuda_graphs --model /tmp/llama7b-8l --batch-sizes 1,8,32,64
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
from toppings.server.model.loader import resolve_model_dir
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine

log = logging.getLogger("bench_cuda_graphs")


def decode_step_ms(engine, batch: int, args, seed: int) -> float:
    """Mean decode step time of one run of `batch` requests decoding together."""
    gen = torch.Generator().manual_seed(seed)
    refs = [engine.resolve_adapter(a["name"]) for a in engine.adapters()]
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
    return 1000 * st.decode_s / max(st.decode_steps, 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--kernel", default="mbgmv", choices=["bgmv", "mbgmv"])
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--adapter-dir", default="/tmp/toppings-graph-adapters")
    p.add_argument("--out", default="bench/results/cuda_graphs.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model_dir = resolve_model_dir(args.model)
    adapters = {}
    for i in range(args.num_adapters):
        path = Path(args.adapter_dir) / f"{Path(model_dir).name}-r{args.rank}-{i}"
        if not (path / "adapter_config.json").is_file():
            make_random_adapter(path, model_dir, rank=args.rank, seed=i)
        adapters[f"a{i}"] = str(path)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    config = EngineConfig(device="cuda", dtype=args.dtype, kernel=args.kernel,
                          max_batch_size=max(batches))  # fmt: skip
    engines = {on: build_engine(str(model_dir), dataclasses.replace(config, cuda_graphs=on),
                                adapters) for on in (True, False)}  # fmt: skip
    metrics: dict = {}
    try:
        for batch in batches:
            times: dict[bool, list[float]] = {True: [], False: []}
            for engine in engines.values():
                decode_step_ms(engine, batch, args, seed=0)  # untimed: captures the graphs
            for r in range(args.rounds):
                for on in (True, False) if r % 2 == 0 else (False, True):
                    times[on].append(decode_step_ms(engines[on], batch, args, seed=1 + r))
            on_ms, off_ms = statistics.median(times[True]), statistics.median(times[False])
            metrics[f"batch_{batch}"] = {
                "decode_step_ms_graphs": on_ms, "decode_step_ms_eager": off_ms,
                "speedup_graphs_vs_eager": off_ms / on_ms, "rounds": times,
            }  # fmt: skip
            log.info("batch %d: %.3f ms a decode step with graphs, %.3f eager (%.2fx)",
                     batch, on_ms, off_ms, off_ms / on_ms)  # fmt: skip
        graphs = engines[True].decode.graphs
        metrics["captures"] = graphs.counters["captures"]
        metrics["capture_s"] = graphs.capture_s
        metrics["graph_counters"] = dict(graphs.counters)
    finally:
        for engine in engines.values():
            engine.shutdown()
    write_result(args.out, "cuda_graphs", "bench_cuda_graphs", device=describe_device("cuda"),
                 config=vars(args), metrics=metrics)  # fmt: skip


if __name__ == "__main__":
    main()
