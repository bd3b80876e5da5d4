"""One worker process as the pool sees it: its semaphores, its process, start/restart/stop."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import posix_ipc

from toppings.cpu_lora import shm
from toppings.cpu_lora.protocol import OP_STOP, IoArena, Job
from toppings.cpu_lora.spin import try_acquire_spinning

log = logging.getLogger(__name__)

POLL_S = 0.05  # a dead worker is noticed within this long
# A replacement worker that exits within STABLE_S of its start is restarted after a delay,
# BACKOFF_MIN_S doubling up to BACKOFF_MAX_S while that goes on (its slices computed in the
# server meanwhile), so that one that cannot run (its shared memory gone) is not a python +
# torch start-up every call; the first worker's death, or one after a stable run, at once.
STABLE_S = 30.0
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 60.0


def allowed_cores() -> list[int]:
    """The cores this process may run on, sorted (every core where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


class WorkerProcess:
    """Worker `index` of a pool: job semaphore (pool posts), done semaphore (worker posts)."""

    def __init__(
        self,
        index: int,
        core: int,
        io: IoArena,
        repo_name: str,
        numactl: str | None,
        spin_us: float = 0.0,
    ):
        """spin_us: how long both sides spin on a semaphore before blocking (spin.py)."""
        self.index, self.core, self.io = index, core, io
        self._repo_name, self._numactl = repo_name, numactl
        self.spin_us, self._spin_ns = spin_us, int(spin_us * 1000)
        self.job_sem = shm.create_sem(shm.new_name(f"job{index}"))
        self.done_sem = shm.create_sem(shm.new_name(f"done{index}"))
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._started_at = 0.0  # time.monotonic() of the last start
        self._early_exits = 0  # replacements that exited within STABLE_S, one after another
        self._not_before: float | None = None  # an exited worker restarts from then

    def start(self) -> None:
        """Launch the process (under numactl when given); it is ready once it wrote its pid."""
        self.io.set_worker_pid(self.index, 0)
        self._started_at, self._not_before = time.monotonic(), None
        cmd = [
            sys.executable,
            "-m",
            "toppings.cpu_lora.worker",
            "--repo",
            self._repo_name,
            "--io",
            self.io.name,
            "--index",
            str(self.index),
            "--job-sem",
            self.job_sem.name,
            "--done-sem",
            self.done_sem.name,
            "--parent",
            shm.process_tag(),
            "--core",
            str(self.core),
            "--spin-us",
            str(self.spin_us),
        ]
        if self._numactl:
            cmd = [self._numactl, f"--physcpubind={self.core}", "--localalloc", *cmd]
        # One thread per worker; the pool, not OpenMP, spreads the work over cores.
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env)
        shm.track_process(self.proc)

    def restart(self) -> None:
        """Kill (if needed) and reap the process, drop posts meant for it, start a new one."""
        shm.kill_process(self.proc)
        for sem in (self.job_sem, self.done_sem):
            while True:
                try:
                    sem.acquire(0)
                except posix_ipc.BusyError:
                    break
        self.restarts += 1
        self.start()

    def is_ready(self) -> bool:
        """True when the process runs and has attached; one that exited is replaced (`replace`)."""
        if self.proc.poll() is not None:
            self.replace()
            return False
        return self.io.worker_pid(self.index) == self.proc.pid

    def replace(self, why: str = "exited") -> None:
        """Replace a process that died or hung: killed (if needed) and started again, at once
        after a stable run, else once its backoff has passed (`is_ready` and `wait_ready` look
        again)."""
        now = time.monotonic()
        if self._not_before is None:  # noticed now
            if self.proc.poll() is None:
                shm.kill_process(self.proc)
            early = self.restarts > 0 and now - self._started_at < STABLE_S
            self._early_exits = self._early_exits + 1 if early else 0
            n = self._early_exits
            delay = 0.0 if n == 0 else min(BACKOFF_MIN_S * 2 ** (n - 1), BACKOFF_MAX_S)
            self._not_before = now + delay
            log.warning("CPU LoRA worker %d %s (%s); restarting it in %.1f s", self.index, why,
                        self.proc.returncode, delay)  # fmt: skip
        if now >= self._not_before:
            self.restart()

    def wait_ready(self, deadline: float) -> None:
        """Until the process runs and has attached: one that died after attaching is replaced
        (after its backoff); one that dies while starting is a RuntimeError."""
        while True:
            alive = self.proc.poll() is None
            attached = self.io.worker_pid(self.index) == self.proc.pid
            if alive and attached:
                return
            if not alive and not attached and self._not_before is None:
                raise RuntimeError(
                    f"CPU LoRA worker {self.index} exited with "
                    f"{self.proc.returncode} while starting"
                )
            if not alive:
                self.replace()
            if time.monotonic() > deadline:
                raise RuntimeError(f"CPU LoRA worker {self.index} did not start in time")
            time.sleep(0.01)

    def post(self, job: Job) -> None:
        self.io.write_job(self.index, job)
        self.job_sem.release()

    def wait(self, seq: int, deadline: float) -> tuple[int | str, int]:
        """(status, compute ns) of job `seq`, or ("died" | "timed out", 0)."""
        spin_ns = self._spin_ns  # spin once, then block in POLL_S steps
        while True:
            taken = bool(spin_ns) and try_acquire_spinning(self.done_sem, spin_ns)
            spin_ns = 0
            if not taken:
                remaining = deadline - time.monotonic()
                try:
                    self.done_sem.acquire(max(0.0, min(POLL_S, remaining)))
                except posix_ipc.BusyError:
                    if self.proc.poll() is not None:
                        return "died", 0
                    if remaining <= 0:
                        return "timed out", 0
                    continue
                except posix_ipc.SignalError:
                    continue
            done_seq, status, ns = self.io.read_reply(self.index)
            if done_seq == seq:  # else a stale post from before a restart
                return status, ns

    def request_stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.post(Job(0, OP_STOP, 0, 0, 0, 0, 0, ()))

    def stop(self, grace_s: float) -> None:
        """Reap the process (killed after grace_s) and unlink the semaphores."""
        if self.proc is not None:
            shm.kill_process(self.proc, grace_s=grace_s)
        for sem in (self.job_sem, self.done_sem):
            shm.unlink_sem(sem.name)
            sem.close()
