"""Invocation overhead of one CPU LoRA layer call: shared memory vs a UNIX-socket transport.

    nice -n -10 python -m bench.bench_cpu_lora_ipc --out bench/results/cpu_lora_ipc.json

Overhead = round trip of one layer call minus the slowest worker's own compute time. The job is
16 tokens of a 4096-hidden layer, rank 64, q/k/v (Llama-2-7B shapes). Shared memory is
cpu_lora's pool (x written once, one semaphore per worker). The socket transport sends each
worker its slice of x over a socketpair, the worker computes the same arithmetic from the same
repository and sends its rows of the outputs back. Both use 1, 2, 4, 8 workers, each worker
given 16/N tokens; calls of the two transports are interleaved so load on the machine hits both.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import QKV, Adapter, Shapes
from bench.envelope import describe_device, write_result
from toppings.cpu_lora import CpuLoraPool, HostRepository
from toppings.cpu_lora.serial_copy import copy_serial

REPO = Path(__file__).resolve().parents[1]  # socket workers run `-m bench.…` from here
HEADLINE = "shm_spin_views"  # the engine's call (x copied in, outputs in place), spinning
SOCK_REQ = struct.Struct("<III")  # row_start, row_end, hidden
SOCK_REPLY = struct.Struct("<Q")  # compute ns
BENCH_ID = 1  # the one adapter's id in the repository


def make_repository(shapes: Shapes, rank: int) -> HostRepository:
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for module in QKV:
        h_in, h_out = shapes.projection_shape(module)
        weights[(0, module)] = (
            torch.randn(rank, h_in, generator=gen) / h_in**0.5,
            torch.randn(h_out, rank, generator=gen) / rank**0.5,
        )
    repo = HostRepository.create(shapes, capacity_bytes=64 << 20, max_adapters=4)
    repo.add(Adapter(BENCH_ID, "bench", rank, 2.0, weights))
    return repo


def socket_worker(fd: int, repo_name: str, core: int) -> None:
    """Serve jobs from a socket: read x rows, compute q/k/v deltas, send the rows back."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    repo = HostRepository.attach(repo_name)
    rank, scale, views = repo.layer_tensors(repo.lookup(BENCH_ID), 0)
    sock = socket.socket(fileno=fd)
    x_buf = torch.empty(1 << 22, dtype=torch.float32)
    head = bytearray(SOCK_REQ.size)
    while True:
        if sock.recv_into(head, SOCK_REQ.size, socket.MSG_WAITALL) == 0:
            return
        lo, hi, h_in = SOCK_REQ.unpack(head)
        x = x_buf[: (hi - lo) * h_in].view(hi - lo, h_in)
        sock.recv_into(memoryview(x.numpy()).cast("B"), x.numel() * 4, socket.MSG_WAITALL)
        start = time.perf_counter_ns()
        outs = []
        for module in QKV:
            a, bt = views[module]
            outs.append(torch.mm(torch.mm(x, a.T).mul_(scale), bt))
        ns = time.perf_counter_ns() - start
        sock.sendall(SOCK_REPLY.pack(ns))
        for out in outs:
            sock.sendall(memoryview(out.numpy()).cast("B"))


class SocketPool:
    """N socket workers, each sent its slice of the tokens."""

    def __init__(self, repo: HostRepository, num_workers: int, cores: list[int]) -> None:
        self.socks, self.procs = [], []
        for i in range(num_workers):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            cmd = [
                sys.executable,
                "-m",
                "bench.bench_cpu_lora_ipc",
                "--socket-worker",
                str(theirs.fileno()),
                repo.name,
                str(cores[i % len(cores)]),
            ]
            env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
            proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], env=env, cwd=REPO)
            self.procs.append(proc)
            theirs.close()
            self.socks.append(ours)
        self.reply = bytearray(SOCK_REPLY.size)

    def run(self, x: torch.Tensor, widths: list[int]) -> tuple[list[torch.Tensor], list[int]]:
        """({module: [T, H_out]} as a list, compute ns per worker)."""
        num_tokens, h_in = x.shape
        bounds = np.linspace(0, num_tokens, len(self.socks) + 1).round().astype(int)
        outs = [torch.empty(num_tokens, w) for w in widths]
        for sock, lo, hi in zip(self.socks, bounds, bounds[1:]):
            sock.sendall(SOCK_REQ.pack(lo, hi, h_in))
            sock.sendall(memoryview(x[lo:hi].numpy()).cast("B"))
        compute = []
        for sock, lo, hi in zip(self.socks, bounds, bounds[1:]):
            sock.recv_into(self.reply, SOCK_REPLY.size, socket.MSG_WAITALL)
            compute.append(SOCK_REPLY.unpack(self.reply)[0])
            for out in outs:
                rows = memoryview(out[lo:hi].numpy()).cast("B")
                sock.recv_into(rows, len(rows), socket.MSG_WAITALL)
        return outs, compute

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        for proc in self.procs:
            proc.wait(timeout=30)


def pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


def measure(args, repo, shapes, n: int, cores: list[int]) -> dict:
    """Overhead, round trip and compute samples (us) of each transport with n workers."""
    x = torch.randn(args.tokens, shapes.hidden)
    widths = [shapes.projection_shape(m)[1] for m in QKV]
    segments = [(BENCH_ID, 0, args.tokens)]
    per_worker = -(-args.tokens // n)

    def make_pool(spin_us: float) -> CpuLoraPool:
        return CpuLoraPool(
            repo,
            shapes,
            n,
            cores,
            max_tokens=args.tokens,
            modules=QKV,
            tokens_per_core=per_worker,
            spin_us=spin_us,
        )

    def pool_calls(pool: CpuLoraPool, prefix: str) -> dict:
        staged = pool.input_buffer(args.tokens, shapes.hidden)

        def copied():
            pool.run(0, x, segments, QKV)
            return pool.last_call.worker_compute_ns

        def views():  # what the engine does: x copied in, outputs read in place
            pool.run(0, x, segments, QKV, copy=False)
            return pool.last_call.worker_compute_ns

        def zero_copy():
            copy_serial(staged, x)  # the caller's own write of its layer input, not timed
            start = time.perf_counter_ns()
            pool.run(0, staged, segments, QKV, copy=False)
            return pool.last_call.worker_compute_ns, start

        return {prefix: copied, f"{prefix}_views": views, f"{prefix}_zero_copy": zero_copy}

    pool, sockets = make_pool(0.0), SocketPool(repo, n, cores)
    try:
        empty_us = pool.measure_overhead_us(calls=200)  # semaphores and wake-ups only
        got = pool.run(0, x, segments, QKV)
        ref, _ = sockets.run(x, widths)
        assert all(torch.allclose(got[m], r, atol=1e-4) for m, r in zip(QKV, ref))
        calls = {**pool_calls(pool, "shm"), "socket": lambda: sockets.run(x, widths)[1]}
        samples = sample(calls, n, args)
    finally:
        pool.close()
        sockets.close()
    # The spinning pool's workers would burn cores during the other transports' calls, so its
    # calls run after theirs rather than interleaved with them. Spinning needs a core per
    # spinner (the caller and each worker): on shared cores they only steal time from each
    # other (2 workers + the caller on 2 cores: 5.9 ms p50), so it is measured only where
    # there are enough cores.
    if n + 1 > len(cores):
        return {"samples": samples, "empty_job_us": empty_us}
    with make_pool(args.spin_us) as spin_pool:
        empty_spin_us = spin_pool.measure_overhead_us(calls=200)
        samples.update(sample(pool_calls(spin_pool, "shm_spin"), n, args))
    return {"samples": samples, "empty_job_us": empty_us, "empty_job_spin_us": empty_spin_us}


def sample(calls: dict, n: int, args) -> dict:
    """{call name: {"overhead", "round_trip", "compute": [us]}}, the calls interleaved.

    A call returns the workers' compute ns, or (compute ns, start ns) when it did untimed
    work of its own before `start`.
    """
    samples = {name: {"overhead": [], "round_trip": [], "compute": []} for name in calls}
    for i in range(args.warmup + args.calls):
        for name, call in calls.items():
            start = time.perf_counter_ns()
            compute = call()
            end = time.perf_counter_ns()
            if isinstance(compute, tuple):
                compute, start = compute
            rt = end - start
            assert len(compute) == n
            if i >= args.warmup:
                samples[name]["overhead"].append((rt - max(compute)) / 1e3)
                samples[name]["round_trip"].append(rt / 1e3)
                samples[name]["compute"].append(max(compute) / 1e3)
    return samples


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--workers", default="1,2,4,8")
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--spin-us", type=float, default=5000.0, help="spin window of the shm_spin rows")
    p.add_argument("--out", default="bench/results/cpu_lora_ipc.json")
    p.add_argument("--socket-worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.socket_worker:
        fd, repo_name, core = args.socket_worker
        return socket_worker(int(fd), repo_name, int(core))
    shapes, cores = Shapes(), sorted(os.sched_getaffinity(0))
    counts = [int(n) for n in args.workers.split(",")]
    repo = make_repository(shapes, args.rank)
    try:
        results = {n: measure(args, repo, shapes, n, cores) for n in counts}
    finally:
        repo.close()
    one, top = results[counts[0]]["samples"], results[counts[-1]]["samples"]

    def by_workers(transport: str, q: float) -> dict[int, float]:
        return {
            n: pct(r["samples"][transport]["overhead"], q)
            for n, r in results.items()
            if transport in r["samples"]
        }

    result = write_result(
        args.out,
        "cpu_lora_ipc",
        "bench_cpu_lora_ipc",
        device=describe_device(),
        argv=argv,
        config={
            "tokens": args.tokens,
            "hidden": shapes.hidden,
            "rank": args.rank,
            "modules": list(QKV),
            "dtype": "float32",
            "workers": counts,
            "calls": args.calls,
            "cores": cores,
            "niceness": os.nice(0),  # run under `nice -n -10` to keep other jobs' slices short
            "note": f"this machine has {len(cores)} cores: worker counts above {len(cores)} are "
            "oversubscribed (workers share cores round-robin); other jobs shared it "
            f"(load average {os.getloadavg()[0]:.1f} at the end)",
            "overhead": "round trip of one layer call minus the slowest worker's compute time",
            "shm": "CpuLoraPool.run(x): copies x in and the outputs out (the default API)",
            "shm_views": "run(x, copy=False): x copied in, outputs read in place (the engine's "
            "call)",
            "shm_zero_copy": "x already in pool.input_buffer() (the caller wrote its layer input "
            "there, untimed) and run(copy=False): outputs read in place",
            "socket": "socketpair per worker; each worker is sent its 16/N rows of x and sends "
            "its rows of q/k/v back (same bytes in total as shm)",
            "shm_spin*": f"as shm*, with pool and workers spinning up to {args.spin_us:g} us on "
            "their semaphores before sleeping (spin_us); measured after the other transports, "
            "only with a core for the caller and one for each worker",
            "headline": f"overhead_p50_us / overhead_p99_us / round_trip / compute: {HEADLINE}, "
            "1 worker",
            "shm_vs_socket_ratio": "socket overhead p50 / shm overhead p50 (>1: shm cheaper)",
        },
        metrics={
            "overhead_p50_us": pct(one[HEADLINE]["overhead"], 50),
            "overhead_p99_us": pct(one[HEADLINE]["overhead"], 99),
            "round_trip_p50_us": pct(one[HEADLINE]["round_trip"], 50),
            "worker_compute_p50_us": pct(one[HEADLINE]["compute"], 50),
            "overhead_p50_us_by_variant": {k: pct(v["overhead"], 50) for k, v in one.items()},
            "overhead_p99_us_by_variant": {k: pct(v["overhead"], 99) for k, v in one.items()},
            "empty_job_round_trip_p50_us": results[counts[0]]["empty_job_us"],
            "empty_job_round_trip_p50_us_spin": results[counts[0]].get("empty_job_spin_us"),
            "overhead_p50_us_by_workers": {
                k: by_workers(k, 50) for k in ("shm", "shm_views", "socket", "shm_spin_views")
            },
            "overhead_p99_us_by_workers": {k: by_workers(k, 99) for k in ("shm", "socket")},
            "shm_vs_socket_ratio_at_max_workers": pct(top["socket"]["overhead"], 50)
            / pct(top["shm"]["overhead"], 50),
            "shm_views_vs_socket_ratio_at_max_workers": pct(top["socket"]["overhead"], 50)
            / pct(top["shm_views"]["overhead"], 50),
        },
    )
    print(json.dumps(result["metrics"], indent=2))


if __name__ == "__main__":
    main()
