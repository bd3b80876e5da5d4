"""`toppings-launch`: start the inference servers of one node, keep them up, stop them cleanly.

    toppings-launch --model DIR [--num-servers N | --gpus 0,1] [--device cpu|cuda]
        [--base-port 8100] [--cores 0-15] [--cpu-workers N] [--device-cores-per-server K]
        [--lora NAME=PATH]... [--lora-dir DIR]... [--chat-template PATH]
        [--scheduler URL | --start-scheduler [--scheduler-port 8000]]
        [--config node.toml] [-- extra toppings-serve args]

Each server gets its own GPU (CUDA_VISIBLE_DEVICES) or, on CPU, its own share of the node, and
a disjoint set of cores: the launcher splits the cores it may use (`os.sched_getaffinity(0)`,
or `--cores`) into contiguous sets, runs each server under `numactl --physcpubind=SET
--localalloc` (or with `sched_setaffinity` where numactl is missing or not permitted) and tells
it `--cpu-cores SET --cpu-workers N`, so its CPU LoRA workers pin one per core of its set
(with `--device-cores-per-server K`, the first K cores of the set are its `--device-cores`, for
the forward pass, and only the rest its `--cpu-cores`: both stay inside the set it is bound to). The
launcher waits for every `/health`, registers the servers with a scheduler
(`POST URL/admin/servers`, with the scheduler's admin key when `$TOPPINGS_ADMIN_API_KEY` or
`--scheduler-arg=--admin-api-key=KEY` gives one; with `--start-scheduler` it runs that
scheduler itself, on `--registry`, and restarts it if it exits or stops answering for
`--unhealthy-timeout`),
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
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from toppings.scripts.launch.node import Launcher
from toppings.scripts.launch.plan import check_inputs, numactl_usable, plan_servers
from toppings.scripts.launch.procs import kill_servers
from toppings.scripts.launch.supervisor import USAGE_ERROR, Limits


def build_parser() -> argparse.ArgumentParser:
    from toppings.server.cli_args import log_level, parse_cores

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
    p.add_argument("--cpu-workers", type=int, default=None,
                   help="per server; default: its (host) cores")  # fmt: skip
    p.add_argument(
        "--device-cores-per-server",
        type=int,
        default=0,
        metavar="N",
        help="a device/host split inside each server's core set: its first N cores run the "
        "forward pass (toppings-serve --device-cores), the rest its CPU workers and adapter "
        "loader (--cpu-cores); 0: no split",
    )
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--lora-dir", action="append", default=[], metavar="DIR")
    p.add_argument("--chat-template", default=None, metavar="PATH",
                   help="toppings-serve --chat-template for every server: a Jinja chat template "
                   "file used instead of the checkpoint's own")  # fmt: skip
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
        unknown = sorted(set(table) - set(vars(first)))  # every flag's dest is in `first`
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
        servers = plan_servers(args, log_dir)
        check_inputs(args, servers)
        limits = Limits(args.start_timeout, args.unhealthy_timeout, args.max_restarts,
                        args.restart_backoff)  # fmt: skip
        log_dir.mkdir(parents=True, exist_ok=True)
    except (ValueError, OSError) as e:
        if is_temp:
            shutil.rmtree(log_dir, ignore_errors=True)
        _usage_error(str(e))
    use_numactl = args.numactl == "auto" and numactl_usable(servers[0].cores)
    launcher = Launcher(args, servers, limits, use_numactl, log_dir)
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
            launcher.start_scheduler()
        rc = launcher.run()
    except RuntimeError as e:
        launcher.reporter.note(f"toppings-launch: {e}")
        rc = 1
    finally:
        launcher.stop()
    failed = rc != 0 or launcher.had_failures()
    if is_temp and not failed:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif is_temp:
        launcher.reporter.note(f"something failed: logs kept in {log_dir}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
