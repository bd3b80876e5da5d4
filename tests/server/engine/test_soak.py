"""A node under load: toppings-launch starts two tiny-model servers (cpu-assisted, one CPU worker
each, an adapter cache that holds two of three adapters, an emulated slow link), a scheduler
stand-in records their registration, and 500 mixed requests from 32 client threads run through
them, some streamed, some hung up on after the first chunk. Then everything must be idle, and
after the launcher stops, no process and no shared memory of ours may survive."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import process_alive

pytestmark = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="two servers on disjoint cores need two cores"
)

ADAPTERS = {"r8": 8, "r16": 16, "r32": 32}  # q,k,v on 2 layers: 2560 bytes per rank unit
CACHE_BYTES = 2560 * (32 + 16) + 1000  # two adapters fit, three do not: evictions happen
MAX_TOTAL_TOKENS = 2048
NUM_REQUESTS, NUM_CLIENTS = 500, 32
KILLED: list[int] = []  # servers this module SIGKILLs (they may leave shared memory to sweep)
ROW = re.compile(r"server=(\d+)\s+url=(\S+)\s+pid=(\d+)\s+cores=(\S+)\s+.*?state=(\w+)")


class SchedulerStandIn(BaseHTTPRequestHandler):
    """Answers /admin/servers like the scheduler and records what it was asked."""

    calls: list[tuple[str, str]] = []

    def _record(self, status: int) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.calls.append((self.command, body["url"]))
        self.send_response(status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def do_POST(self) -> None:  # noqa: N802
        self._record(201)

    def do_DELETE(self) -> None:  # noqa: N802
        self._record(200)

    def log_message(self, *args) -> None:
        pass


class Node:
    """The launcher process, its output as it comes, and the servers it reports."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def rows(self) -> dict[int, dict]:
        """The launcher's latest line for each server."""
        rows = {}
        for m in ROW.finditer(self.text):
            rows[int(m[1])] = {"url": m[2], "pid": int(m[3]), "cores": m[4], "state": m[5]}
        return rows

    def wait_for(self, predicate, what: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert self.proc.poll() is None, f"the launcher exited:\n{self.text}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{self.text}"
            time.sleep(0.1)


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue
    raise RuntimeError("no two adjacent free ports")


@pytest.fixture(scope="module")
def scheduler():
    SchedulerStandIn.calls = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), SchedulerStandIn)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", SchedulerStandIn.calls
    httpd.shutdown()


@pytest.fixture(scope="module")
def node(tmp_path_factory, tiny_model_dir, scheduler):
    from toppings.scripts.make_adapters import load_base, make_random_adapter

    tmp = tmp_path_factory.mktemp("soak")
    base = load_base(tiny_model_dir)
    for i, (name, rank) in enumerate(ADAPTERS.items()):
        make_random_adapter(tmp / "loras" / name, base, rank=rank, seed=i)
    cmd = [sys.executable, "-m", "toppings.scripts.launch.cli", "--model", str(tiny_model_dir),
           "--num-servers", "2", "--base-port", str(_free_port_pair()), "--lora-dir",
           str(tmp / "loras"), "--log-dir", str(tmp / "logs"), "--scheduler", scheduler[0],
           "--drain-timeout", "20", "--restart-backoff", "0.2", "--",
           "--dtype", "float32",  # CACHE_BYTES counts float32 adapters
           "--lora-mode", "cpu-assisted", "--max-total-tokens", str(MAX_TOTAL_TOKENS),
           "--adapter-cache-bytes", str(CACHE_BYTES), "--link-gbps", "0.002"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    node = Node(proc)
    try:
        node.wait_for(lambda: "all 2 servers healthy" in node.text, "both servers")
        yield node
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _stats(url: str) -> dict:
    return requests.get(url + "/stats", timeout=10).json()


def _metrics(url: str) -> dict[tuple, float]:
    text = requests.get(url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_killed_server_is_restarted_and_registered_again(node, scheduler):
    url, calls = scheduler
    rows = node.rows()
    urls = [rows[0]["url"], rows[1]["url"]]
    node.wait_for(lambda: sorted(u for m, u in calls if m == "POST") == urls, "registration")
    old = rows[1]["pid"]
    KILLED.append(old)
    os.kill(old, signal.SIGKILL)
    node.wait_for(
        lambda: node.rows()[1]["pid"] != old and node.rows()[1]["state"] == "healthy",
        "the restarted server",
    )
    node.wait_for(lambda: [u for m, u in calls if m == "POST"].count(urls[1]) == 2, "re-register")
    assert requests.get(urls[1] + "/health", timeout=10).status_code == 200


def test_servers_and_their_workers_sit_on_disjoint_cores(node):
    rows = node.rows()
    seen: set[int] = set()
    for row in rows.values():
        cores = {int(c) for c in row["cores"].split(",")}
        assert os.sched_getaffinity(row["pid"]) == cores
        assert not cores & seen
        seen |= cores
        workers = _stats(row["url"])["cpu_workers"]
        assert len(workers) == len(cores)
        for w in workers:
            assert w["alive"] and w["core"] in cores
            assert os.sched_getaffinity(w["pid"]) == {w["core"]}
    assert len(rows) == 2


def _one_request(i: int, urls: list[str], clients: list[openai.OpenAI], base: str) -> str | None:
    """Run request i; returns an error description, or None when it behaved."""
    rng = random.Random(i)
    k = i % 2
    url, client = urls[k], clients[k]
    adapter = rng.choice([None, *ADAPTERS])
    model = adapter or base
    max_tokens = rng.randint(8, 16)
    prompt = " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat"]) for _ in range(5))
    kind = rng.choices(["plain", "openai", "chat", "native", "cancel_openai", "cancel_native"],
                       [3, 3, 3, 3, 1, 1])[0]  # fmt: skip
    native = {"adapter": adapter, "prompt": prompt, "max_new_tokens": max_tokens,
              "ignore_eos": True, "stream": True}  # fmt: skip
    extra = {"ignore_eos": True}
    if kind == "plain":
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        got = requests.post(url + "/v1/completions", json=body, timeout=120).json()
        n, reason = got["usage"]["completion_tokens"], got["choices"][0]["finish_reason"]
    elif kind == "openai":
        got = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                        extra_body=extra)  # fmt: skip
        n, reason = got.usage.completion_tokens, got.choices[0].finish_reason
    elif kind == "chat":
        chunks = list(client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            stream=True, stream_options={"include_usage": True}, extra_body=extra))  # fmt: skip
        n = chunks[-1].usage.completion_tokens
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    elif kind == "native":
        with requests.post(url + "/generate", json=native, stream=True, timeout=120) as r:
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith(b"data: {")]
        n, reason = events[-1]["output_tokens"], events[-1]["finish_reason"]
    elif kind == "cancel_openai":
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                           stream=True, extra_body=extra)  # fmt: skip
        next(iter(stream))
        stream.close()
        return None
    else:
        with requests.post(url + "/generate", json=native, stream=True, timeout=120) as r:
            next(line for line in r.iter_lines() if line)
        return None
    if (n, reason) != (max_tokens, "length"):
        return f"request {i} ({kind}, {adapter}): {n} tokens, {reason}; wanted {max_tokens}"
    return None


