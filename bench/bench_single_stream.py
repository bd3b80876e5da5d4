"""One stream as fast as the memory allows: time per output token (TPOT) of `toppings-serve` at
batch 1, 2, 4 and 8, base model and one adapter, per precision, beside the machine's measured
memory read bandwidth; writes bench/results/single_stream.json.

What is timed: B requests at once (B = each of `--batches`), each a fresh prompt of
`--prompt-len` random token ids (fresh so that no prefix cache serves it) and
`--max-tokens` new tokens with `ignore_eos`, streamed (`/v1/completions`, `stream: true`). A
request's TPOT is the client's time from its first streamed token to its last, over the tokens
between: the engine step, sampling, detokenizing, streaming and HTTP of every token are in it,
the prefill is not. A round's TPOT at B is the median over its B requests. Base rows send the
base model's name, adapter rows the name of one adapter (rank `--rank` on every projection,
random, written once under `--work-dir`) that every request of the row uses.

Rounds alternate: in each round every row (precision server x base/adapter x B, and llama-server
and the baseline server where given) runs once, in an order that flips every round, so that a
shared machine's neighbours weigh on every row alike. The reported TPOT is the median round
with its spread (min, max, every round).

Roofline: the weights a decode step of one request reads are every projection weight (q/k/v,
o, gate/up, down of every layer and the LM head, the embedding when tied) once, in the served
precision (`--quantization`: int8 1 byte, int4 half a byte per weight, scales not counted).
The bandwidth is the best of `--bandwidth-repeats` timed `torch.sum`s over a 1 GiB float32
tensor, taken in this process at the start of every round (a shared host's rate moves by half
within minutes), with `--threads` torch threads. roofline_fraction = (weight bytes per step /
bandwidth) / measured TPOT at batch 1 (1.0: the step takes exactly the time to read its weights
once), taken in each round with that round's bandwidth, the median over rounds reported. The
adapter's rows add their own read: tpot_ratio_adapter_vs_base_floor_batch1 = 1 + (adapter
bytes per step / bandwidth) / base TPOT (the rounds' median bandwidth), the adapter / base
ratio no serving path can go under at that bandwidth.

Optional, side by side in the same rounds:
- llama.cpp's `llama-server` (`--llama-server PATH --gguf-f32 FILE --gguf-bf16 FILE`,
  `--gguf-q8 FILE` beside the int8 rows: its 8-bit format, Q8_0, made by the same
  convert_hf_to_gguf.py with `--outtype q8_0`, and `--gguf-q4 FILE` beside the int4 rows: Q4_1
  (groups of 32 with a scale and a minimum, as our int4's scale and zero), made from the F32
  GGUF by its `llama-quantize ... Q4_1`; see bench/bench_long_prompt.py for the recipe of
  the GGUFs): the same prompts, one request at a
  time, rows at batch 1 only; its own reported `predicted_per_token_ms` and the client-side
  TPOT measured as for toppings. With `--llama-lora-converter` (llama.cpp's
  convert_lora_to_gguf.py, its gguf-py beside it) the bench's adapter is converted to a GGUF
  LoRA (F32 beside the float32 rows, BF16 beside the others: the precision our LoRA computes
  in) and loaded with `--lora`: its adapter rows ask for it at scale 1 and its base rows at
  scale 0 (llama-server's per-request `lora` field; a scale of 0 leaves the adapter out of the
  graph), so that both kinds of row run on one server.
- a baseline toppings-serve run by another interpreter (`--baseline-python`, e.g. the Python of
  a checkout before a change): every row also runs against it; the ratio new / baseline is
  reported per row. Before/after pairs this way share their rounds.

Precision: `--dtypes float32,bfloat16` (toppings-serve `--dtype`); `--quantization int8,int4`
adds rows with toppings-serve `--quantization Q` (activation dtype `--quantization-dtype`), and
is skipped with a message when this toppings-serve has no such flag.

Every figure is the machine's at the time: say whether it was shared.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
import torch

from bench.bench_long_prompt import cpu_flags, llama_version
from bench.common import free_port, write_random_adapter
from bench.envelope import describe_device, write_result
from bench.roofline import bandwidth_probe, read_rate_gbps
from toppings.gpu_lora.targets import LORA_TARGETS

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUANT_BYTES = {"int8": 1.0, "int4": 0.5}  # per weight, scales not counted
TARGETS = LORA_TARGETS  # every projection
ADAPTER = "bench-adapter"


def weight_bytes_per_step(model: str, dtype: torch.dtype, quantization: str | None) -> int:
    """Bytes of the weights one decode step reads (every projection and the LM head, once)."""
    from bench.bench_long_prompt import model_config
    from toppings.server.model.llama import projection_bytes

    mc = model_config(model)
    if quantization is None:
        return projection_bytes(mc, dtype)
    return int(projection_bytes(mc, torch.int8) * QUANT_BYTES[quantization])


def adapter_bytes_per_step(model: str, rank: int, dtype: torch.dtype) -> int:
    """Bytes of the bench's adapter (rank `rank` on every projection of every layer, A and B in
    the activation dtype) one decode step reads."""
    from bench.bench_long_prompt import model_config

    mc = model_config(model)
    h, i, q, kv = (
        mc.hidden_size,
        mc.intermediate_size,
        mc.num_heads * mc.head_dim,
        (mc.num_kv_heads * mc.head_dim),
    )
    # (in + out) of q, k, v, o, gate, up, down
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    return rank * per_layer * mc.num_layers * dtype.itemsize


def has_flag(python: str, flag: str) -> bool:
    """Whether toppings-serve run by `python` accepts `flag`."""
    out = subprocess.run([python, "-m", "toppings.server.cli", "--help"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    return flag in out.stdout


def start_server(python: str, args: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as f:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([python, "-m", "toppings.server.cli", *args], stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def start_llama(binary: Path, gguf: Path, port: int, ctx: int, threads: int, log_path: Path,
                lora: Path | None = None):  # fmt: skip
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-c", str(ctx), "-t", str(threads), "-tb", str(threads), "-np", "1",
           *(["--lora", str(lora)] if lora else [])]  # fmt: skip
    with open(log_path, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
            sys.exit(f"bench_single_stream: {proc.args} exited with {proc.returncode}:\n{tail}")
        try:
            if requests.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    sys.exit(f"bench_single_stream: {url} did not become healthy in {timeout_s:.0f} s")


def stop_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stream_tpot(url: str, body: dict, is_llama: bool) -> dict:
    """Send one streamed request; the client's TPOT (ms) from its first token to its last, the
    number of token events, and llama-server's own per-token time where it reports one."""
    path = "/completion" if is_llama else "/v1/completions"
    stamps, reported = [], None
    with requests.post(url + path, json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if is_llama:
                if event.get("content"):
                    stamps.append(time.perf_counter())
                if event.get("timings"):
                    reported = event["timings"].get("predicted_per_token_ms")
            elif "error" in event:
                raise RuntimeError(f"{url}: {event['error'].get('message')}")
            elif (event.get("choices") or [{}])[0].get("text"):  # not the usage chunk
                stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise RuntimeError(f"{url}: {len(stamps)} streamed tokens, too few to time")
    return {"tpot_ms": 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1),
            "events": len(stamps), "reported_ms": reported}  # fmt: skip


