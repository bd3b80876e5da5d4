"""The node `toppings-launch` keeps running: its servers and, with `--start-scheduler`, the
scheduler, each under a `Supervisor`; registration with the scheduler; the drain-then-kill stop.

Registration goes to the scheduler's `/admin/servers` with its admin key when one is configured:
`--scheduler-arg=--admin-api-key=KEY`, else `$TOPPINGS_ADMIN_API_KEY` (which a scheduler started
here reads too); without one, a scheduler on this host takes registrations from loopback.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import threading
import time
from pathlib import Path

import requests

from toppings.scripts.launch.cli_args import LaunchConfig
from toppings.scripts.launch.plan import serve_command
from toppings.scripts.launch.procs import (
    SchedulerProc,
    ServerProc,
    State,
    scheduler_command,
    spawn_scheduler,
    spawn_server,
    stop_process,
    stop_servers,
    sweep_shm,
)
from toppings.scripts.launch.report import Reporter
from toppings.scripts.launch.supervisor import Limits, Supervisor
from toppings.server.requests.errors import bearer_header

log = logging.getLogger("toppings-launch")

TICK_S = 0.2
REGISTER_RETRY_S = 5.0
SCHEDULER_START_S = 60.0  # the scheduler loads no model: a minute is plenty


class ServerRole:
    """A server starts bound to its cores and, once healthy, registers with the scheduler."""

    def __init__(
        self,
        args: LaunchConfig,
        use_numactl: bool,
        scheduler_url: str | None,
        admin_api_key: str | None = None,
    ):
        self.args, self.use_numactl, self.scheduler_url = args, use_numactl, scheduler_url
        self.admin_api_key = admin_api_key
        self.spawned_pids: list[int] = []  # whose shared memory the stop sweeps

    def start(self, server: ServerProc) -> subprocess.Popen:
        server.registered = False
        proc = spawn_server(server, serve_command(self.args, server), self.use_numactl)
        self.spawned_pids.append(proc.pid)
        return proc

    def on_healthy(self, server: ServerProc, now: float) -> None:
        if self.scheduler_url and not server.registered and now >= server.next_register:
            server.next_register = now + REGISTER_RETRY_S
            server.registered = scheduler_call(
                "post", self.scheduler_url, server.url, self.admin_api_key
            )


class SchedulerRole:
    """The scheduler starts anywhere; each time a new one is healthy every server registers."""

    def __init__(self, servers: list[ServerProc]):
        self.servers = servers
        self.pid_seen: int | None = None  # the scheduler process the servers registered with

    def start(self, scheduler: SchedulerProc) -> subprocess.Popen:
        return spawn_scheduler(scheduler)

    def on_healthy(self, scheduler: SchedulerProc, now: float) -> None:
        if scheduler.pid != self.pid_seen:  # a new process knows no server
            self.pid_seen = scheduler.pid
            for server in self.servers:
                server.registered = False


class Launcher:
    """Keeps a node's servers (and its scheduler) running; see `toppings.scripts.launch.cli`."""

    def __init__(
        self,
        args: LaunchConfig,
        servers: list[ServerProc],
        limits: Limits,
        use_numactl: bool,
        log_dir: Path,
    ):
        self.args, self.servers = args, servers
        self.stopping = threading.Event()
        self.reporter = Reporter()
        self.scheduler: SchedulerProc | None = None
        self.scheduler_url = args.scheduler
        self.supervisors: list[Supervisor] = []
        note = self.reporter.note
        if args.start_scheduler:
            self.scheduler_url = f"http://{args.host}:{args.scheduler_port}"
            registry = args.registry or log_dir / "registry.sqlite"
            command = scheduler_command(
                args.host, args.scheduler_port, registry, args.scheduler_arg
            )
            self.scheduler = SchedulerProc(
                url=self.scheduler_url, log_path=log_dir / "scheduler.log", command=command,
                health_key=scheduler_admin_key(args.scheduler_arg),  # its /admin may want it
            )  # fmt: skip
            role = SchedulerRole(servers)
            slow_start = dataclasses.replace(limits, start_timeout=SCHEDULER_START_S)
            self.supervisors.append(Supervisor(self.scheduler, role, slow_start, note))
        self.admin_api_key = scheduler_admin_key(args.scheduler_arg)
        self.server_role = ServerRole(args, use_numactl, self.scheduler_url, self.admin_api_key)
        self.supervisors += [Supervisor(s, self.server_role, limits, note) for s in servers]

    def start_scheduler(self) -> None:
        """Start the node's scheduler (--start-scheduler) and wait until it answers."""
        scheduler, supervisor = self.scheduler, self.supervisors[0]
        while scheduler.state in (State.PENDING, State.STARTING):
            supervisor.tick(time.monotonic())
            time.sleep(TICK_S)
        if scheduler.state is not State.HEALTHY:
            raise RuntimeError(f"the scheduler did not answer {scheduler.health_path} (a key it "
                               f"wants?); see {scheduler.log_path}")  # fmt: skip
        self.reporter.note(f"scheduler at {scheduler.url} (log {scheduler.log_path})")

    def run(self) -> int:
        announced = False
        while not self.stopping.is_set():
            now = time.monotonic()
            for supervisor in self.supervisors:  # the scheduler first
                supervisor.tick(now)
            self.reporter.update(self.servers)
            if not announced and all(s.state is State.HEALTHY for s in self.servers):
                announced = True
                left = [s for s in self.servers if self.scheduler_url and not s.registered]
                tail = (f"; {len(left)} not registered with {self.scheduler_url} yet (the "
                        "warnings above say why)") if left else ""  # fmt: skip
                self.reporter.note(
                    f"all {len(self.servers)} servers healthy{tail}; Ctrl-C stops them"
                )
            if all(s.state is State.FAILED for s in self.servers):
                self.reporter.note("every server failed; giving up")
                return 1
            self.stopping.wait(TICK_S)
        return 0

    def stop(self) -> None:
        if self.scheduler_url:
            for s in self.servers:
                if s.registered and s.proc is not None:
                    scheduler_call("delete", self.scheduler_url, s.url, self.admin_api_key)
        for s in self.servers:
            if s.proc is not None and s.proc.poll() is None:
                s.state = State.STOPPING
        self.reporter.update(self.servers)
        stop_servers(self.servers, self.args.drain_timeout + 15.0)
        sweep_shm(self.server_role.spawned_pids)
        if self.scheduler is not None:
            stop_process(self.scheduler.proc, 10.0)
            self.scheduler.state = State.STOPPED
        self.reporter.update(self.servers)

    def had_failures(self) -> bool:
        """Whether any child exited or was killed while the node ran."""
        return any(s.child.num_failures for s in self.supervisors)


