"""One change to a decode step, measured in one process whose steps alternate without it (A)
and with it (B): a shared host's drift (its read rate moves 25-45 GB/s within minutes here)
weighs on both sides of each pair alike, so that a few percent are resolved where separate runs,
or two servers through HTTP, are not (bench_single_stream's A/A control: 10% on adapter rows).

One request decodes `--new-tokens` after a `--prompt-len` prompt, `--rounds` times (the first a
warm-up); decode steps after the prompt go in pairs, A then B, then B then A (so that neither
side is always second), and the result is the median of the pairs' ratios B / A, with its
quartiles and the median step of each side.
`--change none` toggles nothing: the harness's own reading (it should read 1.00).

Changes:
  none        nothing
  whole-step  the decode step whole in one native call (server/model/decode_path.py,
              `run_to_logits`: the embedding and RoPE rows, the layers, the final norm and
              lm_head) against the layers alone with the rest from Python
  scan-in-step  the one-call step's logits widened to float32 and scanned (finite rows,
              argmax) in that call against `.float()` and `scan_logits` from Python after it
  huge-pages  the GEMVs' weights in 2 MiB pages (server/model/huge_pages.py) against a second
              engine's, built without, in 4 KiB pages (its decode path swapped in)
  int8-weights  a second engine's int8 weights against the first's (`--precisions bfloat16`):
              int8 / bf16 of the whole step with the same Python around it
  adapter     the request's adapter applied (B) against its steps as the base model's (A), the
              same request (`--adapter-ranks` above 0): adapter / base of a whole step, its
              LoRA batch and native rows included (use `--block`)

    python -m bench.pair_steps --change whole-step --precisions float32,bfloat16,int8,int4 \
        --adapter-ranks 0,16
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from bench.common import write_random_adapter
from bench.envelope import describe_device, write_result
from toppings.gpu_lora.targets import LORA_TARGETS
from toppings.server.config import EngineConfig
from toppings.server.engine.engine import Engine
from toppings.server.model import huge_pages
from toppings.server.model.loader import load_checkpoint, resolve_model_dir
from toppings.server.requests.request import GenerationRequest, SamplingParams

TARGETS = LORA_TARGETS  # every projection


def _nothing(engine: Engine, build: Callable[..., Engine], keep: list) -> Callable[[bool], None]:
    return lambda on: None


def _whole_step(engine: Engine, build, keep: list) -> Callable[[bool], None]:
    path = engine.model.decode_path
    if path is None or not path.whole_step:
        raise SystemExit("pair_steps: this model has no whole-step native call here")
    return lambda on: setattr(path, "whole_step", on)


def _scan_in_step(engine: Engine, build, keep: list) -> Callable[[bool], None]:
    _whole_step(engine, build, keep)  # refuses a model without the one-call step
    path = engine.model.decode_path
    return lambda on: setattr(path, "scan_in_step", on)


def _swap_paths(engine: Engine, other: Engine, keep: list, with_other: bool):
    """Steps of the change's side (on) run `other`'s decode path (with_other) or engine's own;
    the other side's steps the other one. `other` is shut down with engine (keep)."""
    keep.append(other)
    own, theirs = engine.model.decode_path, other.model.decode_path
    if own is None or theirs is None:
        raise SystemExit("pair_steps: this model has no native decode path here")
    return lambda on: setattr(engine.model, "decode_path", theirs if on == with_other else own)


def _huge_pages(engine: Engine, build, keep: list) -> Callable[[bool], None]:
    """A second engine built with its weights where they were loaded (4 KiB pages); its decode
    path (the C structs over its weights) swapped into the first engine for A steps."""
    with huge_pages.disabled():
        plain = build()
    return _swap_paths(engine, plain, keep, with_other=False)


def _int8_weights(engine: Engine, build, keep: list) -> Callable[[bool], None]:
    """A second engine of int8 weights (same activations); its decode path swapped into the
    first for B steps: int8 / the first's weights of a whole step, the same Python around it."""
    if engine.config.quantization != "none":
        raise SystemExit("pair_steps: --change int8-weights pairs against unquantized weights")
    return _swap_paths(engine, build(quantization="int8"), keep, with_other=True)


def _adapter(engine: Engine, build, keep: list) -> Callable[[bool], None]:
    """Steps of the off side see every request as the base model's: the runner's LoRA step is
    asked with no cache entries (it then returns None, as for a base request)."""
    step, on_side = engine.runner.lora.step, [True]

    def lora_step(entries, *args, **kwargs):
        return step(entries if on_side[0] else [None] * len(entries), *args, **kwargs)

    engine.runner.lora.step = lora_step
    return lambda on: on_side.__setitem__(0, on)


