"""Peer fetch against hostile or slow peers, through Flask's test client and local HTTP peers:
only `--peer` URLs are contacted (and sent the key), redirects are never followed, one load
has a total deadline, and no `.partial-*` directory outlives a fetch or a restart."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

from toppings.server.api.admin.files import FILES, adapter_digest
from toppings.server.api.admin.peer_fetch import FetchConfig, PeerFetcher
from toppings.server.api.app import ApiOptions, create_app

KEY = "cluster-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Peer:
    """A local HTTP server answering with `respond`, recording every request it gets."""

    def __init__(self, respond):
        self.seen: list[Request] = []

        def app(request: Request) -> Response:
            self.seen.append(request)
            return respond(request)

        self.server = make_server("127.0.0.1", 0, Request.application(app), threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def serving(directory: Path, trickle_s: float = 0.0):
    """A peer's answers with `directory`'s files; with `trickle_s`, the file bytes come one per
    `trickle_s` and stop after 40 (the connection then closes short of the size announced)."""
    files = {f: (directory / f).read_bytes() for f in FILES}

    def trickle(data: bytes):
        for byte in data[:40]:
            time.sleep(trickle_s)
            yield bytes([byte])

    def respond(request: Request) -> Response:
        if request.path.endswith("/files"):
            listing = [{"name": f, "bytes": len(b)} for f, b in files.items()]
            return Response(json.dumps({"files": listing}), content_type="application/json")
        data = files[request.path.rsplit("/", 1)[1]]
        return Response(trickle(data) if trickle_s else data)

    return respond


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_model_dir) -> Path:
    from toppings.scripts.make_adapters import make_random_adapter

    root = tmp_path_factory.mktemp("peer_src")
    return make_random_adapter(root / "a8", tiny_model_dir, rank=8, seed=1)


@pytest.fixture(scope="module")
def engine(tiny_engine):
    with tiny_engine(max_total_tokens=512) as eng:
        yield eng


@pytest.fixture
def peers(adapter):
    """A good peer, a peer trickling its bytes, a peer redirecting to a fourth server."""
    target = Peer(serving(adapter))
    made = {
        "good": Peer(serving(adapter)),
        "trickle": Peer(serving(adapter, trickle_s=0.15)),
        "target": target,
        "redirect": Peer(lambda r: Response("", 302, {"Location": target.url + r.path})),
        "unlisted": Peer(serving(adapter)),
    }
    yield made
    for peer in made.values():
        peer.close()


def client_for(engine, store: Path, peers: dict, timeout_s: float = 1.0, admin: str | None = None):
    listed = tuple(peers[n].url for n in ("good", "trickle", "redirect"))
    options = ApiOptions(api_key=KEY, adapter_store=str(store), peers=listed,
                         peer_fetch_timeout_s=timeout_s, admin_api_key=admin)  # fmt: skip
    return create_app(engine, options).test_client()


def fetch(client, name: str, digest: str, *urls: str):
    body = {"lora_name": name, "sha256": digest, "peers": list(urls)}
    return client.post("/v1/load_lora_adapter", json=body, headers=AUTH)


def partials(store: Path) -> list[str]:
    return [p.name for p in store.iterdir() if p.name.startswith(".partial-")]


def test_an_unlisted_peer_gets_400_naming_the_flag_and_is_never_contacted(
    engine, adapter, peers, tmp_path
):
    client = client_for(engine, tmp_path / "store", peers)
    answer = fetch(client, "x1", adapter_digest(adapter), peers["good"].url, peers["unlisted"].url)
    assert answer.status_code == 400, answer.get_data(as_text=True)
    assert "--peer" in answer.get_json()["error"]["message"]
    assert peers["unlisted"].seen == [] and peers["good"].seen == []


def test_a_listed_peer_is_sent_the_key_and_serves_the_adapter(engine, adapter, peers, tmp_path):
    client = client_for(engine, tmp_path / "store", peers)
    # Another spelling of the same server (upper case, trailing slash) is the same peer.
    spelled = peers["good"].url.replace("http", "HTTP") + "/"
    answer = fetch(client, "x2", adapter_digest(adapter), spelled)
    assert answer.status_code == 200, answer.get_data(as_text=True)
    assert {r.headers.get("Authorization") for r in peers["good"].seen} == {f"Bearer {KEY}"}
    unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "x2"}, headers=AUTH)
    assert unloaded.status_code == 200


def test_a_server_with_an_admin_key_sends_it_to_its_peers(engine, adapter, peers, tmp_path):
    """A peer's files want its admin key (a fleet's servers share it), not the client key."""
    client = client_for(engine, tmp_path / "store", peers, admin="admin-key")
    peers["good"].seen.clear()
    body = {"lora_name": "x9", "sha256": adapter_digest(adapter), "peers": [peers["good"].url]}
    answer = client.post("/v1/load_lora_adapter", json=body, headers={
        "Authorization": "Bearer admin-key"})  # fmt: skip
    assert answer.status_code == 200, answer.get_data(as_text=True)
    assert {r.headers.get("Authorization") for r in peers["good"].seen} == {"Bearer admin-key"}


def test_a_redirect_fails_the_peer_and_its_target_is_never_contacted(
    engine, adapter, peers, tmp_path
):
    client = client_for(engine, tmp_path / "store", peers)
    answer = fetch(client, "x3", adapter_digest(adapter), peers["redirect"].url)
    assert answer.status_code == 424, answer.get_data(as_text=True)
    assert "redirect" in answer.get_json()["error"]["message"]
    assert peers["redirect"].seen and peers["target"].seen == []


def test_a_trickling_peer_fails_at_the_deadline_and_the_next_fetch_proceeds(
    engine, adapter, peers, tmp_path
):
    store = tmp_path / "store"
    client = client_for(engine, store, peers, timeout_s=1.0)
    digest = adapter_digest(adapter)
    answer = fetch(client, "x4", digest, peers["trickle"].url, peers["good"].url)
    assert answer.status_code == 504, answer.get_data(as_text=True)
    assert "--peer-fetch-timeout-s" in answer.get_json()["error"]["message"]
    assert partials(store) == []
    assert peers["good"].seen == []  # the deadline covers the whole load, every peer
    # The fetch lock was released: the next load goes ahead.
    answer = fetch(client, "x4", digest, peers["good"].url)
    assert answer.status_code == 200, answer.get_data(as_text=True)
    unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "x4"}, headers=AUTH)
    assert unloaded.status_code == 200


def test_partial_directories_are_removed_at_start_and_at_close(engine, tmp_path):
    store = tmp_path / "store"
    (store / ".partial-left-by-a-kill").mkdir(parents=True)
    (store / ".partial-left-by-a-kill" / FILES[1]).write_bytes(b"half")
    (store / "kept-0123456789abcdef").mkdir()
    fetcher = PeerFetcher(engine, FetchConfig(str(store)))
    assert partials(store) == [] and (store / "kept-0123456789abcdef").is_dir()
    (store / ".partial-of-a-fetch-cut-by-the-stop").mkdir()
    fetcher.close()
    assert partials(store) == [] and (store / "kept-0123456789abcdef").is_dir()


def test_partial_directories_are_removed_when_the_process_exits(tmp_path):
    store = tmp_path / "store"
    script = (
        "import os, sys\n"
        "from toppings.server.api.admin.peer_fetch import FetchConfig, PeerFetcher\n"
        "PeerFetcher(None, FetchConfig(sys.argv[1]))\n"
        "os.mkdir(os.path.join(sys.argv[1], '.partial-cut-by-the-exit'))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(store)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert store.is_dir() and partials(store) == []


def test_a_slow_peer_does_not_hold_up_the_fetch_of_another_adapter(
    engine, adapter, peers, tmp_path
):
    # Issue 48: fetches were serialised, so one trickling peer delayed every load of the server
    # up to the deadline. Here a peer holds its file bytes until the test lets go; meanwhile a
    # load of another adapter from the good peer completes.
    files = {f: (adapter / f).read_bytes() for f in FILES}
    gate = threading.Event()

    def held(request: Request) -> Response:
        if request.path.endswith("/files"):
            listing = [{"name": f, "bytes": len(b)} for f, b in files.items()]
            return Response(json.dumps({"files": listing}), content_type="application/json")
        data = files[request.path.rsplit("/", 1)[1]]

        def body():
            yield data[:1]
            gate.wait(60)
            yield data[1:]

        return Response(body())

    slow = Peer(held)
    try:
        listed = (peers["good"].url, slow.url)
        options = ApiOptions(api_key=KEY, adapter_store=str(tmp_path / "store"), peers=listed,
                             peer_fetch_timeout_s=120.0)  # fmt: skip
        client = create_app(engine, options).test_client()
        digest = adapter_digest(adapter)
        answers = {}
        loading = threading.Thread(
            target=lambda: answers.update(slow=fetch(client, "held", digest, slow.url))
        )
        loading.start()
        deadline = time.monotonic() + 60
        while not any("/files/" in r.path for r in slow.seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any("/files/" in r.path for r in slow.seen)  # the slow fetch is under way
        answer = fetch(client, "other", digest, peers["good"].url)
        assert answer.status_code == 200, answer.get_data(as_text=True)
        assert loading.is_alive()  # finished while the slow peer still held its bytes
        gate.set()
        loading.join(60)
        assert answers["slow"].status_code == 200, answers["slow"].get_data(as_text=True)
        for name in ("held", "other"):
            unload = client.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=AUTH)
            assert unload.status_code == 200
    finally:
        gate.set()
        slow.close()
