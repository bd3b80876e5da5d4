"""What the small operations around a decode step cost once the step's weights have streamed
through the caches: each op timed warm (run again and again) and cold (right after a read of
`--stream-mb` of memory, as a decode step reads its weights), median of `--repeats` each.

The ops are those a batch-1 step runs outside its native layers: torch index writes and reads of
the KV table, reductions and argmax over one row of logits, a small `torch.tensor`, a few lines
of plain Python; beside them what replaced some (numpy indexing of the same table, the native
logits scan). The ratio cold / warm says how much of a step's Python time is cache misses
(docs/benchmarks.md, session 30).

    python -m bench.profile_cold_ops [--stream-mb 256] [--repeats 60]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.envelope import describe_device, write_result
from toppings.server.sampling.logits_scan import scan_logits

VOCAB = 49152  # SmolLM2's


def plain_python() -> list[int]:
    table = {i: i for i in range(50)}
    total = sum(table.values())
    return [x for x in range(100) if x % 3 and total]


def ops() -> dict:
    """name -> a callable running the op once."""
    slots = torch.zeros(64, 8192, dtype=torch.int64)
    as_numpy = slots.numpy()
    logits = torch.randn(1, VOCAB)
    return {
        "torch_index_write": lambda: slots.__setitem__(([3], [100]), torch.tensor([5])),
        "numpy_index_write": lambda: as_numpy.__setitem__(([3], [100]), [5]),
        "torch_index_read": lambda: slots[[3], [100]],
        "amax_row": lambda: logits.amax(dim=1),
        "argmax_row_tolist": lambda: logits.argmax(dim=1).tolist(),
        "finite_check_torch": lambda: (
            logits.amax(dim=1).isfinite() & logits.amin(dim=1).isfinite()
        ).tolist(),
        "scan_logits": lambda: scan_logits(logits),
        "torch_tensor_of_3": lambda: torch.tensor([1, 2, 3]),
        "plain_python": plain_python,
    }


def median_us(op, repeats: int, stream: torch.Tensor | None) -> float:
    times = []
    for _ in range(repeats):
        if stream is not None:
            stream.sum()  # the step's weights, through every cache level
        started = time.perf_counter()
        op()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e6, 2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stream-mb", type=int, default=256, help="memory read before a cold op")
    parser.add_argument("--repeats", type=int, default=60, help="timings per op and state")
    parser.add_argument("--out", default="bench/results/cold_ops.json")
    args = parser.parse_args(argv)
    stream = torch.ones(args.stream_mb * (1 << 20) // 4)
    metrics: dict = {}
    for name, op in ops().items():
        op()  # built and loaded before timing
        warm = median_us(op, args.repeats, None)
        cold = median_us(op, args.repeats, stream)
        metrics[name] = {"warm_us": warm, "cold_us": cold, "cold_over_warm": round(cold / warm, 1)}
        print(f"{name:22s} warm {warm:8.1f} us  cold {cold:8.1f} us")
    config = vars(args) | {"torch_threads": torch.get_num_threads()}
    write_result(
        args.out, "cold_ops", "profile_cold_ops", device=describe_device(), config=config,
        metrics=metrics, argv=argv,
    )  # fmt: skip


if __name__ == "__main__":
    main()
