"""Decode at full size: a real model's shapes, 16 distinct adapters against the base model, batch
1 to 256, and each decode step's fraction of the memory roofline; writes
bench/results/full_size.json.

Issue 63's full-size benchmark: Llama-3.1-8B's shapes (`--preset`, random weights drawn on the
device: `load_format=dummy`), bfloat16, 16 adapters of ranks 8, 16, 32 and 64 on all seven
projections, resident on the device (`lora_mode=cached`: the steady state, not the loads). For
each batch size B, B requests of a `--prompt`-token prompt are admitted and prefilled, then
`--steps` decode steps are timed one by one on this thread (the engine is driven step by step,
as bench_host_overhead does; each step returns its sampled tokens to the host, so its wall time
holds the device's work): once on the base model, once with request i on adapter i mod 16,
the two alternating over `--rounds`. Reported per B and kind: the median step, output tokens/s
(B / step), and the roofline fraction: the bytes a decode step must read (every weight, each
request's KV, each used adapter's A and B: bench/roofline.py) at `--peak-gbps` over the step.
The headline is B = 64: tokens/s with adapters / without (issue 63: >= 0.90; published engines
keep 0.53-0.79) and the adapters' roofline fraction (>= 0.6).

On a GPU (the H100's HBM3 peak is the default; an H200 reads 4,800 GB/s):

    python -m bench.bench_full_size --device cuda  # GPU.md: its checkpoint carried in .gpu/

`--quick` runs the same path on a CPU with the tiny random Llama (2 layers, 4 adapters), the
memory bandwidth measured here; its numbers check the driver, not the engine. (On a CPU the
probe, a torch.sum, reads slower than the engine's GEMVs: fractions above 1 there.)
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.bench_cpu_assisted import dummy_model
from bench.common import write_random_adapter
from bench.envelope import describe_device, write_result
from bench.roofline import decode_step_bytes, memory_bandwidth_gbs
from toppings.gpu_lora.targets import LORA_TARGETS
from toppings.scripts.make_dummy_model import PRESETS
from toppings.server.config import EngineConfig
from toppings.server.engine.engine import Engine
from toppings.server.model.loader import load_checkpoint
from toppings.server.requests.request import GenerationRequest, SamplingParams

log = logging.getLogger(__name__)

KINDS = ("base", "lora")
H100_SXM_GBPS = 3350.0
QUICK = {"batches": "1,4", "adapters": 4, "ranks": "4,8", "prompt": 16, "steps": 4, "rounds": 1}


def model_dir(args: argparse.Namespace) -> str:
    """The checkpoint to serve: `--model`, else the preset's weightless one (made once under
    /tmp, as bench_cpu_assisted makes its own), or on `--quick` a tiny random Llama."""
    if args.model:
        return args.model
    if args.quick:
        from toppings.scripts.make_tiny_llama import make_tiny_llama

        return str(make_tiny_llama(Path(tempfile.mkdtemp(prefix="full_size_")) / "tiny"))
    return str(dummy_model(args.preset, args.layers or PRESETS[args.preset]["num_hidden_layers"]))


def make_adapters(root: Path, model: str, count: int, ranks: list[int], config) -> dict[str, int]:
    """`count` adapters on every projection, adapter i of rank ranks[i % len(ranks)], written
    under root (once, on as many threads as cores: at Llama-3.1-8B's shapes a rank-64 one is
    321 MB and took 4.4 s alone on a 2-core Xeon); returns name -> rank."""
    todo = []
    for i in range(count):
        path = root / f"full-r{ranks[i % len(ranks)]}-{i}"
        if not (path / "adapter_config.json").is_file():
            todo.append((path, ranks[i % len(ranks)], 500 + i))

    def write(job: tuple[Path, int, int]) -> None:
        path, rank, seed = job
        write_random_adapter(path, model, rank, LORA_TARGETS, seed=seed, config=config)

    with ThreadPoolExecutor(max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        list(pool.map(write, todo))
    return {f"a{i}": ranks[i % len(ranks)] for i in range(count)}


def decode_steps(engine: Engine, batch: int, names: list[str | None], args) -> list[float]:
    """Seconds of `args.steps` decode steps of `batch` requests (request i on names[i % n]),
    each admitted and prefilled first; then aborted."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_new_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    requests = []
    for i in range(batch):
        prompt = torch.randint(vocab // 4, vocab - 1, (args.prompt,), generator=gen).tolist()
        adapter = engine.resolve_adapter(names[i % len(names)])
        requests.append(GenerationRequest(prompt, params, adapter))
        engine.submit(requests[-1])
    sched = engine.scheduler
    deadline = time.monotonic() + 600
    while not (len(sched.running) == batch and not sched.queue
               and all(s.output_ids for s in sched.running)):  # fmt: skip
        if time.monotonic() > deadline:
            raise TimeoutError(f"{batch} requests were not all prefilled in 600 s")
        engine.step()
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        plan = engine.step()
        times.append(time.perf_counter() - started)
        if plan is None or plan.is_prefill or len(plan.seqs) != batch:
            raise RuntimeError(f"a timed step was not a decode step of {batch} requests")
    for request in requests:
        engine.abort(request.request_id)
    while sched.has_work():
        engine.step()
    return times


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--preset", default="llama-3.1-8b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=0, help="layers of the preset (0: all)")
    p.add_argument("--model", default="", help="a checkpoint directory instead of the preset")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,16,64,256", help="batch sizes, comma-separated")
    p.add_argument("--adapters", type=int, default=16, help="distinct adapters")
    p.add_argument("--ranks", default="8,16,32,64", help="their ranks, in turn")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens of each request")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the kinds' order alternating")
    p.add_argument(
        "--peak-gbps",
        type=float,
        default=0.0,
        help="memory bandwidth, GB/s (0: the H100 SXM's on cuda, measured on a CPU)",
    )
    p.add_argument("--quick", action="store_true", help="the tiny Llama on a CPU, a few steps")
    p.add_argument("--out", default="bench/results/full_size.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    if args.quick:
        args.device, args.dtype = "cpu", "float32"
        for key, value in QUICK.items():
            setattr(args, key, value)
    batches = [int(b) for b in args.batches.split(",") if b]
    ranks = [int(r) for r in args.ranks.split(",") if r]
    model = model_dir(args)
    checkpoint = load_checkpoint(model, "dummy")
    cfg = checkpoint.config
    # the adapters are written once per checkpoint (a quick run's beside its scratch model)
    digest = hashlib.sha1(str(Path(model).resolve()).encode()).hexdigest()[:12]
    root = Path(model).parent if args.quick else Path(tempfile.gettempdir()) / f"full-size-{digest}"
    rank_of = make_adapters(root, model, args.adapters, ranks, cfg)
    tokens = max(batches) * (args.prompt + args.steps + 16) * 2  # room past block rounding
    config = EngineConfig(device=args.device, dtype=args.dtype, load_format="dummy",
                          max_batch_size=max(batches), max_total_tokens=tokens,
                          lora_mode="cached", adapt_threads=False)  # fmt: skip
    engine = Engine(config, checkpoint)
    for name in rank_of:
        engine.add_adapter(name, str(root / f"full-r{rank_of[name]}-{name[1:]}"))
    names = {"base": [None], "lora": list(rank_of)}
    steps: dict[str, dict[int, list[float]]] = {k: {b: [] for b in batches} for k in KINDS}
    try:
        for kind in KINDS:  # warm-up: every adapter resident, the shapes seen
            decode_steps(engine, min(max(batches), len(names[kind])), names[kind], args)
        for r in range(args.rounds):
            for batch in batches:
                for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
                    step_s = statistics.median(decode_steps(engine, batch, names[kind], args))
                    steps[kind][batch].append(step_s)
                    log.info("round %d, batch %d, %s: %.2f ms a decode step", r, batch, kind,
                             step_s * 1e3)  # fmt: skip
    finally:
        engine.shutdown()
        if args.quick and not args.model:
            shutil.rmtree(Path(model).parent, ignore_errors=True)
    peak = args.peak_gbps or (H100_SXM_GBPS if args.device == "cuda" else memory_bandwidth_gbs())
    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    context = args.prompt + (args.steps + 1) / 2  # the mean KV length over the timed steps
    metrics: dict = {}
    for batch in batches:
        row = {}
        for kind in KINDS:
            used = [rank_of[n] for n in names[kind][:batch] if n is not None]
            need = decode_step_bytes(cfg, itemsize, batch, context, used, LORA_TARGETS)
            step_s = statistics.median(steps[kind][batch])
            row[kind] = {"step_ms": round(step_s * 1e3, 3),
                         "tokens_per_s": round(batch / step_s, 1),
                         "roofline_fraction": round(sum(need.values()) / (peak * 1e9) / step_s, 3),
                         "bytes": need,
                         "rounds_ms": [round(s * 1e3, 3) for s in steps[kind][batch]]}  # fmt: skip
        row["tokens_per_s_ratio_lora_vs_base"] = round(
            row["lora"]["tokens_per_s"] / row["base"]["tokens_per_s"], 3
        )
        metrics[f"batch_{batch}"] = row
    metrics["headline_batch"] = head = 64 if 64 in batches else batches[-1]  # issue 63's: 64
    metrics["ratio_lora_vs_base"] = metrics[f"batch_{head}"]["tokens_per_s_ratio_lora_vs_base"]
    metrics["roofline_fraction_lora"] = metrics[f"batch_{head}"]["lora"]["roofline_fraction"]
    return write_result(args.out, "full_size", "bench_full_size",
                        device=describe_device(args.device),
                        config={"model": model, "preset": None if args.model else args.preset,
                                "layers": cfg.num_layers, "dtype": args.dtype,
                                "batches": batches, "adapters": rank_of,
                                "targets": list(LORA_TARGETS), "prompt": args.prompt,
                                "steps": args.steps, "rounds": args.rounds, "peak_gbps": peak,
                                "quick": args.quick},
                        metrics=metrics, argv=argv)  # fmt: skip


if __name__ == "__main__":
    main()
