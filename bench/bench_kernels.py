"""Time the Triton LoRA kernels on a GPU and write bench/results/kernels.json.

    python -m bench.bench_kernels [--peak-gbps 4800] [--dtype bfloat16] [--out FILE]

Each kernel (bgmv/mbgmv x decode/prefill) runs on H = 4096 with ranks 16 and 64; decode over
B in {1, 8, 32, 64} requests, prefill over T in {128, 1024} tokens in segments of 128 (one request
each). Every request has its own adapter, so every adapter row is read (the worst case for
bandwidth). Time is the median over repeats of CUDA-event timings (below: of what);
effective_GBps counts only the bytes that must move: x, y (read and written) and the adapter rows
the batch owns. time_us is the kernels' own time, from iters calls captured in one CUDA graph
(as the engine's decode steps run them); eager_launch_us is the same calls launched back to back
from Python, which the host's launch cost sets for small shapes (about 57 us on an H100 for any
decode batch up to 64). Only kernels on a GPU are timed: interpret-mode timings mean nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
from pathlib import Path

import torch

from bench.envelope import describe_device, write_result

log = logging.getLogger("bench_kernels")

DECODE_BATCHES = (1, 8, 32, 64)
PREFILL_TOKENS = (128, 1024)
RANKS = (16, 64)


def make_case(phase: str, num: int, rank: int, hidden: int, seg_len: int, dtype, device):
    """Inputs of one shape: a pool with one adapter per request, laid out back to back."""
    num_tokens = num
    lengths = [1] * num if phase == "decode" else [seg_len] * (num // seg_len)
    num_requests = len(lengths)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = num_requests * rank

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    lora_a = randn(rows, hidden, scale=hidden**-0.5)  # [C, H_in]
    lora_b = randn(rows, hidden, scale=rank**-0.5)  # [C, H_out]
    x, y = randn(num_tokens, hidden), randn(num_tokens, hidden)
    offsets = torch.arange(num_requests, device=device, dtype=torch.int32) * rank
    ranks = torch.full((num_requests,), rank, device=device, dtype=torch.int32)
    scales = torch.full((num_requests,), 2.0, device=device)
    seg_starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return x, y, lora_a, lora_b, seg_starts.to(device), offsets, ranks, scales


def expected_delta(x, lora_a, lora_b, seg_starts, offsets, ranks, scales) -> torch.Tensor:
    """float32 LoRA delta per token, one matmul pair per segment (checks the kernels once)."""
    delta = torch.zeros(x.shape[0], lora_b.shape[1], device=x.device)
    starts = seg_starts.tolist()
    for seg, (off, r) in enumerate(zip(offsets.tolist(), ranks.tolist(), strict=True)):
        sl = slice(starts[seg], starts[seg + 1])
        a, b = lora_a[off : off + r].float(), lora_b[off : off + r].float()
        delta[sl] = scales[seg] * (x[sl].float() @ a.T) @ b
    return delta


def time_us(fn, iters: int, repeats: int) -> float:
    """Median over repeats of the mean time of iters back-to-back calls, in microseconds."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples)


def replayer(fn, iters: int):
    """A callable running `iters` calls of fn: one replay of a CUDA graph that captured them, or
    the calls launched eagerly where fn cannot be captured (its launcher reads the device); and
    whether it is a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles the kernels) off the capture stream
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
    except RuntimeError as e:
        log.warning("not captured in a graph (%s): launched eagerly", e)
        return (lambda: [fn() for _ in range(iters)]), False
    return graph.replay, True


def time_graph_us(fn, iters: int, repeats: int) -> float | None:
    """GPU time per call: iters calls captured in one CUDA graph and replayed, so the host's
    launch cost (tens of microseconds a Triton launch) drops out; None where the launcher
    cannot be captured (then only the host's timing of it stands)."""
    replay, is_graph = replayer(fn, iters)
    return time_us(replay, 1, repeats) / iters if is_graph else None


def bench_one(kernels, kernel, phase, num, rank, args, dtype) -> dict:
    x, y, lora_a, lora_b, seg_starts, offsets, ranks, scales = make_case(
        phase, num, rank, args.hidden, args.prefill_segment_tokens, dtype, "cuda"
    )
    fn = kernels.table[(kernel, phase)]
    lead = (seg_starts,) if phase == "prefill" else ()
    call_args = (y, x, lora_a, lora_b, *lead, offsets, ranks, scales, rank)

    y0 = y.clone()
    fn(*call_args)
    want = y0.float() + expected_delta(x, lora_a, lora_b, seg_starts, offsets, ranks, scales)
    err = (y.float() - want).abs().max().item()
    if err > 0.05 * max(1.0, want.abs().max().item()):
        raise RuntimeError(f"{kernel}_{phase} num={num} r={rank}: max error {err} vs torch")

    launch = time_us(lambda: fn(*call_args), args.iters, args.repeats)
    graphed = time_graph_us(lambda: fn(*call_args), args.iters, args.repeats)
    t = launch if graphed is None else graphed
    elem = x.element_size()
    moved = (x.numel() + 2 * y.numel() + lora_a.numel() + lora_b.numel()) * elem
    gbps = moved / (t * 1e-6) / 1e9
    return {
        "time_us": round(t, 3),
        "timed_in_graph": graphed is not None,
        "eager_launch_us": round(launch, 3),
        "effective_GBps": round(gbps, 1),
        "fraction_of_peak": round(gbps / args.peak_gbps, 4),
        "bytes": moved,
        "max_abs_error": err,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--peak-gbps", type=float, default=4800.0, help="HBM peak (H100 SXM: 3350, H200: 4800)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--prefill-segment-tokens", type=int, default=128)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("bench/results/kernels.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        print(
            "bench_kernels: kernels are timed on a CUDA GPU only (found none, or TRITON_INTERPRET=1"
            " is set); no result written.",
            file=sys.stderr,
        )
        return 2
    from toppings.gpu_lora.kernels import get_kernels  # imports triton: only on a GPU machine

    kernels = get_kernels("triton")
    dtype = getattr(torch, args.dtype)
    metrics: dict[str, dict] = {}
    for kernel in ("bgmv", "mbgmv"):
        for phase, sizes, label in (
            ("decode", DECODE_BATCHES, "B"),
            ("prefill", PREFILL_TOKENS, "T"),
        ):
            for num in sizes:
                for rank in RANKS:
                    key = f"{label}{num}_r{rank}"
                    result = bench_one(kernels, kernel, phase, num, rank, args, dtype)
                    metrics.setdefault(f"{kernel}_{phase}", {})[key] = result
                    log.info("%s_%s %s: %.1f us (%.1f launched eagerly), %.0f GB/s", kernel,
                             phase, key, result["time_us"], result["eager_launch_us"],
                             result["effective_GBps"])  # fmt: skip

    import triton

    write_result(
        args.out,
        "kernels",
        "bench_kernels",
        device=describe_device("cuda"),
        argv=argv,
        config={
            "hidden": args.hidden,
            "dtype": args.dtype,
            "ranks": list(RANKS),
            "decode_batches": list(DECODE_BATCHES),
            "prefill_tokens": list(PREFILL_TOKENS),
            "prefill_segment_tokens": args.prefill_segment_tokens,
            "adapters": "one distinct adapter per request",
            "bgmv_max_rank": "the batch rank",
            "peak_gbps": args.peak_gbps,
            "iters": args.iters,
            "repeats": args.repeats,
            "torch": torch.__version__,
            "triton": triton.__version__,
        },
        metrics=metrics,
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
