"""LoRAServe on loopback: three real servers holding different adapters, a loraserve scheduler.

Servers (tiny random Llama, BGMV, one API key for the whole cluster, each with its own
--adapter-store and every server as --peer) start with different adapters on disk:
S0 {a8, b16, e16}, S1 {b16, c32, e16}, S2 {d64}. The scheduler (--policy loraserve, 1 s
placement steps) learns each adapter's SHA-256 through /admin/adapters, except e16's (so it
never moves e16 itself). The tests check that:
- every adapter answers through the scheduler;
- demand on a8 alone makes the placement spread it over the three servers, S1 and S2 fetch it
  from S0, and S2's greedy tokens for it equal transformers + PEFT's;
- a peer whose bytes do not hash to the digest is refused and the next peer serves the fetch;
- bad input (unknown adapter, a peer that is down, not listed with --peer or answers garbage,
  escaping names, a huge announced or streamed file, bad fields, a missing key) gets a 4xx
  JSON error and writes nothing outside the store;
- after a SIGKILL of S0, the only server that started with a8, a8 still answers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

from tests.helpers import wait_healthy
from tests.scheduler.test_cluster_loopback import _perf_models
from tests.server.engine.test_exactness import NEW_TOKENS, assert_same_greedy, reference_greedy
from toppings.scheduler.registry import Registry
from toppings.server.api.admin.files import FILES, WEIGHTS_FILE, adapter_digest

KEY = "cluster-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
RANKS = {"a8": 8, "b16": 16, "c32": 32, "d64": 64, "e16": 16}
ON_DISK = (("a8", "b16", "e16"), ("b16", "c32", "e16"), ("d64",))
PROMPT = [5, 17, 42, 9, 88, 3, 61, 27]
SPARE_PORTS = 7  # listed with --peer for the tests' own peers


@pytest.fixture(scope="module")
def pool(tmp_path_factory, free_port):
    from toppings.scripts.make_adapters import make_random_adapter
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    root = tmp_path_factory.mktemp("loraserve")
    model = make_tiny_llama(root / "tiny")
    paths = {n: str(make_random_adapter(root / "src" / n, model, rank=r, seed=r + len(n)))
             for n, r in RANKS.items()}  # fmt: skip
    _perf_models().save(root / "perf.json")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs, logs, servers = {}, {}, []
    # Every server lists the others and the tests' own peers (SPARE_PORTS) with --peer.
    ports = [free_port() for _ in ON_DISK]
    spare = [f"http://127.0.0.1:{free_port()}" for _ in range(SPARE_PORTS)]
    listed = [f"http://127.0.0.1:{p}" for p in ports] + spare
    try:
        for i, names in enumerate(ON_DISK):
            disk = root / f"disk{i}"  # each server's own copy of its adapters
            for name in names:
                shutil.copytree(paths[name], disk / name)
            port = ports[i]
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "toppings.server.cli", "--model", str(model),
                   "--port", str(port), "--device", "cpu", "--dtype", "float32",
                   "--kernel", "bgmv", "--api-key", KEY, "--lora-dir", str(disk),
                   "--adapter-store", str(root / f"store{i}")]  # fmt: skip
            cmd += [a for peer in listed for a in ("--peer", peer)]
            logs[url] = root / f"server{i}.log"
            procs[url] = subprocess.Popen(cmd, env=env, stdout=logs[url].open("w"),
                                          stderr=subprocess.STDOUT)  # fmt: skip
            servers.append(url)
        port = free_port()
        scheduler = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "toppings.scheduler.cli", "--registry",
               str(root / "reg.sqlite"), "--port", str(port), "--perf-model",
               str(root / "perf.json"), "--slo-tpt-ms", "1000", "--policy", "loraserve",
               "--placement-interval-s", "1", "--server-api-key", KEY]  # fmt: skip
        logs[scheduler] = root / "scheduler.log"
        procs[scheduler] = subprocess.Popen(cmd, env=env, stdout=logs[scheduler].open("w"),
                                            stderr=subprocess.STDOUT)  # fmt: skip
        for url in servers:
            wait_healthy(url, procs[url], logs[url], 90.0)
        _until(lambda: _answers(scheduler + "/health"), "scheduler up", 60)  # 503 until a server
        for url in servers:
            answer = requests.post(scheduler + "/admin/servers", json={"url": url}, timeout=30)
            assert answer.status_code == 201, answer.text
        digests = {n: adapter_digest(p) for n, p in paths.items()}
        base = next(m["id"] for m in _get(scheduler + "/v1/models")["data"] if not m["parent"])
        for name in ("a8", "b16", "c32", "d64"):  # e16's digest stays unknown to the registry
            body = {"name": name, "base_model": base, "rank": RANKS[name],
                    "sha256": digests[name], "path": paths[name]}  # fmt: skip
            answer = requests.post(scheduler + "/admin/adapters", json=body, timeout=30)
            assert answer.status_code == 201, answer.text
        yield {"root": root, "model": model, "paths": paths, "digests": digests,
               "servers": servers, "scheduler": scheduler, "procs": procs,
               "spare": spare}  # fmt: skip
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in procs.values():
            proc.wait(timeout=30)


def _get(url: str, headers: dict | None = None) -> dict | None:
    try:
        answer = requests.get(url, headers=headers, timeout=10)
    except requests.ConnectionError:
        return None
    return answer.json() if answer.status_code == 200 else None


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=5).status_code in (200, 503)
    except requests.ConnectionError:
        return False


def _until(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _held(url: str) -> set[str]:
    stats = _get(url + "/stats", AUTH) or {}
    return {a["name"] for a in stats.get("adapters", ())}


def _complete(scheduler: str, model: str, max_tokens: int = 4) -> requests.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    return requests.post(scheduler + "/v1/completions", json=body, timeout=120)


def _fetch(url: str, body: dict, headers: dict = AUTH) -> requests.Response:
    return requests.post(url + "/v1/load_lora_adapter", json=body, headers=headers, timeout=120)


def test_every_adapter_answers_through_the_scheduler(pool):
    for name in RANKS:
        answer = _complete(pool["scheduler"], name)
        assert answer.status_code == 200, (name, answer.text)
        assert answer.json()["usage"]["completion_tokens"] == 4


def test_a_hot_adapter_spreads_is_fetched_and_matches_peft(pool):
    s0, s1, s2 = pool["servers"]
    for _ in range(3):  # keep a8 hot over several placement steps
        for _ in range(12):
            assert _complete(pool["scheduler"], "a8", 2).status_code == 200
    _until(lambda: "a8" in _held(s1) and "a8" in _held(s2), "a8 fetched by S1 and S2", 90)
    assert any(p.name.startswith("a8-") for p in (pool["root"] / "store2").iterdir())
    body = {"adapter": "a8", "input_ids": PROMPT, "max_new_tokens": NEW_TOKENS,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    answer = requests.post(s2 + "/generate", json=body, headers=AUTH, timeout=120)
    if answer.status_code == 404:  # a later step dropped S2's copy meanwhile: S1 keeps one
        answer = requests.post(s1 + "/generate", json=body, headers=AUTH, timeout=120)
    assert answer.status_code == 200, answer.text
    ref, margins = reference_greedy(pool["model"], {"a8": pool["paths"]["a8"]}, PROMPT, "a8")
    assert_same_greedy(answer.json()["token_ids"], ref, margins, "a8 fetched onto S2")
    # The routing table is in the registry: every adapter placed, probabilities summing to 1.
    assert _get(pool["scheduler"] + "/admin/state")["placement"]["num_servers"] == 3
    registry = Registry(pool["root"] / "reg.sqlite")
    try:
        table = registry.routes()
    finally:
        registry.close()
    assert set(table) == set(RANKS)
    assert all(abs(sum(row.values()) - 1) < 1e-9 for row in table.values())


class FakePeer:
    """A peer that answers what a test tells it to, on a thread."""

    def __init__(self, respond, url: str):
        port = int(url.rsplit(":", 1)[1])
        self.server = make_server("127.0.0.1", port, Request.application(respond))
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def copy_of(directory: str, corrupt: bool):
    """A peer serving `directory`'s files under any name, with one weight byte flipped when
    `corrupt` (sizes unchanged)."""
    files = {f: Path(directory, f).read_bytes() for f in FILES}
    if corrupt:
        weights = bytearray(files[WEIGHTS_FILE])
        weights[-1] ^= 0xFF
        files[WEIGHTS_FILE] = bytes(weights)

    def respond(request: Request) -> Response:
        if request.path.endswith("/files"):
            listing = [{"name": f, "bytes": len(b)} for f, b in files.items()]
            return Response(json.dumps({"files": listing}), content_type="application/json")
        return Response(files[request.path.rsplit("/", 1)[1]])

    return respond


def _outside_store(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if not any(part.startswith("store") for part in p.parts)}


def test_a_corrupted_transfer_is_refused_and_the_next_holder_serves(pool):
    s0, s1, s2 = pool["servers"]
    fake = FakePeer(copy_of(pool["paths"]["e16"], corrupt=True), pool["spare"][0])
    try:
        body = {"lora_name": "e16", "sha256": pool["digests"]["e16"], "peers": [fake.url, s1]}
        answer = _fetch(s2, body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["fetched_from"] == s1
        # Only the corrupted peer: refused, and nothing stays behind.
        lone = {"lora_name": "e16-copy", "sha256": body["sha256"], "peers": [fake.url]}
        refused = _fetch(s2, lone)
        assert refused.status_code == 424, refused.text
        assert "SHA-256 mismatch" in refused.json()["error"]["message"]
    finally:
        fake.close()
    stored = [p.name for p in (pool["root"] / "store2").iterdir()]
    assert not [n for n in stored if n.startswith(".partial")]
    assert not [n for n in stored if n.startswith("e16-copy")]


def test_bad_input_gets_4xx_json_and_writes_nothing_outside_the_store(pool, free_port):
    s0, s1, s2 = pool["servers"]
    root = pool["root"]
    before = _outside_store(root)
    digest = pool["digests"]["b16"]  # under a name no server holds and the scheduler never moves
    huge = {"files": [{"name": "adapter_config.json", "bytes": 100},
                      {"name": "adapter_model.safetensors", "bytes": 1 << 40}]}  # fmt: skip
    overflow_list = {"files": [{"name": f, "bytes": 10} for f in FILES]}
    escape = {"files": [{"name": "../../evil", "bytes": 10}, {"name": FILES[1], "bytes": 10}]}

    def garbage(request: Request) -> Response:
        return Response("<html>not json</html>")

    def announced(listing):
        def respond(request: Request) -> Response:
            if request.path.endswith("/files"):
                return Response(json.dumps(listing), content_type="application/json")
            return Response(b"x" * 1000)  # more than the 10 bytes announced

        return respond

    answers = [garbage, announced(huge), announced(overflow_list), announced(escape),
               copy_of(pool["paths"]["b16"], False)]  # fmt: skip
    fakes = [FakePeer(a, url) for a, url in zip(answers, pool["spare"][1:])]
    dead = pool["spare"][len(answers) + 1]  # listed, nothing listens
    unlisted = f"http://127.0.0.1:{free_port()}"
    try:
        cases = [
            ({"lora_name": "nope", "sha256": digest, "peers": [s1]}, 424, "HTTP 404"),
            ({"lora_name": "zz16", "sha256": digest, "peers": [dead]}, 424, "unreachable"),
            ({"lora_name": "zz16", "sha256": digest, "peers": [unlisted]}, 400, "--peer"),
            ({"lora_name": "zz16", "sha256": digest, "peers": [fakes[0].url]}, 424, "malformed"),
            ({"lora_name": "zz16", "sha256": digest, "peers": [fakes[1].url]}, 424, "not within"),
            ({"lora_name": "zz16", "sha256": digest, "peers": [fakes[2].url]}, 424, "more bytes"),
            ({"lora_name": "zz16", "sha256": digest, "peers": [fakes[3].url]}, 424, "malformed"),
            ({"lora_name": "../../evil", "sha256": digest, "peers": [s1]}, 400, "lora_name"),
            ({"lora_name": "zz16", "sha256": "x" * 64, "peers": [s1]}, 400, "sha256"),
            ({"lora_name": "zz16", "sha256": digest, "peers": "http://x"}, 400, "peers"),
            ({"lora_name": "zz16", "sha256": digest, "peers": ["file:///etc"]}, 400, "peers"),
            ({"lora_name": "zz16", "sha256": digest, "peers": [s1], "path": "/"}, 400, "unknown"),
        ]
        for body, status, words in cases:
            answer = _fetch(s2, body)
            assert answer.status_code == status, (body, answer.text)
            assert words in answer.json()["error"]["message"], (body, answer.text)
        # A name with slashes and dots (a valid org/name form) lands in one directory of the store.
        weird = {"lora_name": "o/../../evil", "sha256": digest, "peers": [fakes[4].url]}
        answer = _fetch(s2, weird)
        assert answer.status_code == 200, answer.text
        assert (root / "store2" / f"o_.._.._evil-{digest[:16]}" / WEIGHTS_FILE).is_file()
        # The files endpoint: key, unknown adapter, files that are not adapter files.
        assert requests.get(s1 + "/v1/adapters/b16/files", timeout=10).status_code == 401
        for path in ("/v1/adapters/nope/files", "/v1/adapters/b16/files/config.json",
                     "/v1/adapters/b16/files/..%2F..%2Fetc%2Fpasswd"):  # fmt: skip
            answer = requests.get(s1 + path, headers=AUTH, timeout=10)
            assert answer.status_code == 404 and "error" in answer.json(), path
    finally:
        for fake in fakes:
            fake.close()
    assert _outside_store(root) - before == set()
    assert not [p for p in (root / "store2").iterdir() if p.name.startswith(".partial")]
    assert _get(s2 + "/health") == {"status": "ok"}


def test_sigkill_of_the_only_original_holder_loses_nothing(pool):
    s0, s1, s2 = pool["servers"]
    _until(lambda: "a8" in _held(s1) or "a8" in _held(s2), "a8 fetched elsewhere", 90)
    pool["procs"][s0].send_signal(signal.SIGKILL)
    pool["procs"][s0].wait(timeout=30)
    for _ in range(6):
        answer = _complete(pool["scheduler"], "a8")
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-toppings-server"] != s0
