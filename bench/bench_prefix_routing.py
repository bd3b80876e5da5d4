"""Prefix-aware routing on a real two-server fleet (issue 65): do later turns land where their
prefix is cached, and what does that save?

Two `toppings-serve` processes on loopback (SmolLM2 by default, `--adapters` random rank-8
adapters and `--checkers` activated checkers, each server publishing KV cache events with
`--kv-events-endpoint tcp://*:PORT` and a replay endpoint) and two `toppings-scheduler`s in front
of the same servers, registered by URL only: `--policy prefix-aware --tokenizer DIR` (on) and
`--policy rank-aware` (off, the scheduler before prefix routing). Rounds alternate between the
two (`--rounds` each, the first order swapped every other round); every round uses fresh text,
so nothing a round finds cached comes from an earlier one.

A round runs:
- `--concurrency` at a time, conversations (one per adapter): `--turns` chat turns under the
  conversation's adapter, through the scheduler's `/v1/chat/completions` (the scheduler
  tokenizes the messages), the first turn `--context-tokens` words of text, each later one the
  history plus the answer (`--answer-tokens`) and `--user-tokens` more words, streamed;
- then one at a time, pipelines (`--pipelines`, token-id prompts of `--context-tokens` ids): the
  base model answers the history, then an activated checker judges history + answer + its
  invocation sequence, and the base model runs on the very same prompt as the checker (a base
  turn on the same prefix; every other pipeline runs these two the other way round).

Measured per request: TTFT at the client (first streamed token) and the server that answered
(`X-Toppings-Server`). A later request (turns 2+, the checker, the base turn after it) is a hit
when it lands on the server of the request before it in its conversation or pipeline, the
server that holds its prefix. Metrics: `prefix_hit_rate` (on rounds; off rounds' beside it),
`ttft_ratio_prefix_routing_vs_off` (median TTFT of the conversations' later turns, on / off,
per pair of rounds: median and spread), `checker_ttft_ratio_vs_base_same_prefix` (on rounds:
median checker TTFT / median TTFT of the base turn on its prompt).

    python -m bench.bench_prefix_routing
    python -m bench.bench_prefix_routing --quick  # a tiny Llama, checks the driver (< 1 min)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from bench.common import free_port, write_random_adapter
from bench.envelope import describe_device, write_result

log = logging.getLogger("bench_prefix_routing")
MODES = ("on", "off")
POLICY = {"on": "prefix-aware", "off": "rank-aware"}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
PERF = Path(__file__).resolve().parent / "results" / "perf_model_smollm2_cpu.json"
HEADER = "X-Toppings-Server"
START_TIMEOUT_S = 300.0
QUICK = {"adapters": 4, "checkers": 1, "turns": 3, "pipelines": 2, "context_tokens": 96,
         "user_tokens": 16, "answer_tokens": 4, "rounds": 1, "concurrency": 2}  # fmt: skip
WORDS = (
    "the of and to in is was for on that with as by at from his an were are which this be "
    "has had one not but they also their its after first new two all other more time "
    "been some year would over people into city most only three during when made about "
    "world state later used between school many may under such these then while where "
    "team known war game season several part well before second both film music since "
    "house long back each around same early high number through work name group year "
    "river church station road family form line area album found however series"
).split()


def wait_up(url: str, proc: subprocess.Popen, ok=(200,)) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if requests.get(url + "/health", timeout=5).status_code in ok:
                return
        except requests.ConnectionError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up")
        time.sleep(0.5)


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def stream(url: str, path: str, body: dict) -> tuple[float, str, str]:
    """(TTFT in ms, server, text) of one streamed request."""
    began = time.perf_counter()
    ttft, out = None, []
    with requests.post(url + path, json={**body, "stream": True}, stream=True,
                       timeout=600) as answer:  # fmt: skip
        answer.raise_for_status()
        server = answer.headers[HEADER]
        for line in answer.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            piece = choice["delta"].get("content") if "delta" in choice else choice.get("text")
            if piece:
                if ttft is None:
                    ttft = (time.perf_counter() - began) * 1000.0
                out.append(piece)
    if ttft is None:  # nothing decodable streamed: the end of the answer bounds it
        ttft = (time.perf_counter() - began) * 1000.0
    return ttft, server, "".join(out)


class Round:
    """One round's conversations and pipelines through one scheduler."""

    def __init__(self, scheduler: str, args, base: str, vocab: int, seed: int):
        self.scheduler, self.args, self.base, self.vocab = scheduler, args, base, vocab
        self.seed = seed
        self.records: list[dict] = []  # kind, step, ttft_ms, hit
        self.lock = threading.Lock()

    def record(self, kind: str, step: int, ttft: float, server: str, previous: str | None):
        hit = None if previous is None else server == previous
        entry = {"kind": kind, "step": step, "ttft_ms": ttft, "hit": hit}
        if hit is False:  # what the scheduler saw: were its feeds fresh, how busy the servers
            state = requests.get(self.scheduler + "/admin/state", timeout=30).json()
            entry["feeds_fresh"] = [f["fresh"] for f in (state["kv_events"] or {}).values()]
            entry["servers_running_queued"] = [[s["running"], s["queued"], s["in_flight"]]
                                               for s in state["servers"]]  # fmt: skip
        with self.lock:
            self.records.append(entry)

    def conversation(self, c: int) -> None:
        a, rng = self.args, random.Random(self.seed * 1000 + c)
        messages = [{"role": "user", "content": text(rng, a.context_tokens)}]
        previous = None
        for turn in range(a.turns):
            body = {"model": f"a{c % a.adapters}", "messages": messages, "temperature": 0,
                    "max_tokens": a.answer_tokens, "ignore_eos": True}  # fmt: skip
            ttft, server, reply = stream(self.scheduler, "/v1/chat/completions", body)
            self.record("turn", turn, ttft, server, previous)
            previous = server
            messages = [*messages, {"role": "assistant", "content": reply},
                        {"role": "user", "content": text(rng, a.user_tokens)}]  # fmt: skip

    def pipeline(self, p: int) -> None:
        """base -> checker -> base on the checker's prompt; every other pipeline runs the two
        probes the other way round, so that the blocks the first computes before the
        invocation (the answer's) help each kind equally often."""
        a, rng = self.args, random.Random(self.seed * 1000 + 500 + p)
        low = self.vocab // 4
        history = [rng.randrange(low, self.vocab) for _ in range(a.context_tokens)]
        body = {"model": self.base, "prompt": history, "max_tokens": a.answer_tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        ttft, previous, _ = stream(self.scheduler, "/v1/completions", body)
        self.record("base", 0, ttft, previous, None)
        answer = [rng.randrange(low, self.vocab) for _ in range(a.answer_tokens)]
        checker = p % a.checkers
        prompt = history + answer + invocation(checker, self.vocab)
        steps = [("checker", f"chk{checker}"), ("base_same_prefix", self.base)]
        for step, (kind, model) in enumerate(steps if p % 2 == 0 else steps[::-1], start=1):
            body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            ttft, server, _ = stream(self.scheduler, "/v1/completions", body)
            self.record(kind, step, ttft, server, previous)
            previous = server

    def run(self) -> dict:
        """The conversations, `concurrency` at a time, then the pipelines one at a time (their
        checker and base probes compare TTFTs, which a neighbour's prefill would blur)."""
        a = self.args
        with ThreadPoolExecutor(a.concurrency) as pool:
            for future in [pool.submit(self.conversation, c) for c in range(a.adapters)]:
                future.result()
        for p in range(a.pipelines):
            self.pipeline(p)
        return summarise(self.records)


def summarise(records: list[dict]) -> dict:
    def median(kind: str, later: bool) -> float | None:
        values = [r["ttft_ms"] for r in records if r["kind"] == kind and (r["step"] > 0) == later]
        return statistics.median(values) if values else None

    later = [r["hit"] for r in records if r["hit"] is not None]
    turns = [r["hit"] for r in records if r["hit"] is not None and r["kind"] == "turn"]
    return {
        "hit_rate": sum(later) / len(later) if later else None,
        "num_later": len(later),
        "turn_hit_rate": sum(turns) / len(turns) if turns else None,
        "pipeline_hit_rate": (sum(later) - sum(turns)) / (len(later) - len(turns))
        if len(later) > len(turns)
        else None,
        "turn1_ttft_ms_p50": median("turn", False),
        "later_turn_ttft_ms_p50": median("turn", True),
        "checker_ttft_ms_p50": median("checker", True),
        "base_same_prefix_ttft_ms_p50": median("base_same_prefix", True),
        "misses": [
            {k: v for k, v in r.items() if k != "hit"} for r in records if r["hit"] is False
        ],  # fmt: skip
        "records": records,
    }


def invocation(i: int, vocab: int) -> list[int]:
    """Checker i's invocation sequence: ids below the range histories draw from (vocab / 4 up)."""
    start = vocab // 8 + 3 * i
    return [start, start + 1, start + 2]


def make_adapters(root: Path, model_dir: str, args) -> dict[str, str]:
    """`args.adapters` plain rank-8 adapters a0.., and `args.checkers` activated ones chk0.."""
    paths = {}
    for i in range(args.adapters):
        out = root / f"a{i}"
        if not (out / "adapter_config.json").is_file():
            write_random_adapter(out, model_dir, 8, TARGETS, seed=300 + i)
        paths[f"a{i}"] = str(out)
    vocab = vocab_size(model_dir)
    for i in range(args.checkers):
        plain = root / f"chk{i}-plain"
        if not (plain / "adapter_config.json").is_file():
            write_random_adapter(plain, model_dir, 8, TARGETS, seed=400 + i)
        out = root / f"chk{i}"
        shutil.copytree(plain, out, dirs_exist_ok=True)
        config = json.loads((out / "adapter_config.json").read_text())
        config.update(alora_invocation_tokens=invocation(i, vocab), task_type="CAUSAL_LM")
        (out / "adapter_config.json").write_text(json.dumps(config))
        paths[f"chk{i}"] = str(out)
    return paths


def vocab_size(model_dir: str) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


class Fleet:
    """Two servers with KV events and a scheduler per mode; killed on exit."""

    def __init__(self, model_dir: str, adapters: dict[str, str], work: Path, args):
        self.procs: list[subprocess.Popen] = []
        self.servers, self.schedulers = [], {}
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        try:
            for i in range(2):
                port, events, replay = free_port(), free_port(), free_port()
                cmd = [sys.executable, "-m", "toppings.server.cli", "--model", model_dir,
                       "--port", str(port), "--device", "cpu", "--dtype", args.dtype,
                       "--kv-events-endpoint", f"tcp://*:{events}",
                       "--kv-events-replay-endpoint", f"tcp://*:{replay}"]  # fmt: skip
                cmd += [a for name, path in adapters.items() for a in ("--lora", f"{name}={path}")]
                self._start(cmd, work / f"server{i}.log", env)
                self.servers.append(f"http://127.0.0.1:{port}")
            for mode in MODES:
                port = free_port()
                cmd = [sys.executable, "-m", "toppings.scheduler.cli", "--registry",
                       str(work / f"registry-{mode}.sqlite"), "--port", str(port),
                       "--policy", POLICY[mode], "--tokenizer", model_dir]  # fmt: skip
                if args.perf_model:
                    cmd += ["--perf-model", args.perf_model]
                self._start(cmd, work / f"scheduler-{mode}.log", env)
                self.schedulers[mode] = f"http://127.0.0.1:{port}"
            for url, proc in zip(self.servers, self.procs, strict=False):
                wait_up(url, proc)
            for mode, url in self.schedulers.items():
                wait_up(url, self.procs[2 + MODES.index(mode)], ok=(200, 503))
                for server in self.servers:
                    answer = requests.post(url + "/admin/servers", json={"url": server}, timeout=60)
                    answer.raise_for_status()
        except BaseException:
            self.close()
            raise

    def _start(self, cmd: list[str], log_path: Path, env: dict) -> None:
        out = log_path.open("w")
        self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))

    def base_model(self) -> str:
        models = requests.get(self.schedulers["on"] + "/v1/models", timeout=10).json()["data"]
        return next(m["id"] for m in models if m["parent"] is None)

    def wait_fresh(self) -> None:
        """Until the prefix-aware scheduler follows both servers' events."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = requests.get(self.schedulers["on"] + "/admin/state", timeout=10).json()
            feeds = state.get("kv_events") or {}
            if len(feeds) == 2 and all(f["fresh"] for f in feeds.values()):
                return
            time.sleep(0.2)
        raise RuntimeError("the prefix-aware scheduler does not follow both servers' events")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait(timeout=30)


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "rounds": values}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: smollm2 (--quick: a tiny Llama)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--adapters", type=int, default=16, help="adapters, one conversation each")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument(
        "--context-tokens",
        type=int,
        default=1600,
        help="words of a conversation's first turn; ids of a pipeline's history",
    )
    p.add_argument("--user-tokens", type=int, default=96, help="words each later turn adds")
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--checkers", type=int, default=2)
    p.add_argument("--pipelines", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="rounds per mode, alternating")
    p.add_argument(
        "--perf-model",
        default=None,
        help=f"the schedulers' perf model (default: {PERF.name}, none with --quick)",
    )
    p.add_argument("--adapter-dir", default="/tmp/toppings-bench-prefix")
    p.add_argument("--label", default="", help="a note stored in the config (e.g. shared VM)")
    p.add_argument("--quick", action="store_true", help="a tiny run that checks the driver")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    elif args.perf_model is None:
        args.perf_model = str(PERF)
    return args


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    if args.model is None and args.quick:
        from toppings.scripts.make_tiny_llama import make_tiny_llama

        model_dir = str(make_tiny_llama(work / "tiny", max_position_embeddings=4096))
    else:
        from toppings.server.model.loader import resolve_model_dir

        model_dir = str(resolve_model_dir(args.model or "smollm2"))
    adapter_root = Path(args.adapter_dir) / Path(model_dir).name
    adapters = make_adapters(adapter_root, model_dir, args)
    load_before = os.getloadavg()[0]
    fleet = Fleet(model_dir, adapters, work, args)
    rounds: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        fleet.wait_fresh()
        base = fleet.base_model()
        vocab = vocab_size(model_dir)
        warm = argparse.Namespace(**{**vars(args), "turns": 2, "pipelines": 1, "adapters": 2,
                                     "context_tokens": 32, "user_tokens": 8})  # fmt: skip
        Round(fleet.schedulers["on"], warm, base, vocab, seed=1).run()  # loads, first steps
        for r in range(args.rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                seed = 100 + 2 * r + MODES.index(mode)
                result = Round(fleet.schedulers[mode], args, base, vocab, seed).run()
                log.info("round %d %s: %s", r, mode,
                         {k: v for k, v in result.items() if k != "records"})  # fmt: skip
                rounds[mode].append(result)
        device = describe_device("cpu")
    finally:
        fleet.close()
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()[0]
    on, off = rounds["on"], rounds["off"]
    metrics = {
        "prefix_hit_rate": sum(r["hit_rate"] * r["num_later"] for r in on)
        / sum(r["num_later"] for r in on),
        "prefix_hit_rate_off": sum(r["hit_rate"] * r["num_later"] for r in off)
        / sum(r["num_later"] for r in off),
        "ttft_ratio_prefix_routing_vs_off": spread(
            [a["later_turn_ttft_ms_p50"] / b["later_turn_ttft_ms_p50"] for a, b in zip(on, off)]
        ),
        "first_turn_ttft_ratio_on_vs_off": spread(
            [a["turn1_ttft_ms_p50"] / b["turn1_ttft_ms_p50"] for a, b in zip(on, off)]
        ),
        "checker_ttft_ratio_vs_base_same_prefix": spread(
            [r["checker_ttft_ms_p50"] / r["base_same_prefix_ttft_ms_p50"] for r in on]
        ),
        "rounds": {
            m: [{k: v for k, v in r.items() if k != "records"} for r in rounds[m]] for m in MODES
        },  # fmt: skip
    }
    out = args.out or ("/tmp/prefix_routing.json" if args.quick else "bench/results/"
                       "prefix_routing.json")  # fmt: skip
    cfg = {k: v for k, v in vars(args).items() if k not in ("out",)}
    cfg.update(
        model_dir=model_dir,
        fleet="2 toppings-serve (--device cpu, KV events on) + a prefix-aware and a rank-aware "
        "toppings-scheduler, loopback",
        hit="a later request lands on the server of the request before it in its conversation "
        "or pipeline",
        load_average_1min_before_after=[load_before, load_after],
    )
    result = write_result(out, "prefix_routing", "bench_prefix_routing", device=device,
                          config=cfg, metrics=metrics, argv=argv)  # fmt: skip
    log.info("wrote %s: %s", out, json.dumps({k: v for k, v in metrics.items() if k != "rounds"}))
    return result


if __name__ == "__main__":
    main()
