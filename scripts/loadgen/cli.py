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

import datetime
import json
import logging
import sys
from dataclasses import fields
from pathlib import Path

import requests
from tqdm import tqdm

from toppings.scripts.loadgen.bursts import AZURE_SHAPES
from toppings.scripts.loadgen.cli_args import LoadgenConfig, build_parser
from toppings.scripts.loadgen.client import Journal, run_open_loop
from toppings.scripts.loadgen.stats import format_summary, plot_cdfs, summarise
from toppings.scripts.loadgen.workload import (
    LengthSpec,
    TraceEntry,
    WorkloadSpec,
    build_trace,
    load_trace,
    parse_assignment,
    save_trace,
)
from toppings.server.requests.errors import bearer_header
from toppings.server.settings import build, redact_keys

log = logging.getLogger("toppings-loadgen")


def list_models(
    url: str, timeout_s: float = 10.0, api_key: str | None = None
) -> tuple[str | None, dict[str, int]]:
    """(base model, {adapter: rank}) of a server or scheduler."""
    headers = bearer_header(api_key)
    models = requests.get(url + "/v1/models", timeout=timeout_s, headers=headers)
    models.raise_for_status()
    data = models.json()["data"]
    base = next((m["id"] for m in data if not m.get("parent")), None)
    ranks = {m["id"]: m.get("rank") for m in data if m.get("parent")}
    if any(r is None for r in ranks.values()):  # a server that does not list ranks there
        stats = requests.get(url + "/stats", timeout=timeout_s, headers=headers)
        stats.raise_for_status()
        ranks.update({a["name"]: a["rank"] for a in stats.json().get("adapters", ())})
    return base, {name: int(rank or 0) for name, rank in ranks.items()}


def make_trace(args: LoadgenConfig) -> list[TraceEntry]:
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
    base, adapters = list_models(args.url, api_key=args.api_key)
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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        args = build(LoadgenConfig, build_parser().parse_args(argv))
        trace = make_trace(args)
    except (ValueError, OSError, requests.RequestException) as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        hint = " (the key: --api-key or $TOPPINGS_SCHEDULER_API_KEY)" if status == 401 else ""
        sys.exit(f"toppings-loadgen: {e}{hint}")
    if args.save_trace:
        save_trace(trace, args.save_trace)
    print(f"trace: {json.dumps(describe(trace))}")
    bursty = args.arrivals in AZURE_SHAPES and not args.trace and args.duration is not None
    if bursty and len(trace) < args.rps * args.duration / 2:
        print(f"note: {args.arrivals} arrivals are bursty (off for tens of seconds at a time): "
              f"{len(trace)} requests in {args.duration:g} s against --rps {args.rps:g}; their "
              "long-run rate needs minutes (a longer --duration, or another --seed)")  # fmt: skip
    if args.dry_run:
        return 0
    if not trace:
        sys.exit("toppings-loadgen: the trace holds no request: nothing to send")
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
            args.url, pending, on_done, args.temperature, args.timeout, args.max_concurrency,
            args.api_key,
        )  # fmt: skip
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


def write_summary(args: LoadgenConfig, trace: list[TraceEntry], summary: dict) -> None:
    skipped = ("summary", "plot", "no_progress", "api_key")  # (a key is no result to publish)
    config = {f.name: getattr(args, f.name) for f in fields(args) if f.name not in skipped}
    result = {
        "name": Path(args.summary).stem,
        "device": f"client of {args.url}",
        "command": "toppings-loadgen " + " ".join(redact_keys(sys.argv[1:])),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "config": dict(config, trace=describe(trace)),
        "metrics": summary,
    }
    Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
    Path(args.summary).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
