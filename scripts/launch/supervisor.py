"""One supervisor per child of `toppings-launch` (a server or the scheduler), all alike.

A child is started, watched (its exit, its `/health`), killed when it does not become healthy
within the start timeout or stops answering for `--unhealthy-timeout`, and restarted with
exponential backoff at most `--max-restarts` times. Children differ only in their `Role`: how
one is started, and what follows once it is healthy (a server registers with the scheduler; a
restarted scheduler has every server register again).
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import requests

from toppings.scripts.launch.procs import ChildProc, State
from toppings.server.requests.errors import bearer_header

log = logging.getLogger("toppings-launch")

HEALTH_EVERY_S = 2.0
STARTING_HEALTH_EVERY_S = 0.25
USAGE_ERROR = 2  # toppings-serve's exit status for a user mistake, as argparse's


@dataclass(frozen=True)
class Limits:
    """How long a child may take and how often it is restarted (from the command line)."""

    start_timeout: float  # seconds from start to the first healthy /health
    unhealthy_timeout: float  # seconds a running child's /health may fail; 0: never
    max_restarts: int
    restart_backoff: float  # first delay, doubling with each restart

    def __post_init__(self) -> None:
        if self.start_timeout <= 0:
            raise ValueError(f"--start-timeout {self.start_timeout}: must be positive")
        if self.unhealthy_timeout < 0 or self.max_restarts < 0 or self.restart_backoff < 0:
            raise ValueError("--unhealthy-timeout, --max-restarts, --restart-backoff: not negative")


class Role(Protocol):
    """What kind of child it is: how it starts, and what follows once it is healthy."""

    def start(self, child: ChildProc) -> subprocess.Popen:
        """Start the child's process (its output going to the child's log) and return it."""
        ...

    def on_healthy(self, child: ChildProc, now: float) -> None:
        """Called on every tick the child is healthy."""
        ...


class Supervisor:
    """Keeps one child running; `tick` advances it, called every few hundred milliseconds."""

    def __init__(self, child: ChildProc, role: Role, limits: Limits, note: Callable[[str], None]):
        self.child, self.role, self.limits, self.note = child, role, limits, note

    def tick(self, now: float) -> None:
        c = self.child
        if c.proc is None:
            if c.state is not State.FAILED and now >= c.next_start:
                c.proc = self.role.start(c)
                c.state, c.started_at, c.next_health = State.STARTING, now, 0.0
            return
        rc = c.proc.poll()
        if rc is not None:
            self._exited(now, rc)
            return
        if c.state is State.STARTING and now - c.started_at > self.limits.start_timeout:
            log.error("%s not healthy after %.0f s; killing it", c.name, now - c.started_at)
            self._kill(now)
            return
        if now >= c.next_health:
            starting = c.state is State.STARTING
            c.next_health = now + (STARTING_HEALTH_EVERY_S if starting else HEALTH_EVERY_S)
            unready = State.STARTING if starting else State.UNHEALTHY
            c.state = health(c.url + c.health_path, unready, c.health_key)
            c.unhealthy_since = (c.unhealthy_since or now) if c.state is State.UNHEALTHY else None
        limit = self.limits.unhealthy_timeout
        if limit and c.unhealthy_since is not None and now - c.unhealthy_since > limit:
            # Alive but not answering (hung, stopped, wedged): kill it like a dead one.
            log.error("%s unhealthy for %.0f s; killing it", c.name, limit)
            self._kill(now)
            return
        if c.state is State.HEALTHY:
            self.role.on_healthy(c, now)

    def _kill(self, now: float) -> None:
        proc = self.child.proc
        proc.kill()
        proc.wait()
        self._exited(now, proc.returncode)

    def _exited(self, now: float, rc: int) -> None:
        c = self.child
        c.last_exit, c.proc, c.unhealthy_since = rc, None, None
        c.num_failures += 1
        if rc == USAGE_ERROR:  # it refused its arguments: a restart would be refused the same way
            c.state = State.FAILED
            self.note(f"{c.name} refused to start: {last_error(c.log_path)}")
            return
        if c.restarts >= self.limits.max_restarts:
            c.state = State.FAILED
            log.error("%s exited (%s); no restarts left, see %s", c.name, rc, c.log_path)
            return
        delay = self.limits.restart_backoff * 2**c.restarts
        c.restarts += 1
        c.next_start = now + delay
        c.state = State.BACKOFF
        log.warning("%s exited (%s); restart %d in %.1f s (log %s)", c.name, rc, c.restarts,
                    delay, c.log_path)  # fmt: skip


def health(url: str, unready: State = State.UNHEALTHY, key: str | None = None) -> State:
    """What a health probe at `url` (with `key` as a bearer, where given) says: HEALTHY,
    DRAINING, or `unready` (no answer, not ready)."""
    try:
        r = requests.get(url, timeout=1.0, headers=bearer_header(key))
    except requests.RequestException:
        return unready
    if r.status_code == 200:
        return State.HEALTHY
    return State.DRAINING if "draining" in r.text else unready


def last_error(log_path: Path) -> str:
    """The line of a child's log that says why it refused to start."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return f"see {log_path}"
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or [f"see {log_path}"])[-1]
