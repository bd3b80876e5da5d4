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
`lora_dir = ["/loras"]`, `serve_args = ["--lora-mode", "cpu-assisted"]`); a flag given too wins,
a repeatable one adds to the file's list.

Logs (and the started scheduler's registry) go to `--log-dir`, which is kept; without it, to a
new temporary directory that is removed after a clean stop and kept, its path printed, when a
server or the scheduler failed. Mistakes every server would refuse (a missing model or adapter,
a port in use) are refused at once, in one line, with exit status 2.
"""

from __future__ import annotations

import logging
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from toppings.scripts.launch.cli_args import LaunchConfig, build_parser
from toppings.scripts.launch.node import Launcher
from toppings.scripts.launch.plan import check_inputs, numactl_usable, plan_servers
from toppings.scripts.launch.procs import kill_servers
from toppings.scripts.launch.supervisor import USAGE_ERROR, Limits
from toppings.server.settings import build


def parse_args(argv: list[str] | None) -> LaunchConfig:
    """The launch's settings: the flags, over the `--config` file's keys, over the defaults."""
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    first = parser.parse_args(argv)
    if first.config is not None:
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # the same parser, as a package before 3.11 (a dependency there)
            import tomli as tomllib

        table = tomllib.loads(first.config.read_text())
        table = {k.replace("-", "_"): v for k, v in table.items()}
        serve_args = [str(a) for a in table.pop("serve_args", [])] + serve_args
        unknown = sorted(set(table) - set(vars(first)))  # every flag's dest is in `first`
        if unknown:
            parser.error(f"{first.config}: unknown keys {', '.join(unknown)}")
        parser.set_defaults(**table)
    try:
        return build(LaunchConfig, parser.parse_args(argv), serve_args=tuple(serve_args))
    except ValueError as e:
        parser.error(str(e))


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
        launcher.reporter.note(str(e))
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
