"""CPU LoRA worker pool vs torch intra-op threads on the same cores (Toppings Fig. 17).

    nice -n -10 python -m bench.bench_cpu_lora_parallel --out bench/results/cpu_lora_parallel.json

One layer call of 256 tokens, hidden 4096, rank 64, q/k/v, computed on the same cores by the
pool (one pinned single-threaded worker per core, tokens split by the pool's profile) and by
in-process torch with as many intra-op threads as cores, reading the same shared-memory
weights; in-process torch on one thread is timed as well, as the yardstick of the scaling.
Calls alternate (with a pause between, so none inherits another's spinning threads) and ratios
of medians are reported, for float32 and bfloat16 arenas, for one 256-token request and for
four 64-token requests of different adapters.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from bench.common import QKV, Adapter, Shapes
from bench.envelope import describe_device, write_result
from toppings.cpu_lora import CpuLoraPool, HostRepository


def make_repository(shapes: Shapes, rank: int, count: int, dtype: torch.dtype):
    repo = HostRepository.create(shapes, capacity_bytes=count * 8 << 20, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    for i in range(count):
        weights = {}
        for module in QKV:
            h_in, h_out = shapes.projection_shape(module)
            a = torch.randn(rank, h_in, generator=gen) / h_in**0.5
            weights[(0, module)] = (a, torch.randn(h_out, rank, generator=gen) / rank**0.5)
        repo.add(Adapter(i + 1, f"a{i}", rank, 2.0, weights))
    return repo


def threads_call(repo: HostRepository, x: torch.Tensor, segments) -> dict[str, torch.Tensor]:
    """The same arithmetic in-process, parallelised by torch's intra-op threads."""
    outs = {m: torch.zeros(x.shape[0], repo.shapes[m][1], dtype=x.dtype) for m in QKV}
    for adapter_id, start, end in segments:
        _, scale, views = repo.layer_tensors(repo.lookup(adapter_id), 0)
        for module in QKV:
            a, bt = views[module]
            torch.mm(torch.mm(x[start:end], a.T).mul_(scale), bt, out=outs[module][start:end])
    return outs


def compare(pool, repo, x, segments, calls: int, pause_s: float) -> dict:
    got, want = pool.run(0, x, segments, QKV), threads_call(repo, x, segments)
    tol = 1e-3 if x.dtype == torch.float32 else 5e-2
    assert all(torch.allclose(got[m].float(), want[m].float(), atol=tol) for m in QKV)
    times, workers = {"pool": [], "threads": [], "one_thread": []}, set()
    calls_by_name = {
        "pool": lambda: pool.run(0, x, segments, QKV),
        "threads": lambda: threads_call(repo, x, segments),
        "one_thread": lambda: threads_call(repo, x, segments),
    }
    for _ in range(calls):
        for name, call in calls_by_name.items():
            torch.set_num_threads(1 if name == "one_thread" else len(os.sched_getaffinity(0)))
            start = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - start) * 1e3)
            time.sleep(pause_s)
        workers.add(len(pool.last_call.worker_compute_ns))
    p50 = {name: float(np.median(t)) for name, t in times.items()}
    return {
        "pool_p50_ms": p50["pool"],
        "threads_p50_ms": p50["threads"],
        "one_thread_p50_ms": p50["one_thread"],
        "speedup": p50["threads"] / p50["pool"],
        "speedup_vs_one_thread": p50["one_thread"] / p50["pool"],
        "workers_used": sorted(workers),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--pause-ms", type=float, default=20.0)
    p.add_argument("--out", default="bench/results/cpu_lora_parallel.json")
    args = p.parse_args(argv)
    shapes, cores = Shapes(), sorted(os.sched_getaffinity(0))
    torch.set_num_threads(len(cores))
    quarter = args.tokens // 4
    workloads = {
        "1_request": [(1, 0, args.tokens)],  # adapter ids (make_repository: 1..count)
        "4_requests": [(i + 1, i * quarter, (i + 1) * quarter) for i in range(4)],
    }
    runs, profiles = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        label = str(dtype).removeprefix("torch.")
        repo = make_repository(shapes, args.rank, 4, dtype)
        pool = CpuLoraPool(repo, shapes, len(cores), cores, max_tokens=args.tokens, modules=QKV)
        try:
            profiles[label] = {
                "tokens_per_core": pool.tokens_per_core,
                "overhead_us": pool.profile_result.overhead_us,
                "tokens_per_ms": pool.profile_result.tokens_per_ms(),
            }
            x = torch.randn(args.tokens, shapes.hidden).to(dtype)
            for name, segments in workloads.items():
                runs[f"{label}_{name}"] = compare(
                    pool, repo, x, segments, args.calls, args.pause_ms / 1e3
                )
                print(label, name, runs[f"{label}_{name}"], flush=True)
        finally:
            pool.close()
            repo.close()
    load = os.getloadavg()
    result = write_result(
        args.out,
        "cpu_lora_parallel",
        "bench_cpu_lora_parallel",
        device=describe_device(),
        argv=argv,
        config={
            "tokens": args.tokens,
            "hidden": shapes.hidden,
            "rank": args.rank,
            "modules": list(QKV),
            "calls": args.calls,
            "cores": cores,
            "niceness": os.nice(0),  # run under `nice -n -10` to keep other jobs' slices short
            "workers": len(cores),
            "torch_threads": len(cores),
            "note": f"this machine has {len(cores)} cores, so the pool has {len(cores)} workers "
            f"and torch {len(cores)} threads; other jobs shared the machine "
            f"(load average {load[0]:.1f} at the end)",
            "profiles": profiles,
        },
        metrics={
            "speedup_pool_vs_threads": runs["float32_1_request"]["speedup"],
            "speedup_pool_vs_threads_4_requests": runs["float32_4_requests"]["speedup"],
            "speedup_pool_vs_threads_bf16": runs["bfloat16_1_request"]["speedup"],
            "speedup_pool_vs_threads_bf16_4_requests": runs["bfloat16_4_requests"]["speedup"],
            "speedup_pool_vs_one_thread": runs["float32_1_request"]["speedup_vs_one_thread"],
            "speedup_pool_vs_one_thread_bf16": runs["bfloat16_1_request"]["speedup_vs_one_thread"],
            "pool_bf16_vs_fp32": runs["float32_1_request"]["pool_p50_ms"]
            / runs["bfloat16_1_request"]["pool_p50_ms"],
            "runs": runs,
        },
    )
    print(json.dumps(result["metrics"], indent=2))


if __name__ == "__main__":
    main()
