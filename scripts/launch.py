"""`toppings-launch`: start the inference servers of one node, keep them up, stop them cleanly.

    toppings-launch --model DIR [--num-servers N | --gpus 0,1] [--device cpu|cuda]
        [--base-port 8100] [--cores 0-15] [--cpu-workers N] [--lora NAME=PATH]...
        [--lora-dir DIR]... [--scheduler URL | --start-scheduler [--scheduler-port 8000]]
        [--config node.toml] [-- extra toppings-serve args]

Each server gets its own GPU (CUDA_VISIBLE_DEVICES) or, on CPU, its own share of the node, and
a disjoint set of cores: the launcher splits the cores it may use (`os.sched_getaffinity(0)`,
or `--cores`) into contiguous sets, runs each server under `numactl --physcpubind=SET
--localalloc` (or with `sched_setaffinity` where numactl is missing or not permitted) and tells
it `--cpu-cores SET --cpu-workers N`, so its CPU LoRA workers pin one per core of its set. The
launcher waits for every `/health`, registers the servers with a scheduler
(`POST URL/admin/servers`; with `--start-scheduler` it runs that scheduler itself, on
`--registry`, and restarts it if it exits or its `/health` fails for `--unhealthy-timeout`),
restarts a server that dies or hangs that long (exponential backoff, at most `--max-restarts`
times), and on Ctrl-C/SIGTERM drains and stops them all: SIGTERM,
wait, then SIGKILL. A TOML file (`--config`) takes the same keys as the flags (`num_servers = 2`,
`lora_dir = ["/loras"]`, `serve_args = ["--lora-mode", "cpu-assisted"]`); flags win.

Logs (and the started scheduler's registry) go to `--log-dir`, which is kept; without it, to a
new temporary directory that is removed after a clean stop and kept, its path printed, when a
server or the scheduler failed. Mistakes every server would refuse (a missing model or adapter,
a port in use) are refused at once, in one line, with exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import requests

from toppings.scripts.launch_procs import (
    ServerProc,
    kill_servers,
    spawn_server,
    start_scheduler,
    stop_process,
    stop_servers,
    sweep_shm,
)
from toppings.scripts.launch_report import Reporter

log = logging.getLogger("toppings-launch")

TICK_S = 0.2
HEALTH_EVERY_S = 2.0
REGISTER_RETRY_S = 5.0
USAGE_ERROR = 2  # toppings-serve's exit status for a user mistake, as argparse's


def split_cores(cores: Sequence[int], num_sets: int) -> list[tuple[int, ...]]:
    """Split `cores` into `num_sets` disjoint contiguous sets whose sizes differ by at most one.

    Neighbouring core ids usually share a socket (and cache), so each set stays local.
    """
    cores = sorted(set(cores))
    if num_sets < 1:
        raise ValueError("need at least one set")
    if len(cores) < num_sets:
        raise ValueError(f"{len(cores)} cores cannot make {num_sets} disjoint non-empty sets")
    base, extra = divmod(len(cores), num_sets)
    sets, start = [], 0
    for i in range(num_sets):
        size = base + (1 if i < extra else 0)
        sets.append(tuple(cores[start : start + size]))
        start += size
    return sets


def build_parser() -> argparse.ArgumentParser:
    from toppings.server.cli import log_level, parse_cores

    p = argparse.ArgumentParser(
        prog="toppings-launch",
        description="Start a node's inference servers on disjoint cores and keep them running.",
        epilog="Arguments after `--` go to every toppings-serve unchanged.",
    )
    p.add_argument("--config", type=Path, help="TOML file with the same keys as the flags")
    p.add_argument("--model", help="what toppings-serve --model takes")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--num-servers", type=int, default=None, help="default: 1, or one per --gpus")
    p.add_argument("--gpus", type=parse_cores, default=None, help="GPU ids, one server each")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--base-port", type=int, default=8100, help="server i listens on base + i")
    p.add_argument("--cores", type=parse_cores, default=None, help="default: this process's")
    p.add_argument("--cpu-workers", type=int, default=None, help="per server; default: its cores")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--lora-dir", action="append", default=[], metavar="DIR")
    p.add_argument("--scheduler", default=None, metavar="URL", help="register servers there")
    p.add_argument(
        "--start-scheduler",
        action="store_true",
        help="also run toppings-scheduler here and register the servers with it",
    )
    p.add_argument("--scheduler-port", type=int, default=8000)
    p.add_argument(
        "--registry",
        type=Path,
        default=None,
        help="the started scheduler's SQLite registry (default: in the log dir)",
    )
    p.add_argument(
        "--scheduler-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="passed to the started scheduler, e.g. --scheduler-arg=--policy=random",
    )
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to first /health")
    p.add_argument(
        "--unhealthy-timeout",
        type=float,
        default=60.0,
        help="restart a running server (or the started scheduler) whose /health has failed "
        "this long (0: never)",
    )
    p.add_argument("--max-restarts", type=int, default=5, help="per server")
    p.add_argument("--restart-backoff", type=float, default=1.0, help="first delay, doubling")
    p.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="servers' and scheduler's logs (and the default registry), kept; default: a new "
        "temporary directory, removed after a clean stop, kept (and printed) if anything failed",
    )
    p.add_argument("--numactl", choices=("auto", "never"), default="auto")
    p.add_argument("--log-level", type=log_level, default="INFO")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    first = parser.parse_args(argv)
    if first.config is not None:
        import tomllib  # Python 3.11+

        table = tomllib.loads(first.config.read_text())
        table = {k.replace("-", "_"): v for k, v in table.items()}
        serve_args = [str(a) for a in table.pop("serve_args", [])] + serve_args
        known = {a.dest for a in parser._actions}
        unknown = sorted(set(table) - known)
        if unknown:
            parser.error(f"{first.config}: unknown keys {', '.join(unknown)}")
        parser.set_defaults(**table)
    args = parser.parse_args(argv)
    args.serve_args = serve_args
    if not args.model:
        parser.error("--model is required (flag or config file)")
    if args.start_scheduler and args.scheduler:
        parser.error("--scheduler URL and --start-scheduler exclude each other")
    return args


def _servers(args: argparse.Namespace, log_dir: Path) -> list[ServerProc]:
    gpus = list(args.gpus or [])
    num = args.num_servers or len(gpus) or 1
    if args.device == "cuda" and not gpus:
        gpus = list(range(num))
    if args.device == "cuda" and len(gpus) != num:
        raise ValueError(f"{num} servers but {len(gpus)} GPUs")
    core_sets = split_cores(args.cores or sorted(os.sched_getaffinity(0)), num)
    workers = args.cpu_workers
    if workers is not None and not 0 <= workers <= min(len(s) for s in core_sets):
        raise ValueError(f"--cpu-workers {workers} does not fit the smallest core set")
    return [
        ServerProc(
            index=i,
            url=f"http://{args.host}:{args.base_port + i}",
            cores=cores,
            num_workers=len(cores) if workers is None else workers,
            gpu=gpus[i] if args.device == "cuda" else None,
            log_path=log_dir / f"server-{i}.log",
        )
        for i, cores in enumerate(core_sets)
    ]


def check_inputs(args: argparse.Namespace, servers: list[ServerProc]) -> None:
    """Refuse at once what every server would refuse at start (raises ValueError): a missing
    model, adapter or adapter folder, a port in use. toppings-serve checks the rest."""
    from toppings.gpu_lora.peft_config import AdapterError, read_adapter_config
    from toppings.server.cli import listen_problem

    if args.model != "smollm2":
        model = Path(args.model).expanduser()
        is_gguf = model.is_file() and model.suffix == ".gguf"
        if not is_gguf and not (model / "config.json").is_file():
            what = "does not exist" if not model.exists() else "is no checkpoint directory"
            raise ValueError(f"--model {args.model} {what} (expected a Hugging Face checkpoint "
                             "directory with config.json, a .gguf file or smollm2)")  # fmt: skip
    for spec in args.lora:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora: expected NAME=PATH, got {spec!r}")
        try:
            read_adapter_config(path)
        except AdapterError as e:
            raise ValueError(f"--lora {name}: {e}") from None
    for folder in args.lora_dir:
        if not Path(folder).is_dir():
            raise ValueError(f"--lora-dir {folder} is not a directory")
    ports = [("--base-port", s.port) for s in servers]
    if args.start_scheduler:
        ports.append(("--scheduler-port", args.scheduler_port))
    for flag, port in ports:
        if problem := listen_problem(args.host, port):
            raise ValueError(f"{flag}: {problem}")


def serve_command(args: argparse.Namespace, server: ServerProc) -> list[str]:
    """The toppings-serve command line of one server (without the numactl prefix)."""
    cmd = [sys.executable, "-m", "toppings.server.cli", "--model", args.model,
           "--device", args.device, "--host", args.host, "--port", str(server.port),
           "--drain-timeout", str(args.drain_timeout), "--cpu-workers", str(server.num_workers),
           "--cpu-cores", ",".join(map(str, server.cores))]  # fmt: skip
    for spec in args.lora:
        cmd += ["--lora", spec]
    for d in args.lora_dir:
        cmd += ["--lora-dir", str(d)]
    return cmd + list(args.serve_args)


def numactl_usable(cores: tuple[int, ...]) -> bool:
    """numactl is installed and may bind here (containers often refuse set_mempolicy)."""
    if shutil.which("numactl") is None:
        return False
    probe = ["numactl", f"--physcpubind={cores[0]}", "--localalloc", "true"]
    return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0


class Launcher:
    """Keeps a node's servers running; see the module docstring."""

    def __init__(self, args: argparse.Namespace, servers: list[ServerProc], use_numactl: bool):
        self.args, self.servers, self.use_numactl = args, servers, use_numactl
        self.stopping = threading.Event()
        self.reporter = Reporter()
        self.spawned_pids: list[int] = []
        self.scheduler_proc = None
        self.scheduler_restarts = 0
        self._scheduler_next_health = 0.0
        self._scheduler_bad_since: float | None = None  # when it last stopped answering

    def start_scheduler(self, log_dir: Path, timeout_s: float = 60.0) -> None:
        """Run the node's scheduler (--start-scheduler) and wait for its /health."""
        a = self.args
        self.scheduler_log = log_dir / "scheduler.log"
        self._scheduler_spec = (a.host, a.scheduler_port, a.registry or log_dir / "registry.sqlite",
                                self.scheduler_log, a.scheduler_arg)  # fmt: skip
        self.scheduler_proc = start_scheduler(*self._scheduler_spec)
        a.scheduler = f"http://{a.host}:{a.scheduler_port}"
        deadline = time.monotonic() + timeout_s
        while not _answers(a.scheduler):
            if self.scheduler_proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the scheduler did not start; see {self.scheduler_log}")
            time.sleep(0.2)
        self.reporter.note(f"scheduler at {a.scheduler} (log {self.scheduler_log})")

    def _tick_scheduler(self, now: float) -> None:
        """Restart a started scheduler that exited or hung; the servers then register again."""
        proc = self.scheduler_proc
        if proc is None or self.scheduler_restarts < 0:
            return
        if proc.poll() is None:
            self._watch_scheduler(proc, now)
            if proc.poll() is None:
                return
        if self.scheduler_restarts >= self.args.max_restarts:
            self.reporter.note(f"scheduler exited ({proc.returncode}); no restarts left")
            self.scheduler_restarts = -1
            return
        self.scheduler_restarts += 1
        self.reporter.note(f"scheduler exited ({proc.returncode}); restarting it")
        self.scheduler_proc = start_scheduler(*self._scheduler_spec)
        self._scheduler_bad_since = now  # its start-up counts toward --unhealthy-timeout
        for server in self.servers:
            server.registered = False

    def _watch_scheduler(self, proc, now: float) -> None:
        """Kill a running scheduler whose /health has failed for --unhealthy-timeout."""
        if now < self._scheduler_next_health:
            return
        self._scheduler_next_health = now + HEALTH_EVERY_S
        if _answers(self.args.scheduler):
            self._scheduler_bad_since = None
            return
        self._scheduler_bad_since = self._scheduler_bad_since or now
        limit = self.args.unhealthy_timeout
        if limit and now - self._scheduler_bad_since > limit:
            log.error("scheduler unhealthy for %.0f s; killing it", limit)
            proc.kill()
            proc.wait()

    def run(self) -> int:
        announced = False
        while not self.stopping.is_set():
            now = time.monotonic()
            self._tick_scheduler(now)
            for server in self.servers:
                self._tick(server, now)
            self.reporter.update(self.servers)
            if not announced and all(s.state == "healthy" for s in self.servers):
                announced = True
                self.reporter.note(f"all {len(self.servers)} servers healthy; Ctrl-C stops them")
            if all(s.state == "failed" for s in self.servers):
                self.reporter.note("every server failed; giving up")
                return 1
            self.stopping.wait(TICK_S)
        return 0

    def stop(self) -> None:
        if self.args.scheduler:
            for s in self.servers:
                if s.registered:
                    _scheduler_call("delete", self.args.scheduler, s.url)
        for s in self.servers:
            if s.proc is not None and s.proc.poll() is None:
                s.state = "stopping"
        self.reporter.update(self.servers)
        stop_servers(self.servers, self.args.drain_timeout + 15.0)
        sweep_shm(self.spawned_pids)
        stop_process(self.scheduler_proc, 10.0)
        self.reporter.update(self.servers)

    def _tick(self, s: ServerProc, now: float) -> None:
        if s.proc is None:
            if s.state != "failed" and now >= s.next_start:
                cmd = serve_command(self.args, s)
                spawn_server(s, cmd, self.use_numactl)
                self.spawned_pids.append(s.proc.pid)
            return
        rc = s.proc.poll()
        if rc is not None or (
            s.state == "starting" and now - s.started_at > self.args.start_timeout
        ):
            self._failed(s, now, rc)
            return
        if now >= s.next_health:
            s.next_health = now + (0.25 if s.state == "starting" else HEALTH_EVERY_S)
            s.state = _health(s.url) if s.state != "starting" else _health(s.url, "starting")
            s.unhealthy_since = (s.unhealthy_since or now) if s.state == "unhealthy" else None
        limit = self.args.unhealthy_timeout
        if limit and s.unhealthy_since is not None and now - s.unhealthy_since > limit:
            # Alive but not answering (hung, stopped, wedged): kill it like a dead one.
            log.error("server %d unhealthy for %.0f s; killing it", s.index, limit)
            self._failed(s, now, None)
            return
        if s.state == "healthy" and self.args.scheduler and not s.registered:
            if now >= s.next_register:
                s.next_register = now + REGISTER_RETRY_S
                s.registered = _scheduler_call("post", self.args.scheduler, s.url)

    def _failed(self, s: ServerProc, now: float, rc: int | None) -> None:
        if rc is None:
            if s.state == "starting":
                log.error("server %d not healthy after %.0f s; killing it", s.index,
                          now - s.started_at)  # fmt: skip
            s.proc.kill()
            s.proc.wait()
            rc = s.proc.returncode
        s.last_exit, s.proc, s.registered, s.unhealthy_since = rc, None, False, None
        if rc == USAGE_ERROR:  # it refused its arguments: a restart would be refused the same way
            s.state = "failed"
            self.reporter.note(f"server {s.index} refused to start: {_last_error(s.log_path)}")
            return
        if s.restarts >= self.args.max_restarts:
            s.state = "failed"
            log.error("server %d exited (%s); no restarts left, see %s", s.index, rc, s.log_path)
            return
        delay = self.args.restart_backoff * 2**s.restarts
        s.restarts += 1
        s.next_start = now + delay
        s.state = "restarting"
        log.warning("server %d exited (%s); restart %d in %.1f s (log %s)", s.index, rc,
                    s.restarts, delay, s.log_path)  # fmt: skip


