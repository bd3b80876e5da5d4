"""A CPU LoRA worker process: one pinned core, one torch thread, jobs from shared memory.

Started by the pool as `python -m cpu_lora.worker ...` (under `numactl --physcpubind=N
--localalloc` when numactl is installed). A plain subprocess rather than multiprocessing:
the command line can be wrapped by numactl, nothing is pickled, the worker starts from a clean
interpreter (no fork of a threaded torch process, no re-import of the parent's __main__), and
the pool gets a pid it can poll and kill.

Loop: wait on the job semaphore -> read the job slot -> compute -> write the reply -> post the
done semaphore. It exits on a stop job, and on its own when its parent has died, after
unlinking every name the parent created (nobody else would).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time

import posix_ipc
import torch

from toppings.cpu_lora import shm
from toppings.cpu_lora.compute import run_job, wait_for_x
from toppings.cpu_lora.protocol import OP_STOP, STATUS_ERROR, STATUS_OK, IoArena
from toppings.cpu_lora.repository import HostRepository
from toppings.cpu_lora.spin import try_acquire_spinning

log = logging.getLogger("toppings.cpu_lora.worker")

ORPHAN_CHECK_S = 1.0  # how often an idle worker checks that its parent is alive


def serve(args: argparse.Namespace) -> int:
    """Run the job loop until a stop job or the parent's death; returns the exit status."""
    if args.core >= 0 and hasattr(os, "sched_setaffinity"):  # pinning is Linux's
        os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    repo = HostRepository.attach(args.repo)
    io = IoArena.attach(args.io, repo.shapes)
    job_sem = posix_ipc.Semaphore(args.job_sem)
    done_sem = posix_ipc.Semaphore(args.done_sem)
    io.set_worker_pid(args.index, os.getpid())  # the pool's readiness signal
    spin_ns = int(args.spin_us * 1000)
    while True:
        try:
            # Right after a job the next layer's call often follows within the spin window.
            if not (spin_ns and try_acquire_spinning(job_sem, spin_ns)):
                job_sem.acquire(ORPHAN_CHECK_S)
        except posix_ipc.BusyError:
            if os.getppid() != int(args.parent.partition(".")[0]):
                log.warning("parent %s is gone: unlinking its shared memory, exiting", args.parent)
                shm.unlink_orphans(args.parent)
                return 0
            continue
        except posix_ipc.SignalError:
            continue
        job = io.read_job(args.index)
        if job.op == OP_STOP:
            return 0
        status, start = STATUS_OK, time.perf_counter_ns()
        try:
            wait_for_x(io, job)
            start = time.perf_counter_ns()
            run_job(repo, io, job)
        except Exception:  # reported to the pool, which recomputes the slice in-process
            log.exception("job %d failed", job.seq)
            status = STATUS_ERROR
        io.write_reply(args.index, job.seq, status, time.perf_counter_ns() - start)
        done_sem.release()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="CPU LoRA worker (started by CpuLoraPool)")
    parser.add_argument("--repo", required=True, help="shared memory name of the repository")
    parser.add_argument("--io", required=True, help="shared memory name of the I/O arena")
    parser.add_argument("--index", type=int, required=True, help="this worker's job slot")
    parser.add_argument("--job-sem", required=True)
    parser.add_argument("--done-sem", required=True)
    parser.add_argument("--parent", required=True,
                        help="the pool's process: its shared memory tag, PID.WORD")  # fmt: skip
    parser.add_argument("--core", type=int, default=-1, help="core to pin to; -1: none")
    parser.add_argument("--spin-us", type=float, default=0.0, help="spin before blocking")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s[%(process)d]: %(message)s")
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return serve(args)


if __name__ == "__main__":
    raise SystemExit(main())
