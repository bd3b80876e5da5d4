"""`--lora-resolver dir:PATH` through HTTP on the tiny Llama: a first use gives PEFT's tokens,
concurrent first requests make one load, names outside the directory are refused, the bound on
resolved adapters holds over 200 names, a directory removed later is a clean 404, an evicted
adapter comes back from host memory unread and gives the same tokens, and a resolution's read
does not wait for the adapter thread."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import running_engine
from tests.server.engine.test_exactness import NEW_TOKENS, assert_same_greedy, reference_greedy
from toppings.server.api.admin.lifecycle import AdapterAdmin, AdapterPaths, AdapterThread
from toppings.server.api.app import ApiOptions, create_app
from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.resolver.metrics import ResolverMetrics
from toppings.server.resolver.resolved import ResolvedAdapters
from toppings.server.resolver.sources import DirSource

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_model_dir):
    """The resolver's directory (r16, q8) and an adapter outside it, linked from inside."""
    from toppings.scripts.make_adapters import make_random_adapter

    tmp = tmp_path_factory.mktemp("resolver")
    root, outside = tmp / "loras", tmp / "outside"
    make_random_adapter(root / "r16", tiny_model_dir, rank=16, seed=5)
    make_random_adapter(root / "q8", tiny_model_dir, rank=8, target_modules=("q_proj",), seed=6)
    make_random_adapter(outside / "evil", tiny_model_dir, rank=4, seed=7)
    os.symlink(outside / "evil", root / "link_out")
    return {"root": root, "outside": outside, "base": tiny_model_dir}


@pytest.fixture
def engine(dirs):
    """A fresh engine per test (resolved adapters stay registered in it), with one adapter the
    operator registered."""
    with running_engine(dirs["base"], {"ops": str(dirs["root"] / "q8")},
                        max_total_tokens=2048) as eng:  # fmt: skip
        yield eng


def app_for(engine, root, **options):
    return create_app(engine, ApiOptions(lora_resolver=f"dir:{root}", **options))


def generate(client, adapter, **body):
    body = {"adapter": adapter, "max_new_tokens": 1, **body}
    body.setdefault("input_ids", None) or body.setdefault("prompt", "hi")
    body = {k: v for k, v in body.items() if v is not None}
    return client.post("/generate", json=body)


def resolutions(client) -> dict[str, float]:
    text = client.get("/metrics").get_data(as_text=True)
    (family,) = [f for f in text_string_to_metric_families(text)
                 if f.name == "toppings:lora_resolutions"]  # fmt: skip
    return {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_total")}


def names_in(engine) -> set[str]:
    return {a["name"] for a in engine.adapters()}


def test_first_use_gives_the_tokens_of_peft(engine, dirs):
    client = app_for(engine, dirs["root"]).test_client()
    prompt = [5, 17, 42, 99, 3, 150, 77]
    resp = generate(client, "r16", input_ids=prompt, max_new_tokens=NEW_TOKENS, temperature=0,
                    ignore_eos=True)  # fmt: skip
    assert resp.status_code == 200, resp.get_json()
    ref, margins = reference_greedy(dirs["base"], {"r16": str(dirs["root"] / "r16")}, prompt,
                                    "r16")  # fmt: skip
    assert_same_greedy(resp.get_json()["token_ids"], ref, margins, "r16 resolved on first use")
    messages = [{"role": "user", "content": "hi"}]
    chat = client.post("/v1/chat/completions", json={"model": "q8", "messages": messages,
                                                      "max_tokens": 2})  # fmt: skip
    assert chat.status_code == 200 and chat.get_json()["model"] == "q8"
    assert resolutions(client)["loaded"] == 2 and names_in(engine) == {"ops", "r16", "q8"}


def test_stats_say_whether_names_are_found_on_first_use(engine, dirs):
    """/stats' `lora_resolver`: how a cluster scheduler knows it may route a name no server
    reported yet to this server (scheduler.router)."""
    from toppings.server.api.app import create_app as plain_app

    assert app_for(engine, dirs["root"]).test_client().get("/stats").get_json()["lora_resolver"]
    assert plain_app(engine).test_client().get("/stats").get_json()["lora_resolver"] is False


def test_concurrent_first_requests_make_one_load(engine, dirs, serve_app):
    app = app_for(engine, dirs["root"], max_concurrent_requests=64)
    start = threading.Barrier(32)
    statuses: list[int] = []

    def first_request(base_url: str) -> None:
        body = json.dumps({"model": "r16", "prompt": "hi", "max_tokens": 2}).encode()
        req = urllib.request.Request(f"{base_url}/v1/completions", body,
                                     {"Content-Type": "application/json"})  # fmt: skip
        start.wait()
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                statuses.append(resp.status)
        except urllib.error.HTTPError as exc:
            statuses.append(exc.code)

    with serve_app(app, threads=40) as base_url:
        threads = [threading.Thread(target=first_request, args=(base_url,)) for _ in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert statuses == [200] * 32
    client = app.test_client()
    assert resolutions(client) == {"loaded": 1, "not_found": 0, "refused": 0, "busy": 0,
                                   "failed": 0}  # fmt: skip
    assert names_in(engine) == {"ops", "r16"}


def test_names_outside_the_directory_are_refused(engine, dirs):
    client = app_for(engine, dirs["root"]).test_client()
    evil = str(dirs["outside"] / "evil")
    for name in ("..", "../outside/evil", evil, "/etc", "r16/..", "link_out"):
        for resp in (
            generate(client, name),
            client.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 1}),
        ):
            error = resp.get_json()["error"]
            expected = (403, "permission_denied") if name == "link_out" else (404, "not_found")
            assert (resp.status_code, error["type"], error["code"]) == (*expected, expected[0]), (
                name, error)  # fmt: skip
    assert names_in(engine) == {"ops"} and resolutions(client)["loaded"] == 0