def _last_error(log_path: Path) -> str:
    """The line of a server's log that says why it refused to start."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return f"see {log_path}"
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or [f"see {log_path}"])[-1]


def _answers(url: str) -> bool:
    """The scheduler is up when its /health answers at all: it says 503 until a server is
    registered, and the launcher registers them only once it is up."""
    try:
        requests.get(url + "/health", timeout=1.0)
    except requests.RequestException:
        return False
    return True


def _health(url: str, unready: str = "unhealthy") -> str:
    try:
        r = requests.get(url + "/health", timeout=1.0)
    except requests.RequestException:
        return unready
    if r.status_code == 200:
        return "healthy"
    return "draining" if "draining" in r.text else unready


def _scheduler_call(method: str, scheduler: str, url: str) -> bool:
    try:
        r = requests.request(method, scheduler.rstrip("/") + "/admin/servers",
                             json={"url": url}, timeout=10)  # fmt: skip
    except requests.RequestException as exc:
        log.warning("scheduler %s unreachable (%s of %s): %s", scheduler, method, url, exc)
        return False
    if r.status_code >= 400:
        log.warning("scheduler %s refused %s of %s: %s", scheduler, method, url, r.text[:300])
        return False
    log.info("scheduler %s: %s %s", scheduler, "registered" if method == "post" else "removed", url)
    return True


def _usage_error(message: str) -> None:
    """A user mistake: one line on stderr and exit status 2, as argparse does (no traceback)."""
    print(f"toppings-launch: error: {message}", file=sys.stderr)
    sys.exit(USAGE_ERROR)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s: %(message)s")
    is_temp = args.log_dir is None  # the user's --log-dir is always kept
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="toppings-launch-"))
    try:
        servers = _servers(args, log_dir)
        check_inputs(args, servers)
        log_dir.mkdir(parents=True, exist_ok=True)
    except (ValueError, OSError) as e:
        if is_temp:
            shutil.rmtree(log_dir, ignore_errors=True)
        _usage_error(str(e))
    use_numactl = args.numactl == "auto" and numactl_usable(servers[0].cores)
    launcher = Launcher(args, servers, use_numactl)
    binder = "numactl" if use_numactl else "sched_setaffinity"
    launcher.reporter.note(f"{len(servers)} servers, bound with {binder}; logs in {log_dir}")

    def on_signal(signum: int, frame) -> None:
        if launcher.stopping.is_set():  # a second Ctrl-C: no more waiting for drains
            launcher.reporter.note("killing the servers")
            kill_servers(launcher.servers)
            return
        launcher.reporter.note(f"{signal.Signals(signum).name}: draining and stopping the servers")
        launcher.stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        if args.start_scheduler:
            launcher.start_scheduler(log_dir)
        rc = launcher.run()
    except RuntimeError as e:
        launcher.reporter.note(f"toppings-launch: {e}")
        rc = 1
    finally:
        launcher.stop()
    failed = rc != 0 or launcher.scheduler_restarts != 0 or any(s.restarts for s in servers)
    if is_temp and not failed:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif is_temp:
        launcher.reporter.note(f"something failed: logs kept in {log_dir}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
