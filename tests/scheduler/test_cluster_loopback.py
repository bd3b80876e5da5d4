"""The scheduler in front of two real inference servers on loopback, through the openai client.

Two `toppings-serve` processes (a tiny random Llama, adapters of rank 8 and 64, BGMV) and one
`toppings-scheduler` (a perf model written here, so that its costs are known) are registered
through the scheduler's admin endpoint. The tests check that:
- chat and completions, streamed and not, come back through the scheduler;
- a request goes where Algorithm 1's cost is lowest, computed here with the scheduler's own policy
  code from /stats snapshots of both servers, in a setup where least-loaded would pick the other;
- after a SIGKILL of one server, the non-streamed requests it was running are retried on the
  other (none is lost or duplicated), and from 1 s on the scheduler no longer routes to it.
Every process is killed when the module's tests end.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import requests

from tests.helpers import wait_healthy
from toppings.scheduler.perf_model import LinearPerfModel, PerfModels
from toppings.scheduler.policies import make_policy
from toppings.scheduler.prompt_tokens import estimate_prompt_tokens
from toppings.scheduler.state import RouteRequest, ServerState

START_TIMEOUT_S = 90.0
HEADER = "x-toppings-server"
NO_EOS = {"ignore_eos": True}


@dataclass
class Cluster:
    scheduler: str
    servers: list[str]  # [A, B], registration order
    procs: dict[str, subprocess.Popen]
    client: openai.OpenAI
    base_model: str
    perf: PerfModels
    logs: Path


def _perf_models() -> PerfModels:
    """Eq. 2 with round numbers: decode 10 ms + 0.01 ms per |S| x max rank; cheap prefill."""
    models = {}
    for kernel in ("bgmv", "mbgmv"):
        models[f"{kernel}_decode"] = LinearPerfModel(kernel, "decode", 10.0, (0.01,))
        models[f"{kernel}_prefill"] = LinearPerfModel(kernel, "prefill", 1.0, (0.01, 1e-4))
    return PerfModels(models, source="test")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, free_port):
    from toppings.scripts.make_adapters import make_random_adapter
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    root = tmp_path_factory.mktemp("loopback")
    # A long context, so that the requests loading a server outlive the checks made meanwhile.
    model = make_tiny_llama(root / "tiny", max_position_embeddings=8192)
    loras = [f"r{r}={make_random_adapter(root / f'r{r}', model, rank=r, seed=r)}" for r in (8, 64)]
    perf_path = root / "perf.json"
    _perf_models().save(perf_path)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: dict[str, subprocess.Popen] = {}
    logs = {}
    try:
        for _ in range(2):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "toppings.server.cli", "--model", str(model),
                   "--port", str(port), "--device", "cpu", "--dtype", "float32",
                   "--kernel", "bgmv"]  # fmt: skip
            cmd += [arg for lora in loras for arg in ("--lora", lora)]
            logs[url] = root / f"server-{port}.log"
            procs[url] = subprocess.Popen(cmd, env=env, stdout=logs[url].open("w"),
                                          stderr=subprocess.STDOUT)  # fmt: skip
        port = free_port()
        scheduler = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "toppings.scheduler.cli",
               "--registry", str(root / "reg.sqlite"), "--port", str(port),
               "--perf-model", str(perf_path), "--slo-tpt-ms", "1000",
               "--policy", "rank-aware"]  # fmt: skip
        logs[scheduler] = root / "scheduler.log"
        procs[scheduler] = subprocess.Popen(cmd, env=env, stdout=logs[scheduler].open("w"),
                                            stderr=subprocess.STDOUT)  # fmt: skip
        servers = [u for u in procs if u != scheduler]
        for url in servers:
            wait_healthy(url, procs[url], logs[url], START_TIMEOUT_S)
        _wait_up(scheduler, procs[scheduler])
        for url in servers:
            answer = requests.post(scheduler + "/admin/servers", json={"url": url}, timeout=30)
            assert answer.status_code == 201, answer.text
            assert answer.json()["adapters"] == ["r64", "r8"]
        models = requests.get(scheduler + "/v1/models", timeout=10).json()["data"]
        (base,) = [m["id"] for m in models if m["parent"] is None]
        client = openai.OpenAI(base_url=scheduler + "/v1", api_key="unused", max_retries=0,
                               timeout=120)  # fmt: skip
        yield Cluster(scheduler, servers, procs, client, base, _perf_models(), root)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in procs.values():
            proc.wait(timeout=30)


def _wait_up(url: str, proc: subprocess.Popen) -> None:
    """Until the scheduler answers /health: 503 "no server ready yet" while none is registered."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            answer = requests.get(url + "/health", timeout=5)
            if answer.status_code == 503:
                assert answer.json()["error"]["message"] == "no server ready yet"
                return
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, "the scheduler did not start"
        time.sleep(0.2)