def scheduler_admin_key(scheduler_args: list[str] | None) -> str | None:
    """The scheduler's admin key: `--admin-api-key` among the started scheduler's arguments,
    else $TOPPINGS_ADMIN_API_KEY, else None."""
    args = list(scheduler_args or ())
    for i, arg in enumerate(args):
        if arg.startswith("--admin-api-key="):
            return arg.partition("=")[2]
        if arg == "--admin-api-key" and i + 1 < len(args):
            return args[i + 1]
    return os.environ.get("TOPPINGS_ADMIN_API_KEY") or None


def scheduler_call(method: str, scheduler: str, url: str, admin_api_key: str | None = None) -> bool:
    """Register (post) or remove (delete) server `url` at `scheduler`, with its admin key when
    there is one; whether it took."""
    headers = bearer_header(admin_api_key)
    try:
        r = requests.request(method, scheduler.rstrip("/") + "/admin/servers",
                             json={"url": url}, headers=headers, timeout=10)  # fmt: skip
    except requests.RequestException as exc:
        log.warning("scheduler %s unreachable (%s of %s): %s", scheduler, method, url, exc)
        return False
    if r.status_code >= 400:
        hint = ""
        if r.status_code in (401, 403):
            hint = (" (the scheduler's admin key: $TOPPINGS_ADMIN_API_KEY, or "
                    "--scheduler-arg=--admin-api-key=KEY)")  # fmt: skip
        log.warning("scheduler %s refused %s of %s: %s%s", scheduler, method, url, r.text[:300],
                    hint)  # fmt: skip
        return False
    log.info("scheduler %s: %s %s", scheduler, "registered" if method == "post" else "removed", url)
    return True
