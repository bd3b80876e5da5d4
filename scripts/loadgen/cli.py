"""`toppings-loadgen`: open-loop load against a toppings server or scheduler, with latency stats.

    toppings-loadgen --url http://127.0.0.1:8000 --rps 2 --duration 120 \
        [--arrivals poisson|gamma|constant|azure-code|azure-conv] [--cv 2]
        [--lora-assignment identical|distinct|uniform|zipf[:ALPHA]|power[:ALPHA]|azure]
        [--ranks 32,64 | 32:0.7,64:0.3] [--prompt-len 32|uniform:8:64|lmsys] [--output-len ...]
        [--num-requests N] [--seed S] [--save-trace T.jsonl | --trace T.jsonl]
        [--out RUN.jsonl] [--summary RUN.json] [--slo-tpt-ms X] [--plot CDF.png]

`--lora-assignment` (`--popularity` is the same option) picks each request's adapter, the cases
multi-LoRA serving benchmarks drive: `distinct` a different one every request (round robin),
`identical` always one, `uniform`, `zipf:1.0`; `--alpha` is the exponent when the spec gives none.
The adapters are those the target lists in `/v1/models` (ranks from there or from `/stats`);
workload options are described in scripts.workload, measurements in scripts.loadgen_client.
`--trace` replays a saved trace exactly (same adapters, prompts, lengths and arrival offsets);
the workload options are then ignored, except that --duration and --num-requests still cut it.
`--out` is resumable: rerun the same command and the requests already recorded are skipped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
from pathlib import Path

import requests
from tqdm import tqdm

from toppings.scripts.loadgen.client import Journal, run_open_loop
from toppings.scripts.loadgen.stats import format_summary, plot_cdfs, summarise
from toppings.scripts.loadgen.workload import (
    ARRIVALS,
    POPULARITY,
    LengthSpec,
    TraceEntry,
    WorkloadSpec,
    build_trace,
    load_trace,
    parse_assignment,
    parse_rank_mix,
    save_trace,
)

log = logging.getLogger("toppings-loadgen")


def list_models(url: str, timeout_s: float = 10.0) -> tuple[str | None, dict[str, int]]:
    """(base model, {adapter: rank}) of a server or scheduler."""
    models = requests.get(url + "/v1/models", timeout=timeout_s)
    models.raise_for_status()
    data = models.json()["data"]
    base = next((m["id"] for m in data if not m.get("parent")), None)
    ranks = {m["id"]: m.get("rank") for m in data if m.get("parent")}
    if any(r is None for r in ranks.values()):  # a server that does not list ranks there
        stats = requests.get(url + "/stats", timeout=timeout_s)
        stats.raise_for_status()
        ranks.update({a["name"]: a["rank"] for a in stats.json().get("adapters", ())})
    return base, {name: int(rank or 0) for name, rank in ranks.items()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toppings-loadgen", description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server or scheduler base URL")
    w = p.add_argument_group("workload")
    w.add_argument("--rps", type=float, default=1.0, help="mean arrival rate (requests/s)")
    w.add_argument(
        "--arrivals",
        choices=ARRIVALS,
        default="poisson",
        help="azure-code / azure-conv: bursts shaped like the Azure LLM inference trace 2023's "
        "services (a model of its shape, not the trace)",
    )
    w.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of gamma gaps")
    w.add_argument("--duration", type=float, help="seconds of arrivals")
    w.add_argument("--num-requests", type=int, help="at most this many requests")
    w.add_argument(
        "--lora-assignment",
        "--popularity",
        dest="popularity",
        default="uniform",
        metavar="SPEC",
        help=f"which adapter each request names: {' | '.join(POPULARITY)}, or zipf:ALPHA / "
        "power:ALPHA",
    )
    w.add_argument("--alpha", type=float, default=1.0, help="exponent of zipf / power")
    w.add_argument(
        "--ranks",
        type=parse_rank_mix,
        default=(),
        metavar="MIX",
        help="rank mix, e.g. 32,64 or 32:0.7,64:0.3 (default: any adapter)",
    )
    w.add_argument(
        "--prompt-len",
        default="32",
        metavar="SPEC",
        help="N, uniform:LO:HI, lognormal:MEAN:SIGMA or lmsys",
    )
    w.add_argument("--output-len", default="32", metavar="SPEC", help="as --prompt-len")
    w.add_argument("--max-prompt-len", type=int, default=2048)
    w.add_argument("--max-output-len", type=int, default=1024)
    w.add_argument(
        "--token-range",
        default="100:250",
        metavar="LO:HI",
        help="prompt token ids are drawn from [LO, HI)",
    )
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--trace", help="replay this JSONL trace instead of generating one")
    w.add_argument("--save-trace", help="write the trace to this JSONL file")
    o = p.add_argument_group("run and output")
    o.add_argument("--out", help="JSONL of {config, result}, one line per request (resumable)")
    o.add_argument("--summary", help="write the summary as a benchmark JSON file")
    o.add_argument("--slo-tpt-ms", type=float, help="SLO on time per token, for attainment")
    o.add_argument("--plot", help="draw CDFs of TTFT, time per token and E2E to this PNG")
    o.add_argument("--temperature", type=float, default=0.0)
    o.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    o.add_argument("--max-concurrency", type=int, default=512, help="requests in flight at most")
    o.add_argument("--dry-run", action="store_true", help="make (and save) the trace, send none")
    o.add_argument("--no-progress", action="store_true")
    return p


def make_trace(args: argparse.Namespace) -> list[TraceEntry]:
    if args.trace:
        trace = load_trace(args.trace)
        if args.duration is not None:
            trace = [e for e in trace if e.arrival_s < args.duration]
        return trace[: args.num_requests] if args.num_requests is not None else trace
    lo, _, hi = args.token_range.partition(":")
    popularity, alpha = parse_assignment(args.popularity, args.alpha)
    spec = WorkloadSpec(
        rps=args.rps,
        arrivals=args.arrivals,
        cv=args.cv,
        duration_s=args.duration,
        num_requests=args.num_requests,
        popularity=popularity,
        alpha=alpha,
        rank_mix=args.ranks,
        seed=args.seed,
        token_range=(int(lo), int(hi)),
        prompt_len=LengthSpec.parse(args.prompt_len, args.max_prompt_len, "prompt"),
        output_len=LengthSpec.parse(args.output_len, args.max_output_len, "output"),
    )
    base, adapters = list_models(args.url)
    return build_trace(spec, adapters, base)


def describe(trace: list[TraceEntry]) -> dict:
    num = max(len(trace), 1)
    by_model: dict[str, int] = {}
    for e in trace:
        by_model[e.model] = by_model.get(e.model, 0) + 1
    return {
        "num_requests": len(trace),
        "span_s": trace[-1].arrival_s if trace else 0.0,
        "mean_prompt_tokens": sum(len(e.prompt) for e in trace) / num,
        "mean_output_tokens": sum(e.max_tokens for e in trace) / num,
        "num_models_used": len(by_model),
        "share_top1_model": max(by_model.values(), default=0) / num,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args.url = args.url.rstrip("/")
    if not args.trace and args.duration is None and args.num_requests is None:
        sys.exit("toppings-loadgen: give --duration and/or --num-requests (or --trace)")
    try:
        trace = make_trace(args)
    except (ValueError, OSError, requests.RequestException) as e:
        sys.exit(f"toppings-loadgen: {e}")
    if args.save_trace:
        save_trace(trace, args.save_trace)
    print(f"trace: {json.dumps(describe(trace))}")
    if args.dry_run:
        return 0
    journal = Journal(args.out) if args.out else None
    try:
        pending = journal.pending(trace) if journal else trace
    except ValueError as e:
        sys.exit(f"toppings-loadgen: {e}")
    if len(pending) < len(trace):
        print(f"skipping {len(trace) - len(pending)} requests already in {args.out}")
    records: list[dict] = []
    bar = tqdm(total=len(pending), unit="req", disable=args.no_progress, dynamic_ncols=True)

    def on_done(entry: TraceEntry, result: dict) -> None:
        if journal:
            journal.write(entry, result)
        records.append({"config": {"idx": entry.idx}, "result": result})
        bar.update(1)
        if not result["ok"]:
            bar.write(f"request {entry.idx} ({entry.model}) failed: {result['error']}")

    try:
        run_open_loop(
            args.url, pending, on_done, args.temperature, args.timeout, args.max_concurrency
        )
    except KeyboardInterrupt:
        print("\ninterrupted; finished requests are kept" + (f" in {args.out}" if args.out else ""))
    finally:
        bar.close()
        if journal:
            journal.close()
    wanted = {e.idx for e in trace}
    if journal:
        records = [r for i, r in journal.records.items() if i in wanted]
    summary = summarise(records, args.slo_tpt_ms)
    print(format_summary(summary))
    if args.summary:
        write_summary(args, trace, summary)
    if args.plot and records:
        plot_cdfs(
            {args.url: records}, args.plot, f"{args.url}, {len(records)} requests", args.slo_tpt_ms
        )
    return 0 if summary["num_ok"] or not records else 1


def write_summary(args: argparse.Namespace, trace: list[TraceEntry], summary: dict) -> None:
    config = {k: v for k, v in vars(args).items() if k not in ("summary", "plot", "no_progress")}
    result = {
        "name": Path(args.summary).stem,
        "device": f"client of {args.url}",
        "command": "toppings-loadgen " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": dict(config, trace=describe(trace)),
        "metrics": summary,
    }
    Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
    Path(args.summary).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