def _copies(src, root, count: int) -> list[str]:
    """`count` adapters with the config of `src` and weights scaled apart (distinct digests)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(src / WEIGHTS)
    names = []
    for i in range(count):
        out = root / f"n{i:03d}"
        out.mkdir()
        shutil.copy(src / "adapter_config.json", out)
        save_file({k: v * (1 + (i + 1) / 256) for k, v in tensors.items()}, out / WEIGHTS)
        names.append(out.name)
    return names


def test_the_bound_on_resolved_adapters_holds_over_200_names(engine, dirs, tmp_path):
    names = _copies(dirs["root"] / "q8", tmp_path, 200)
    client = app_for(engine, tmp_path, lora_resolver_max_adapters=8).test_client()
    most = 0
    for name in [*names, *names[:20:3]]:  # then a few evicted long ago, loaded again
        resp = generate(client, name)
        assert resp.status_code == 200, (name, resp.get_json())
        resolved = names_in(engine) - {"ops"}
        assert name in resolved and len(resolved) <= 8, (name, sorted(resolved))
        most = max(most, len(resolved))
    assert most == 8 and "ops" in names_in(engine)  # the operator's adapter is never unloaded
    counts = resolutions(client)
    assert counts["loaded"] == 207 and counts["busy"] == 0
    assert generate(client, "ops").status_code == 200


def test_a_directory_removed_later_is_a_clean_404(engine, dirs, tmp_path):
    for name in ("gone", "other"):
        shutil.copytree(dirs["root"] / "q8", tmp_path / name)
    client = app_for(engine, tmp_path, lora_resolver_max_adapters=1).test_client()
    assert generate(client, "gone").status_code == 200
    shutil.rmtree(tmp_path / "gone")
    assert generate(client, "gone").status_code == 200  # loaded: it serves until evicted
    assert generate(client, "other").status_code == 200  # evicts "gone"
    resp = generate(client, "gone")
    assert resp.status_code == 404
    assert resp.get_json() == {"error": {"message": "adapter 'gone' does not exist",
                                         "type": "not_found", "code": 404}}  # fmt: skip
    assert generate(client, "other").status_code == 200
    assert resolutions(client) == {"loaded": 2, "not_found": 1, "refused": 0, "busy": 0,
                                   "failed": 0}  # fmt: skip


def counting_reads(engine, monkeypatch) -> list[str]:
    """The names the engine read from disk from now on (`open_adapter` returned), in order."""
    reads: list[str] = []
    open_adapter = engine.open_adapter

    def reading(name, path):
        adapter = open_adapter(name, path)
        reads.append(name)
        return adapter

    monkeypatch.setattr(engine, "open_adapter", reading)
    return reads


def test_an_evicted_adapter_comes_back_from_host_memory(engine, dirs, monkeypatch):
    reads = counting_reads(engine, monkeypatch)
    client = app_for(engine, dirs["root"], lora_resolver_max_adapters=1).test_client()
    body = {"input_ids": [5, 17, 42, 99, 3], "max_new_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    first = generate(client, "r16", **body)
    assert generate(client, "q8").status_code == 200  # evicts r16 (kept in host memory)
    again = generate(client, "r16", **body)  # evicts q8; r16 registered again, unread
    assert first.status_code == again.status_code == 200
    assert again.get_json()["token_ids"] == first.get_json()["token_ids"]
    assert reads == ["r16", "q8"] and names_in(engine) == {"ops", "r16"}
    text = client.get("/metrics").get_data(as_text=True)
    assert "toppings:lora_resolver_host_hits_total 1.0" in text
    assert resolutions(client)["loaded"] == 3


def test_a_read_does_not_wait_for_the_adapter_thread(engine, dirs, monkeypatch):
    """The adapter thread busy (another adapter's registration, say): a resolution reads its
    files meanwhile, and only its registration waits."""
    reads = counting_reads(engine, monkeypatch)
    thread = AdapterThread()
    registrar = AdapterAdmin(engine, AdapterPaths([dirs["root"]]), thread=thread)
    resolver = ResolvedAdapters(engine, DirSource(str(dirs["root"])), registrar,
                                ResolverMetrics(CollectorRegistry(), "toppings:"),
                                max_adapters=8, max_loading=2)  # fmt: skip
    busy = threading.Event()
    blocker = threading.Thread(target=thread.run, args=(busy.wait,))
    blocker.start()
    got: list = []

    def first_use():
        with resolver.lease() as resolve:
            got.append(resolve("r16"))

    user = threading.Thread(target=first_use)
    user.start()
    try:
        deadline = time.monotonic() + 60
        while not reads and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reads == ["r16"], "the read waited for the adapter thread"
        assert "r16" not in names_in(engine) and not got  # its registration waits
    finally:
        busy.set()
        user.join()
        blocker.join()
    assert isinstance(got[0], AdapterRef) and "r16" in names_in(engine)
