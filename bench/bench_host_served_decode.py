"""Decode steps with requests served on the host: in one native call against layer by layer.

    python -m bench.bench_host_served_decode [--batches 12,16] [--rounds 4]

Under cpu-assisted a request whose adapter finds no device room is served on the host, its LoRA
computed from the adapter's host copy (server/adapters/host_served.py). On a CPU, a decode step
with such a request ran layer by layer from Python (four native calls a layer, the LoRA added
between them), where one of cached adapters runs in one native call; now the one call takes the
host copies too (`LoraHost`: server/model/decode_path.py, gpu_lora/host_runs.py). One engine
(SmolLM2, bfloat16, `--threads` torch threads, driven step by step here: no engine thread) with
the device room of bench_adapter_scale (`--slots` mean adapters of its ranks 8-64 on q, k, v, o,
static layout) serves B requests of 40-token prompts, each its own adapter of that bench's set:
those the room does not hold are served on the host for the whole run. The steps that decode all
B are timed, the path of that step set by the decode path's `_one_call` (the switch its tests use):
`one_call` (the engine's choice) or `layer_by_layer` (what such a step ran before), alternating
between rounds. Reported per batch: each path's median step (pooled, per-round medians beside),
`layer_by_layer / one_call`, and the requests served on the host (`host_served`).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

import torch

from bench.bench_adapter_scale import RANKS, make_adapters
from bench.common import adapter_bytes
from bench.envelope import describe_device, write_result
from toppings.server.config import EngineConfig
from toppings.server.engine.engine import Engine
from toppings.server.model.loader import load_checkpoint, resolve_model_dir
from toppings.server.requests.request import GenerationRequest, SamplingParams

log = logging.getLogger(__name__)

ONE_CALL, LAYER_BY_LAYER = "one_call", "layer_by_layer"
PROMPT_TOKENS = 40
ADAPTER_DIR = Path.home() / ".cache/toppings/bench_adapters/smollm2-qkvo-1024"


def decode_steps(engine: Engine, names: list[str], one_call: bool, steps: int, seed: int):
    """Step times (ms) of `steps` decode steps of len(names) requests on the path asked, and
    how many of them were served on the host meanwhile."""
    engine.model.decode_path._one_call = one_call
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_new_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for name in names:
        prompt = torch.randint(100, 40000, (PROMPT_TOKENS,), generator=gen).tolist()
        engine.submit(GenerationRequest(prompt, params, adapter=engine.resolve_adapter(name)))
    times: list[float] = []
    on_host = 0
    engine.step()  # the submissions reach the queue
    while engine.scheduler.has_work():
        start = time.perf_counter()
        plan = engine.step()
        if plan is not None and not plan.is_prefill and len(plan.seqs) == len(names):
            times.append(1000 * (time.perf_counter() - start))
            on_host = max(on_host, engine.lora.num_on_host)
    return times[:steps], on_host


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batches", default="12,16", help="requests a step, each its own adapter")
    p.add_argument("--slots", type=int, default=8, help="device room, in mean adapters")
    p.add_argument("--adapter-dir", type=Path, default=ADAPTER_DIR)
    p.add_argument("--steps", type=int, default=25, help="timed decode steps per run")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench/results/host_served_decode.json")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    model_dir = str(resolve_model_dir(args.model))
    ranks = make_adapters(args.adapter_dir, model_dir, 1024)
    names = sorted(ranks)[: max(batches)]
    nbytes = {r: adapter_bytes(args.adapter_dir / next(n for n in ranks if ranks[n] == r),
                               model_dir, torch.bfloat16) for r in RANKS}  # fmt: skip
    room = int(args.slots * sum(nbytes[ranks[n]] for n in ranks) / len(ranks))
    config = EngineConfig(dtype="bfloat16", lora_mode="cpu-assisted", memory_layout="static",
                          adapter_cache_bytes=room, max_total_tokens=16384)  # fmt: skip
    engine = Engine(config, load_checkpoint(model_dir))
    try:
        for name in names:
            engine.add_adapter(name, str(args.adapter_dir / name))
        paths = {ONE_CALL: True, LAYER_BY_LAYER: False}
        times = {(path, b): [] for path in paths for b in batches}
        per_round = {key: [] for key in times}
        on_host: dict[int, int] = {}
        for rnd in range(args.rounds):
            order = list(paths) if rnd % 2 == 0 else list(paths)[::-1]
            for batch in batches:
                for path in order:
                    got, on_host[batch] = decode_steps(engine, names[:batch], paths[path],
                                                       args.steps, rnd)  # fmt: skip
                    times[path, batch] += got
                    per_round[path, batch].append(statistics.median(got))
            log.info("round %d done", rnd)
    finally:
        engine.shutdown()
    metrics: dict = {}
    for batch in batches:
        med = {path: statistics.median(times[path, batch]) for path in paths}
        metrics[f"b{batch}"] = {
            "one_call_ms": med[ONE_CALL], "layer_by_layer_ms": med[LAYER_BY_LAYER],
            "layer_by_layer_over_one_call": med[LAYER_BY_LAYER] / med[ONE_CALL],
            "one_call_ms_per_round": per_round[ONE_CALL, batch],
            "layer_by_layer_ms_per_round": per_round[LAYER_BY_LAYER, batch],
            "host_served": on_host[batch],
        }  # fmt: skip
        log.info("B=%d (%d on the host): one call %.1f ms, layer by layer %.1f ms (x%.2f)",
                 batch, on_host[batch], med[ONE_CALL], med[LAYER_BY_LAYER],
                 med[LAYER_BY_LAYER] / med[ONE_CALL])  # fmt: skip
    config_out = {**vars(args), "adapter_dir": str(args.adapter_dir), "adapter_names": names,
                  "adapter_room_bytes": room, "model_dir": model_dir,
                  "prompt_tokens": PROMPT_TOKENS}  # fmt: skip
    write_result(args.out, "host_served_decode", "bench_host_served_decode",
                 device=describe_device(), argv=argv, config=config_out,
                 metrics=metrics)  # fmt: skip
    return metrics


if __name__ == "__main__":
    main()