def test_soak_then_idle_then_clean_stop(node, scheduler, tiny_model_dir):
    rows = node.rows()
    urls = [rows[0]["url"], rows[1]["url"]]
    clients = [openai.OpenAI(base_url=u + "/v1", api_key="x", max_retries=0, timeout=120)
               for u in urls]  # fmt: skip
    before = [_metrics(u) for u in urls]

    def run(i: int) -> str | None:
        try:
            return _one_request(i, urls, clients, tiny_model_dir.name)
        except Exception as exc:  # a failure is collected, not raised in a worker thread
            return f"request {i}: {type(exc).__name__}: {exc}"

    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        errors = [e for e in pool.map(run, range(NUM_REQUESTS)) if e]
    assert not errors, f"{len(errors)} requests failed, e.g. {errors[:5]}"

    finished = 0
    for url, old in zip(urls, before):
        deadline = time.monotonic() + 30  # hung-up requests end once their abort is seen
        # A load started for a request that was then hung up on still runs to its end.
        while (s := _stats(url))["running"] or s["queue"] or s["loading_adapters"]:
            assert time.monotonic() < deadline, s
            time.sleep(0.1)
        # The pool's budget is the KV tokens plus the adapter bytes (as KV tokens).
        assert s["free_kv_tokens"] == s["max_total_tokens"] > MAX_TOTAL_TOKENS
        blocks = s["memory"]["blocks"]
        assert blocks["kv_in_use"] == blocks["adapters_in_use"] == 0, blocks
        assert all(w["alive"] for w in s["cpu_workers"])
        m = _metrics(url)
        assert m[("toppings:adapter_references", ())] == 0  # no pins in cpu-assisted mode
        assert m[("toppings:num_requests_running", ())] == 0
        assert m[("toppings:kv_cache_reserved_tokens", ())] == 0
        # the third adapter found room by an eviction, or ran on the host while the others
        # held the room (server/adapters/host_served.py)
        paged = m[("toppings:adapter_evictions_total", ())]
        assert paged + m[("toppings:requests_host_served_total", ())] >= 1
        finished += sum(v - old.get(k, 0) for k, v in m.items()
                        if k[0] == "toppings:request_finished_total")  # fmt: skip
    assert finished == NUM_REQUESTS
    host_calls = sum(_metrics(u)[("toppings:cpu_lora_invocations_total", ())] for u in urls)
    assert host_calls > 0  # the emulated slow link sends early layers to the CPU workers

    pids = [r["pid"] for r in rows.values()]
    pids += [w["pid"] for u in urls for w in _stats(u)["cpu_workers"]]
    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(90) == 0, node.text
    url, calls = scheduler
    assert sorted(u for m, u in calls if m == "DELETE") == sorted(urls)
    deadline = time.monotonic() + 10
    while any(process_alive(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if process_alive(p)]
        time.sleep(0.1)
    ours = tuple(f"{pre}toppings-{p}." for p in pids for pre in ("", "sem."))  # pid.word
    assert [n for n in os.listdir("/dev/shm") if n.startswith(ours)] == []
    # The launcher sweeps what a dead server left; only the SIGKILLed one may have left any.
    swept = re.findall(r"shared-memory names stopped servers left: (.*)", node.text)
    killed = tuple(f"{pre}toppings-{p}." for p in KILLED for pre in ("", "sem."))
    assert all(n.startswith(killed) for line in swept for n in line.split(", ")), swept
