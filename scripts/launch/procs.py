"""The child processes of `toppings-launch`: start a server bound to its cores or the scheduler,
stop them all.

Each server runs in its own session (so a Ctrl-C in the launcher's terminal reaches only the
launcher, which then drains the servers one SIGTERM each) and with a parent-death signal (so a
launcher killed with SIGKILL still takes its servers down).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from toppings.server.settings import redact_keys

log = logging.getLogger("toppings-launch")

PR_SET_PDEATHSIG = 1
SHM_DIR = "/dev/shm"
SHM_PREFIX = "toppings"  # cpu_lora.shm names: toppings-<pid>.<word>-..., sem.toppings-...


class State(str, Enum):
    """Where a supervised child stands; the value is what the launcher prints."""

    PENDING = "pending"
    STARTING = "starting"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    BACKOFF = "restarting"  # exited or killed; started again at next_start
    FAILED = "failed"  # no restarts left, or it refused its arguments
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(kw_only=True)
class ChildProc:
    """A process the launcher keeps running (a server or the scheduler): its process and state."""

    proc: subprocess.Popen | None = None
    state: State = State.PENDING
    restarts: int = 0
    num_failures: int = 0  # exits and kills, restarted or not
    last_exit: int | None = None
    started_at: float = 0.0
    next_start: float = 0.0
    next_health: float = 0.0
    unhealthy_since: float | None = None  # when /health started failing on a running child
    health_path: str = "/health"  # answers 200 while the process is up and ready
    health_key: str | None = None  # a bearer key the probe's path wants (the scheduler's /admin)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid


@dataclass
class ServerProc(ChildProc):
    """One server of the node: what it was given, and its process and state now."""

    index: int
    url: str
    cores: tuple[int, ...]
    num_workers: int
    gpu: int | None
    log_path: Path
    device_cores: tuple[int, ...] = ()  # the first of `cores` when it splits device and host
    next_register: float = 0.0
    registered: bool = False

    @property
    def host_cores(self) -> tuple[int, ...]:
        """The cores of its CPU workers (and, with a split, its adapter loader)."""
        return tuple(c for c in self.cores if c not in self.device_cores)

    @property
    def name(self) -> str:
        return f"server {self.index}"

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@dataclass(kw_only=True)
class SchedulerProc(ChildProc):
    """The scheduler `--start-scheduler` runs on this node."""

    url: str
    log_path: Path
    command: list[str]
    name: str = "scheduler"
    # Its /health says 503 until a server registers; this answers whenever the process does.
    health_path: str = "/admin/state"


def _child_setup(cores: tuple[int, ...] | None, parent_pid: int) -> None:
    """Runs in the child between fork and exec: die with the launcher, bind to the cores."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        os._exit(1)
    if cores is not None:
        os.sched_setaffinity(0, cores)


def spawn_server(server: ServerProc, cmd: list[str], use_numactl: bool) -> subprocess.Popen:
    """Start `cmd` for `server`, bound to its cores; output goes to its log file."""
    cores = ",".join(map(str, server.cores))
    if use_numactl:
        cmd = ["numactl", f"--physcpubind={cores}", "--localalloc", *cmd]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["CUDA_VISIBLE_DEVICES"] = "" if server.gpu is None else str(server.gpu)
    # torch would otherwise start one thread per core of the machine on a share of it.
    env.setdefault("OMP_NUM_THREADS", str(len(server.cores)))
    parent = os.getpid()
    bind = None if use_numactl else server.cores
    with open(server.log_path, "ab") as out:
        server.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=lambda: _child_setup(bind, parent),
        )
    server.state, server.started_at, server.next_health = State.STARTING, time.monotonic(), 0.0
    log.info("server %d: pid %d, cores %s: %s", server.index, server.proc.pid, cores,
             " ".join(redact_keys(cmd)))  # fmt: skip
    return server.proc


def scheduler_command(host: str, port: int, registry: Path, extra: list[str]) -> list[str]:
    """The toppings-scheduler command line `--start-scheduler` runs."""
    return [sys.executable, "-m", "toppings.scheduler.cli", "--registry", str(registry),
            "--host", host, "--port", str(port), *extra]  # fmt: skip


def spawn_scheduler(scheduler: SchedulerProc) -> subprocess.Popen:
    """Start the scheduler in its own session, dying with the launcher; returns the Popen.

    It is not bound to any server's cores: it is one light process and may run anywhere.
    """
    parent = os.getpid()
    with open(scheduler.log_path, "ab") as out:
        proc = subprocess.Popen(
            scheduler.command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: _child_setup(None, parent),
        )
    log.info("scheduler: pid %d: %s", proc.pid, " ".join(redact_keys(scheduler.command)))
    return proc


def stop_process(proc: subprocess.Popen | None, timeout_s: float) -> None:
    """SIGTERM `proc`, wait up to timeout_s, then SIGKILL its session."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.wait()


def stop_servers(servers: list[ServerProc], timeout_s: float) -> None:
    """SIGTERM every live server (each drains), wait up to `timeout_s`, then SIGKILL the rest."""
    live = [s for s in servers if s.proc is not None and s.proc.poll() is None]
    for s in live:
        s.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for s in live:
        try:
            s.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("server %d did not stop in %.0f s; killing it", s.index, timeout_s)
            _kill_group(s.proc.pid)
            s.proc.wait()
        s.state, s.last_exit = State.STOPPED, s.proc.returncode
    for s in servers:
        if s.proc is not None:
            _kill_group(s.proc.pid)  # CPU workers a server left behind share its session
            s.proc = None
        s.state = State.STOPPED


def kill_servers(servers: list[ServerProc]) -> None:
    """SIGKILL every live server and its CPU workers now."""
    for s in servers:
        if s.proc is not None and s.proc.poll() is None:
            _kill_group(s.proc.pid)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def sweep_shm(pids: list[int]) -> list[str]:
    """Unlink what dead server processes left in /dev/shm; returns the names (normally none)."""
    found = []
    for pid in pids:
        mine = (f"{SHM_PREFIX}-{pid}.", f"sem.{SHM_PREFIX}-{pid}.")  # (cpu_lora.shm's tag)
        try:
            names = [n for n in os.listdir(SHM_DIR) if n.startswith(mine)]
        except FileNotFoundError:
            return []
        for name in names:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                found.append(name)
            except FileNotFoundError:
                pass
    if found:
        log.warning("removed %d shared-memory names stopped servers left: %s", len(found),
                    ", ".join(found[:8]))  # fmt: skip
    return found