def run_row(url: str, model: str | None, prompts: list[list[int]], max_tokens: int,
            lora_scale: float | None = None) -> dict:  # fmt: skip
    """B streamed requests at once (one per prompt); the median TPOT over them. model None:
    llama-server, its loaded LoRA at `lora_scale` (None: it has none)."""
    results: list[dict | Exception] = [None] * len(prompts)  # type: ignore[list-item]
    is_llama = model is None

    def one(i: int) -> None:
        if is_llama:
            body = {"prompt": prompts[i], "n_predict": max_tokens, "cache_prompt": False,
                    "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip
            if lora_scale is not None:
                body["lora"] = [{"id": 0, "scale": lora_scale}]
        else:
            body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens,
                    "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip
        try:
            results[i] = stream_tpot(url, body, is_llama)
        except Exception as exc:  # noqa: BLE001 - reported below with the row
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if isinstance(r, Exception)]
    if errors:
        raise RuntimeError(f"{url}: {errors[0]}")
    reported = [r["reported_ms"] for r in results if r["reported_ms"] is not None]
    return {"tpot_ms": statistics.median(r["tpot_ms"] for r in results),
            "reported_ms": statistics.median(reported) if reported else None}  # fmt: skip


def convert_lora(converter: Path, model_dir: str, adapter: Path, outtype: str, out: Path) -> Path:
    """The PEFT adapter as a GGUF LoRA of `outtype` (f32 / bf16), by llama.cpp's converter. It
    reads the base's config.json, and needs its `architectures` (ours may hold null: filled
    in from transformers' causal-LM class of its model_type, in a copy beside `out`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = json.loads((Path(model_dir) / "config.json").read_text())
    if not config.get("architectures"):
        config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    base = out.with_suffix(".base")
    base.mkdir(exist_ok=True)
    (base / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(converter.parent / "gguf-py")}
    subprocess.run([sys.executable, str(converter), "--base", str(base), "--outtype", outtype,
                    "--outfile", str(out), str(adapter)],
                   check=True, capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    return out


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2),
            "max": round(max(values), 2), "all": [round(v, 2) for v in values]}  # fmt: skip


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and each option's default."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=HelpFormatter,
        epilog="Example, every row with llama-server beside: python -m "
        "bench.bench_single_stream --llama-server /work/llama-build/build/bin/llama-server \\\n"
        "  --gguf-f32 /work/llama-build/SmolLM2-135M-Instruct-f32.gguf \\\n"
        "  --gguf-bf16 /work/llama-build/SmolLM2-135M-Instruct-bf16.gguf",
    )
    add = parser.add_argument
    add("--model", default="smollm2", help="what toppings-serve --model takes (default smollm2)")
    add("--dtypes", default="float32,bfloat16", help="toppings-serve --dtype values, comma list")
    add("--quantization", default="",
        help="comma list of toppings-serve --quantization values (int8,int4): rows of their own; "
        "skipped with a message where toppings-serve has no --quantization flag")  # fmt: skip
    add("--quantization-dtype", default="bfloat16", help="--dtype of the quantized rows")
    add("--batches", default="1,2,4,8", help="concurrent requests per row, comma list")
    add("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    add("--prompt-len", type=int, default=128, help="prompt tokens (random ids, fresh each row)")
    add("--max-tokens", type=int, default=64, help="new tokens per request (ignore_eos)")
    add("--rank", type=int, default=16, help="the adapter's rank (every projection, every layer)")
    add("--no-adapter", action="store_true", help="base rows only")
    add(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch threads here (bandwidth), toppings-serve --torch-threads, llama-server -t",
    )
    add("--bandwidth-repeats", type=int, default=8, help="timed 1 GiB reads, best taken")
    add("--serve-args", default="", help="more toppings-serve arguments, one string")
    add("--baseline-python", default=None,
        help="a Python whose `-m toppings.server.cli` is the code to compare against (e.g. "
        "another checkout's venv): its server runs every row too, in the same rounds")  # fmt: skip
    add("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
    add("--gguf-f32", type=Path, default=None, help="F32 GGUF of the model, for llama-server")
    add("--gguf-bf16", type=Path, default=None, help="BF16 GGUF of the model, for llama-server")
    add("--gguf-q8", type=Path, default=None,
        help="Q8_0 GGUF of the model, for llama-server beside the int8 rows")  # fmt: skip
    add(
        "--llama-lora-converter",
        type=Path,
        default=None,
        help="llama.cpp's convert_lora_to_gguf.py: llama-server serves the adapter rows too",
    )
    add("--gguf-q4", type=Path, default=None,
        help="Q4_1 GGUF of the model, for llama-server beside the int4 rows")  # fmt: skip
    add("--seed", type=int, default=0, help="seeds the prompts and the adapter's weights")
    add("--work-dir", type=Path, default=None, help="the adapter and server logs; none: a temp dir")
    add("--out", type=Path, default=Path("bench/results/single_stream.json"), help="result file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="single_stream_"))
    work.mkdir(parents=True, exist_ok=True)
    log.info("adapter and server logs in %s", work)
    batches = [int(b) for b in args.batches.split(",")]
    python = sys.executable
    from bench.bench_long_prompt import model_config
    from toppings.server.model.loader import resolve_model_dir

    model_dir = str(resolve_model_dir(args.model))
    vocab = model_config(args.model).vocab_size
    # precision rows: (label, toppings-serve flags, weight bytes per step)
    precisions = []
    for name in filter(None, args.dtypes.split(",")):
        precisions.append((name, ["--dtype", name],
                           weight_bytes_per_step(args.model, DTYPES[name], None)))  # fmt: skip
    skipped = {}
    for q in filter(None, args.quantization.split(",")):
        if not has_flag(python, "--quantization"):
            skipped[q] = "this toppings-serve has no --quantization flag"
            log.warning("quantization %s skipped: %s", q, skipped[q])
            continue
        flags = ["--dtype", args.quantization_dtype, "--quantization", q]
        precisions.append((q, flags, weight_bytes_per_step(args.model, torch.int8, q)))
    adapter_args, path = [], None
    if not args.no_adapter:
        path = write_random_adapter(work / "adapter", model_dir, args.rank, TARGETS, args.seed)
        adapter_args = ["--lora", f"{ADAPTER}={path}"]
    probe = bandwidth_probe(1 << 30)  # 1 GiB
    bandwidths: dict[int, float] = {}  # round -> GB/s at its start

    servers = {}  # (precision, side) -> url, side "new" | "baseline" | "llama"
    procs: list[subprocess.Popen] = []
    ggufs = {"float32": args.gguf_f32, "bfloat16": args.gguf_bf16, "int8": args.gguf_q8,
             "int4": args.gguf_q4}  # fmt: skip
    llama_loras: dict[str, Path] = {}  # GGUF LoRA by outtype
    llama_lora: dict[str, bool] = {}  # precision -> its llama-server has the adapter
    try:
        for label, flags, _ in precisions:
            sides = [("new", python)] + ([("baseline", args.baseline_python)]
                                         if args.baseline_python else [])  # fmt: skip
            for side, exe in sides:
                port = free_port()
                log_path = work / f"toppings_{label}_{side}.log"
                serve = ["--model", args.model, "--port", str(port), "--torch-threads",
                         str(args.threads), *flags, *adapter_args,
                         *args.serve_args.split()]  # fmt: skip
                procs.append(start_server(exe, serve, log_path))
                wait_healthy(f"http://127.0.0.1:{port}", procs[-1], log_path, 900.0)
                servers[(label, side)] = f"http://127.0.0.1:{port}"
            if args.llama_server and ggufs.get(label):
                port = free_port()
                log_path = work / f"llama_{label}.log"
                lora = None
                if args.llama_lora_converter and adapter_args:
                    outtype = "f32" if label == "float32" else "bf16"
                    lora = llama_loras.get(outtype) or convert_lora(
                        args.llama_lora_converter, model_dir, path, outtype,
                        work / f"adapter-{outtype}.gguf")  # fmt: skip
                    llama_loras[outtype] = lora
                procs.append(start_llama(args.llama_server, ggufs[label], port,
                                         args.prompt_len + args.max_tokens + 64, args.threads,
                                         log_path, lora))  # fmt: skip
                llama_lora[label] = lora is not None
                wait_healthy(f"http://127.0.0.1:{port}", procs[-1], log_path, 300.0)
                servers[(label, "llama")] = f"http://127.0.0.1:{port}"
        base_name = requests.get(servers[(precisions[0][0], "new")] + "/v1/models",
                                 timeout=10).json()["data"][0]["id"]  # fmt: skip
        rows = []  # (precision, side, adapter?, batch)
        for (label, side), _url in servers.items():
            for batch in batches if side != "llama" else [1]:
                rows.append((label, side, False, batch))
                if adapter_args and (side != "llama" or llama_lora.get(label)):
                    rows.append((label, side, True, batch))
        # rows compared side by side run next to each other: the machine's speed drifts
        order_of = {label: i for i, (label, _, _) in enumerate(precisions)}
        rows.sort(key=lambda row: (order_of[row[0]], row[3], row[2]))
        gen = torch.Generator().manual_seed(args.seed)
        times: dict[tuple, list[dict]] = {row: [] for row in rows}
        failures: list[str] = []  # rows that failed (a server that died): reported, not timed
        for round_idx in range(args.rounds + 1):  # round 0: warm-up
            order = rows if round_idx % 2 == 0 else rows[::-1]
            bandwidths[round_idx] = read_rate_gbps(probe, args.bandwidth_repeats)
            log.info("round %d: memory read bandwidth %.1f GB/s", round_idx,
                     bandwidths[round_idx])  # fmt: skip
            for row in order:
                label, side, with_adapter, batch = row
                prompts = [torch.randint(100, vocab - 100, (args.prompt_len,),
                                         generator=gen).tolist() for _ in range(batch)]  # fmt: skip
                model = None if side == "llama" else ADAPTER if with_adapter else base_name
                scale = float(with_adapter) if side == "llama" and llama_lora.get(label) else None
                try:
                    result = run_row(servers[(label, side)], model, prompts, args.max_tokens,
                                     scale)  # fmt: skip
                except (RuntimeError, requests.RequestException) as exc:
                    log.warning("round %d %s %s: failed (%s)", round_idx, label, side, exc)
                    failures.append(f"round {round_idx} {row}: {exc}")
                    continue
                kind = "adapter" if with_adapter else "base"
                log.info("round %d %s %s %s B=%d: %.2f ms/token", round_idx, label, side, kind,
                         batch, result["tpot_ms"])  # fmt: skip
                if round_idx:
                    times[row].append({**result, "round": round_idx})
    finally:
        stop_all(procs)
    # round 0 is the warm-up (with --rounds 0, the only reading there is)
    timed = {r: bw for r, bw in bandwidths.items() if r} or bandwidths
    median_bw = statistics.median(timed.values())
    metrics = summarize(args, precisions, {r: t for r, t in times.items() if t}, timed, skipped)
    if path is not None:
        add_adapter_floor(metrics, args, [label for label, _, _ in precisions], median_bw)
    if failures:
        metrics["failed_rows"] = failures
    metrics["bandwidth_GBps"] = round(median_bw, 2)  # the rounds' median
    metrics["bandwidth_GBps_rounds"] = [round(timed[r], 2) for r in sorted(timed)]
    config = {
        "model": args.model, "batches": batches, "rounds": args.rounds,
        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rank": args.rank,
        "threads": args.threads, "serve_args": args.serve_args,
        "baseline_python": args.baseline_python, "cpu_flags": cpu_flags(),
        "llama_server": llama_version(args.llama_server) if args.llama_server else None,
        "niceness": os.nice(0),
        "tpot": "client time from first to last streamed token over the tokens between; "
        "median over a row's requests, median round reported",
        "ratios": "the tpot_ratio_* keys: median over rounds of the two rows' ratio in the same "
        "round (rows compared run next to each other)",
    }  # fmt: skip
    write_result(args.out, "single_stream", "bench_single_stream", device=describe_device(),
                 config=config, metrics=metrics, argv=argv)  # fmt: skip
    log.info("%s", json.dumps({k: v for k, v in metrics.items() if not isinstance(v, dict)
                               or k.endswith("batch1")}, indent=1))  # fmt: skip
    return 0


def paired_ratio(times: dict, row: tuple, other: tuple) -> float | None:
    """The median over rounds of row's TPOT / other's in the same round (None: no round ran
    both): a ratio of rows run minutes apart would carry the machine's drift between them."""
    by_round = {r["round"]: r["tpot_ms"] for r in times.get(other, [])}
    ratios = [r["tpot_ms"] / by_round[r["round"]] for r in times.get(row, [])
              if r["round"] in by_round]  # fmt: skip
    return round(statistics.median(ratios), 3) if ratios else None