# name -> (engine, build another (EngineConfig fields changed), engines to shut down) -> toggle
CHANGES = {
    "none": _nothing, "whole-step": _whole_step, "scan-in-step": _scan_in_step,
    "huge-pages": _huge_pages, "int8-weights": _int8_weights, "adapter": _adapter,
}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--change", choices=sorted(CHANGES), default="whole-step")
    p.add_argument("--model", default="smollm2", help="what toppings-serve --model takes")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="dummy: random weights of the checkpoint's shapes (a real size: "
                   "toppings.scripts.make_dummy_model)")  # fmt: skip
    p.add_argument("--precisions", default="bfloat16",
                   help="comma list of float32, bfloat16, int8, int4 (int8 / int4: "
                   "--quantization with bfloat16 activations); one engine each")  # fmt: skip
    p.add_argument("--adapter-ranks", default="0",
                   help="comma list: the request's adapter rank (every projection), 0: the base "
                   "model; each precision runs each")  # fmt: skip
    p.add_argument("--threads", type=int, default=0, help="the engine's (0: every core)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=130)
    p.add_argument("--rounds", type=int, default=6, help="requests, the first a warm-up")
    p.add_argument("--block", type=int, default=1,
                   help="steps of one side in a row (module doc; 1: single steps)")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench/results/pair_steps.json"))
    return p.parse_args(argv)


def pair(engine: Engine, toggle, args: argparse.Namespace, adapter) -> dict:
    """Step `args.rounds` requests, decode steps alternating A / B in runs of `args.block`; the
    per-pair ratios."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    times: dict[bool, list[float]] = {False: [], True: []}
    ratios: list[float] = []
    block = args.block
    for round_idx in range(args.rounds):
        high = min(30000, engine.model_config.vocab_size)
        ids = torch.randint(3, high, (args.prompt_len,), generator=gen).tolist()
        engine.submit(GenerationRequest(ids, params, adapter))
        toggle(True)
        engine.step()  # the prompt, in as many steps as the budget makes it
        while any(not seq.is_prefilled for seq in engine.scheduler.running):
            engine.step()
        run, first, run_idx = [], 0.0, 0
        while engine.scheduler.has_work():
            pair_idx, second = divmod(run_idx, 2)
            on = (second == 1) != (pair_idx % 2 == 1)  # A then B, then B then A, ...
            toggle(on)
            began = time.perf_counter()
            engine.step()
            run.append(time.perf_counter() - began)
            if len(run) < block:
                continue  # a run the request's end cuts short is not counted
            kept = run[1:] if block > 1 else run
            seconds = statistics.median(kept)
            if round_idx:
                times[on].extend(kept)
                if second:
                    ratios.append(seconds / first if on else first / seconds)
            first, run, run_idx = seconds, [], run_idx + 1
    toggle(True)
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    return {
        "ratio_b_vs_a": round(median, 4), "ratio_quartiles": [round(q1, 4), round(q3, 4)],
        "pairs": len(ratios), "step_ms_a": round(1000 * statistics.median(times[False]), 3),
        "step_ms_b": round(1000 * statistics.median(times[True]), 3),
    }  # fmt: skip


PRECISIONS = {  # name -> (dtype, quantization)
    "float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"),
    "int8": ("bfloat16", "int8"), "int4": ("bfloat16", "int4"),
}  # fmt: skip


def run_one(args: argparse.Namespace, model_dir: str, precision: str, rank: int) -> dict:
    """One engine of `precision`, its request with an adapter of `rank` (0: none), paired."""
    dtype, quantization = PRECISIONS[precision]
    # cached: the adapter's rows are in place before the first step, so each side's steps are
    # steady-state steps.
    config = EngineConfig(dtype=dtype, quantization=quantization, num_threads=args.threads,
                          adapt_threads=False, lora_mode="cached")  # fmt: skip

    def build(**fields) -> Engine:
        return Engine(replace(config, **fields), load_checkpoint(model_dir, args.load_format))

    engine, keep = build(), []
    work = Path(tempfile.mkdtemp(prefix="pair_steps_"))  # the random adapter's files
    try:
        adapter = None
        if rank:
            path = write_random_adapter(work / "adapter", model_dir, rank, TARGETS, 0)
            engine.add_adapter("adapter", str(path))
            adapter = engine.resolve_adapter("adapter")
        return pair(engine, CHANGES[args.change](engine, build, keep), args, adapter)
    finally:
        for made in (engine, *keep):
            made.shutdown()
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.change == "adapter" and "0" in args.adapter_ranks.split(","):
        raise SystemExit("pair_steps: --change adapter needs adapter ranks above 0")
    model_dir = str(resolve_model_dir(args.model))
    metrics = {}
    for precision in args.precisions.split(","):
        for rank in (int(r) for r in args.adapter_ranks.split(",")):
            key = precision + (f"_adapter_r{rank}" if rank else "")
            metrics[key] = m = run_one(args, model_dir, precision, rank)
            print(f"{args.change} {key}: B / A {m['ratio_b_vs_a']} (quartiles "
                  f"{m['ratio_quartiles']}, {m['pairs']} pairs), step A {m['step_ms_a']} ms, "
                  f"B {m['step_ms_b']} ms", flush=True)  # fmt: skip
    config_out = {k: v for k, v in vars(args).items() if k != "out"}
    write_result(args.out, "pair_steps", "pair_steps", device=describe_device(),
                 config=config_out, metrics=metrics, argv=argv)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