def _stats(url: str) -> dict:
    return requests.get(url + "/stats", timeout=10).json()


def _admin_servers(cluster: Cluster) -> dict[str, dict]:
    state = requests.get(cluster.scheduler + "/admin/state", timeout=10).json()
    return {s["url"]: s for s in state["servers"]}


def _wait(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _wait_idle(cluster: Cluster) -> None:
    """Wait until no request runs or waits on any live server."""
    for url in cluster.servers:
        if cluster.procs[url].poll() is None:
            _wait(lambda u=url: not _stats(u)["running"] and not _stats(u)["queue"], "idle", 60)


def test_chat_and_completions_stream_and_not(cluster):
    client = cluster.client
    raw = client.completions.with_raw_response.create(
        model="r8", prompt="hello there", max_tokens=5, extra_body=NO_EOS
    )
    assert raw.headers[HEADER] in cluster.servers
    done = raw.parse()
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 5
    assert done.choices[0].text

    raw = client.chat.completions.with_raw_response.create(
        model="r64", messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body=NO_EOS
    )
    assert raw.headers[HEADER] in cluster.servers
    chat = raw.parse()
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content

    raw = client.completions.with_raw_response.create(
        model=cluster.base_model, prompt="abc", max_tokens=6, stream=True, extra_body=NO_EOS
    )
    assert raw.headers[HEADER] in cluster.servers
    chunks = list(raw.parse())
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    raw = client.chat.completions.with_raw_response.create(
        model="r8", messages=[{"role": "user", "content": "yo"}], max_tokens=3, stream=True,
        extra_body=NO_EOS,
    )  # fmt: skip
    assert raw.headers[HEADER] in cluster.servers
    chunks = [c for c in raw.parse() if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)


def test_in_flight_ends_on_every_path_through_real_http(cluster):
    """Finished, refused and abandoned requests leave nothing running, here or on the servers."""
    client = cluster.client
    client.completions.create(model="r8", prompt="a", max_tokens=2, extra_body=NO_EOS)
    list(client.completions.create(model="r8", prompt="a", max_tokens=2, stream=True))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="r8", prompt="a", max_tokens=0)
    # A long stream whose client leaves before reading a byte, and one that leaves midway.
    body = {"adapter": "r64", "input_ids": [5, 6, 7], "max_new_tokens": 6000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    for read in (0, 3):
        answer = requests.post(cluster.scheduler + "/generate", json=body, stream=True, timeout=60)
        assert answer.status_code == 200
        for _, _ in zip(range(read), answer.iter_lines(), strict=False):
            pass
        answer.close()

    def idle() -> bool:
        servers = _admin_servers(cluster).values()
        busy = [len(_stats(s)["running"]) for s in cluster.servers]
        return all(s["in_flight"] == 0 for s in servers) and busy == [0, 0]

    _wait(idle, "the scheduler's in_flight and the servers' running back to 0", 30.0)


def _hold(url: str, adapter: str, count: int) -> list[requests.Response]:
    """Start `count` long streamed requests directly on a server; returns the open responses."""
    body = {"adapter": adapter, "input_ids": [5, 6, 7], "max_new_tokens": 6000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    held = []
    for _ in range(count):
        held.append(requests.post(url + "/generate", json=body, stream=True, timeout=60))
        assert held[-1].status_code == 200
    return held


def test_routing_follows_the_policy_cost(cluster):
    _wait_idle(cluster)
    a, b = cluster.servers
    # A runs 2 requests of rank 8, B 3 of rank 64. A new rank-64 request pads A's BGMV batch
    # from rank 8 to 64 (a large increase, times 2 requests) but adds one row to B's (a small
    # one, times 3): Algorithm 1 picks B, least-loaded would pick A.
    held = _hold(a, "r8", 2) + _hold(b, "r64", 3)
    try:
        _wait(lambda: (len(_stats(a)["running"]), len(_stats(b)["running"])) == (2, 3), "load")
        _wait(lambda: all(
            (s["running"], s["routed_since_snapshot"]) == (n, 0)
            for s, n in zip((_admin_servers(cluster)[u] for u in (a, b)), (2, 3))
        ), "the scheduler to see the load")  # fmt: skip
        states = [ServerState.from_stats(url, _stats(url)) for url in (a, b)]
        admin = requests.get(cluster.scheduler + "/admin/state", timeout=10).json()
        body = {"model": "r64", "prompt": "route me", "max_tokens": 2}
        request = RouteRequest("r64", 64, estimate_prompt_tokens(body), 2, cluster.base_model)
        policy = make_policy("rank-aware", cluster.perf, admin["slo_tpt_ms"],
                             admin["avg_resp_len"])  # fmt: skip
        expected = states[policy.choose(request, states)].url
        least_loaded = make_policy("least-loaded", cluster.perf, admin["slo_tpt_ms"])
        assert expected == b and states[least_loaded.choose(request, states)].url == a

        raw = cluster.client.completions.with_raw_response.create(**body, extra_body=NO_EOS)
        assert raw.headers[HEADER] == expected
        assert raw.parse().usage.completion_tokens == 2
    finally:
        for response in held:  # the servers abort a request whose client went away
            response.close()


def _count_requests(url: str) -> int:
    """Completions and chat requests a server has answered, from its /metrics."""
    text = requests.get(url + "/metrics", timeout=10).text
    pattern = r'^toppings:http_requests_total\{endpoint="(?:completions|chat)",[^}]*\} (\S+)$'
    return int(sum(float(v) for v in re.findall(pattern, text, re.MULTILINE)))


def _send(cluster: Cluster, idx: int, max_tokens: int, stream: bool = False) -> tuple[str, int]:
    """One request through the scheduler; (the server that answered, completion tokens)."""
    adapter = ("r8", "r64")[idx % 2]
    if idx % 3:
        api, args = (
            cluster.client.chat.completions,
            {"messages": [{"role": "user", "content": "q"}]},
        )
    else:
        api, args = cluster.client.completions, {"prompt": f"p{idx}"}
    if stream:
        args["stream_options"] = {"include_usage": True}
    raw = api.with_raw_response.create(
        model=adapter, max_tokens=max_tokens, stream=stream, extra_body=NO_EOS, **args
    )
    if not stream:
        return raw.headers[HEADER], raw.parse().usage.completion_tokens
    chunks = list(raw.parse())
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    return raw.headers[HEADER], chunks[-1].usage.completion_tokens


def test_sigkill_retries_on_the_other_server_and_stops_routing_to_the_dead_one(cluster):
    _wait_idle(cluster)
    a, b = cluster.servers
    served_by_b = _count_requests(b)
    num_first, max_tokens = 6, 1500
    with ThreadPoolExecutor(num_first) as pool:
        futures = [pool.submit(_send, cluster, i, max_tokens) for i in range(num_first)]
        _wait(lambda: len(_stats(a)["running"]) >= 1, "A to run a request", 60)
        running_on_a = len(_stats(a)["running"])
        cluster.procs[a].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        results = [f.result(timeout=120) for f in futures]
    assert running_on_a >= 1
    # Not streamed, so none had started answering: each one that A was running was retried on B.
    assert results == [(b, max_tokens)] * num_first

    time.sleep(max(0.0, killed_at + 1.0 - time.monotonic()))
    dead = _admin_servers(cluster)[a]
    assert dead["healthy"] is False
    tried_a = dead["routed_since_snapshot"]  # A answers no /stats again: this only grows
    later = [_send(cluster, i, 4, stream=i % 2 == 0) for i in range(4)]
    assert later == [(b, 4)] * 4
    assert _admin_servers(cluster)[a]["routed_since_snapshot"] == tried_a
    # B answered each request once: the 6 (retried ones included) and the 4 later ones.
    assert _count_requests(b) - served_by_b == num_first + len(later)
    health = requests.get(cluster.scheduler + "/health", timeout=10).json()
    assert (health["num_servers"], health["num_healthy"]) == (2, 1)