def roofline_fraction(times: dict, row: tuple, nbytes: int, bandwidths: dict) -> float | None:
    """The median over rounds of (nbytes at that round's bandwidth, GB/s) / row's TPOT in it
    (None: no round both timed the row and read the bandwidth)."""
    fractions = [nbytes / bandwidths[r["round"]] / 1e6 / r["tpot_ms"]
                 for r in times.get(row, []) if r["round"] in bandwidths]  # fmt: skip
    return round(statistics.median(fractions), 3) if fractions else None


def summarize(args, precisions, times: dict, bandwidths: dict, skipped: dict) -> dict:
    """The result's metrics: per precision and side, TPOT per row; the headline keys (ratios
    and roofline fractions paired by round; bandwidths: round -> GB/s)."""
    metrics: dict = {"tpot_ms_batch1": {}, "roofline_fraction_batch1": {},
                     "tpot_ratio_adapter_vs_base_batch1": {},
                     "weight_bytes_per_step": {}}  # fmt: skip
    med = {row: statistics.median(r["tpot_ms"] for r in rs) for row, rs in times.items()}
    for label, _flags, nbytes in precisions:
        metrics["weight_bytes_per_step"][label] = nbytes
        per = metrics.setdefault(label, {})
        for (lab, side, with_adapter, batch), results in times.items():
            if lab != label:
                continue
            kind = "adapter" if with_adapter else "base"
            key = f"{side}_{kind}_batch{batch}"
            per[key] = spread([r["tpot_ms"] for r in results])
            if side == "llama":
                reported = [r["reported_ms"] for r in results if r["reported_ms"] is not None]
                if reported:  # llama_reported_batch1: base rows (the key earlier results have)
                    name = "" if kind == "base" else "adapter_"
                    per[f"llama_reported_{name}batch{batch}"] = spread(reported)
            new = med.get((lab, "new", with_adapter, batch))
            if side == "baseline" and new is not None:
                ratio = new / med[(lab, side, with_adapter, batch)]
                per[f"ratio_new_vs_baseline_{kind}_batch{batch}"] = round(ratio, 3)
        base1 = med.get((label, "new", False, 1))
        if base1 is None:
            continue
        metrics["tpot_ms_batch1"][label] = round(base1, 2)
        new_base, new_adapter = (label, "new", False, 1), (label, "new", True, 1)
        fraction = roofline_fraction(times, new_base, nbytes, bandwidths)
        if fraction is not None:
            metrics["roofline_fraction_batch1"][label] = fraction
        for key, row, other in (
            ("tpot_ratio_adapter_vs_base_batch1", new_adapter, new_base),
            ("tpot_ratio_vs_llama_server_batch1", new_base, (label, "llama", False, 1)),
            ("tpot_ratio_vs_llama_server_adapter_batch1", new_adapter, (label, "llama", True, 1)),
        ):
            ratio = paired_ratio(times, row, other)
            if ratio is not None:
                metrics.setdefault(key, {})[label] = ratio
    floats = [label for label in DTYPES if label in metrics["tpot_ms_batch1"]]
    if "int8" in metrics["tpot_ms_batch1"] and floats:
        best = min(floats, key=lambda f: metrics["tpot_ms_batch1"][f])
        ratio = paired_ratio(times, ("int8", "new", False, 1), (best, "new", False, 1))
        if ratio is not None:
            metrics["tpot_ratio_int8_vs_float"] = ratio
    if skipped:
        metrics["skipped"] = skipped
    return metrics


def add_adapter_floor(metrics: dict, args, labels: list[str], bandwidth: float) -> None:
    """The adapter / base ratio at batch 1 that reading the adapter's rows alone sets: 1 +
    (adapter bytes / bandwidth) / base TPOT. A serving path that added nothing but that read
    would measure it; the adapter's rows cannot be read for less."""
    floors, sizes = {}, {}
    for label in labels:
        base1 = metrics["tpot_ms_batch1"].get(label)
        dtype = DTYPES.get(label, DTYPES.get(args.quantization_dtype, torch.bfloat16))
        sizes[label] = adapter_bytes_per_step(args.model, args.rank, dtype)
        if base1:
            floors[label] = round(1 + sizes[label] / bandwidth / 1e9 * 1e3 / base1, 3)
    metrics["adapter_bytes_per_step"] = sizes
    metrics["tpot_ratio_adapter_vs_base_floor_batch1"] = floors


if __name__ == "__main__":
    raise SystemExit(main())
