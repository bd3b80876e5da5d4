"""Operator endpoints through Flask's test client: adapter load/unload and its path confinement,
API keys, request limits, /stats and /metrics; every bad input gets a 4xx and the server keeps
serving."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import running_engine
from toppings.server.api.admin.lifecycle import AdapterPaths, discover
from toppings.server.api.app import ApiOptions, create_app
from toppings.server.requests.request import GenerationRequest, RequestError, SamplingParams

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_PROMPT, MAX_NEW = 64, 400


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_model_dir):
    """An allowed root with good and bad adapter directories, and things outside it."""
    from toppings.scripts.make_adapters import make_random_adapter
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    tmp = tmp_path_factory.mktemp("lifecycle")
    root, outside = tmp / "loras", tmp / "outside"
    make_random_adapter(root / "r8", tiny_model_dir, rank=8, target_modules=("q_proj",), seed=1)
    make_random_adapter(root / "r16", tiny_model_dir, rank=16, seed=2)
    make_random_adapter(outside / "evil", tiny_model_dir, rank=4, seed=3)
    (root / "not_peft").mkdir()
    (root / "not_peft" / "README").write_text("no adapter here")
    pickle_only = root / "pickle_only"
    shutil.copytree(root / "r8", pickle_only)
    (pickle_only / "adapter_model.safetensors").rename(pickle_only / "adapter_model.bin")
    other_base = make_tiny_llama(tmp / "other_base", hidden_size=32, num_heads=2, num_kv_heads=1)
    make_random_adapter(root / "other_base", other_base, rank=8, seed=4)
    os.symlink(outside / "evil", root / "link_out")  # a directory symlink leaving the root
    linked_file = root / "file_link"
    shutil.copytree(root / "r8", linked_file)
    (linked_file / "adapter_model.safetensors").unlink()
    weights = "adapter_model.safetensors"
    os.symlink(outside / "evil" / weights, linked_file / weights)
    return {"root": root, "outside": outside, "base": tiny_model_dir}


@pytest.fixture(scope="module")
def engine(dirs):
    loras = {"r8": str(dirs["root"] / "r8")}
    # cached: registered adapters are pinned and resident (the metrics test counts the pins)
    with running_engine(dirs["base"], loras, max_total_tokens=2048, lora_mode="cached") as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine, dirs):
    options = ApiOptions(api_key=KEY, max_prompt_tokens=MAX_PROMPT,
                         max_new_tokens_limit=MAX_NEW, lora_roots=(str(dirs["root"]),))  # fmt: skip
    return create_app(engine, options).test_client()


def post(client, path: str, body, headers=AUTH):
    kwargs = {"json": body} if isinstance(body, dict) else {"data": body}
    return client.post(path, headers=headers, **kwargs)


def assert_serving(client) -> None:
    assert client.get("/health").status_code == 200
    ok = post(client, "/generate", {"adapter": "r8", "prompt": "hi", "max_new_tokens": 2})
    assert ok.status_code == 200 and len(ok.get_json()["token_ids"]) <= 2


def load(name: str, path) -> dict:
    return {"lora_name": name, "lora_path": str(path)}


BAD = [
    # (id, path, body (dict, bytes, or callable(dirs) -> dict), status)
    ("malformed", "/v1/load_lora_adapter", b"{nope", 400),
    ("not an object", "/v1/load_lora_adapter", b'["a", "b"]', 400),
    ("oversized", "/v1/completions", b"x" * (17 << 20), 413),
    (
        "name not str",
        "/v1/load_lora_adapter",
        lambda d: load("r", d["root"] / "r16") | {"lora_name": 5},
        400,
    ),  # noqa: E501
    ("path not str", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": ["/"]}, 400),
    ("bad name", "/v1/load_lora_adapter", lambda d: load("a b", d["root"] / "r16"), 400),
    (
        "extra field",
        "/v1/load_lora_adapter",
        lambda d: load("x", d["root"] / "r16") | {"y": 1},
        400,
    ),  # noqa: E501
    ("unload not str", "/v1/unload_lora_adapter", {"lora_name": None}, 400),
    ("unload unknown", "/v1/unload_lora_adapter", {"lora_name": "ghost"}, 404),
    ("unknown adapter", "/v1/completions", {"model": "ghost", "prompt": "hi"}, 404),
    ("prompt too long", "/generate", {"input_ids": [5] * (MAX_PROMPT + 1)}, 400),
    ("max_tokens over limit", "/v1/completions", {"prompt": "hi", "max_tokens": MAX_NEW + 1}, 400),
    ("dotdot relative", "/v1/load_lora_adapter", load("x", "../outside/evil"), 400),
    (
        "dotdot absolute",
        "/v1/load_lora_adapter",
        lambda d: load("x", f"{d['root']}/../outside/evil"),
        400,
    ),  # noqa: E501
    ("outside root", "/v1/load_lora_adapter", lambda d: load("x", d["outside"] / "evil"), 403),
    ("base model dir", "/v1/load_lora_adapter", lambda d: load("x", d["base"]), 403),
    ("symlinked dir escapes", "/v1/load_lora_adapter", load("x", "link_out"), 403),
    (
        "symlinked file escapes",
        "/v1/load_lora_adapter",
        lambda d: load("x", d["root"] / "file_link"),
        403,
    ),  # noqa: E501
    ("missing dir", "/v1/load_lora_adapter", load("x", "no_such_dir"), 404),
    ("not PEFT", "/v1/load_lora_adapter", lambda d: load("x", d["root"] / "not_peft"), 400),
    ("pickle only", "/v1/load_lora_adapter", lambda d: load("x", d["root"] / "pickle_only"), 400),
    ("other base model", "/v1/load_lora_adapter", load("x", "other_base"), 400),
    ("name taken", "/v1/load_lora_adapter", lambda d: load("r8", d["root"] / "r16"), 409),
    ("base model name", "/v1/load_lora_adapter", lambda d: load(d["base"].name, "r16"), 409),
]


@pytest.mark.parametrize("path, body, status", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_gets_4xx_and_the_server_keeps_serving(client, engine, dirs, path, body, status):
    names = {a["name"] for a in engine.adapters()}
    response = post(client, path, body(dirs) if callable(body) else body)
    assert response.status_code == status, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    assert {a["name"] for a in engine.adapters()} == names  # nothing was registered or dropped
    assert_serving(client)


def test_error_messages_name_the_cause(client, dirs):
    pickle = post(client, "/v1/load_lora_adapter", load("x", dirs["root"] / "pickle_only"))
    assert "safetensors" in pickle.get_json()["error"]["message"]
    other = post(client, "/v1/load_lora_adapter", load("x", "other_base"))
    assert "shape" in other.get_json()["error"]["message"]


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Bearer é"}],
    ids=str,
)
def test_api_key_is_checked_everywhere_but_health(client, headers):
    for method, path in [("GET", "/stats"), ("GET", "/metrics"), ("GET", "/v1/models"),
                         ("POST", "/v1/completions"), ("POST", "/v1/load_lora_adapter"),
                         ("GET", "/no/such/route")]:  # fmt: skip
        response = client.open(path, method=method, headers=headers, json={"prompt": "x"})
        assert response.status_code == 401, path
        assert response.get_json()["error"]["type"] == "authentication_error"
    assert client.get("/health").status_code == 200
    assert_serving(client)


def test_runtime_loading_needs_an_allowed_root(engine, dirs):
    closed = create_app(engine).test_client()  # no roots, no key
    response = closed.post("/v1/load_lora_adapter", json=load("x", dirs["root"] / "r16"))
    assert response.status_code == 403 and "disabled" in response.get_json()["error"]["message"]


def test_a_default_max_tokens_is_cut_to_the_limit(engine, dirs):
    options = ApiOptions(max_new_tokens_limit=3)
    tight = create_app(engine, options).test_client()
    body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}  # default 256
    got = tight.post("/v1/chat/completions", json=body).get_json()
    assert got["usage"]["completion_tokens"] == 3


def greedy(engine, ids: list[int], max_new: int, adapter: str) -> list[int]:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    return (
        engine.submit(GenerationRequest(ids, params, engine.resolve_adapter(adapter)))
        .result(60)
        .new_token_ids
    )


def test_load_use_unload_then_404(client, engine):
    got = post(client, "/v1/load_lora_adapter", load("fresh", "r16"))
    assert got.status_code == 200 and got.get_json()["rank"] == 16
    models = client.get("/v1/models", headers=AUTH).get_json()["data"]
    assert "fresh" in {m["id"] for m in models}
    body = {"model": "fresh", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    used = post(client, "/v1/completions", body).get_json()
    text = engine.tokenizer.decode(greedy(engine, [5, 6, 7], 4, "fresh"))
    assert used["choices"][0]["text"] == text
    assert post(client, "/v1/unload_lora_adapter", {"lora_name": "fresh"}).status_code == 200
    assert post(client, "/v1/completions", body).status_code == 404
    assert post(client, "/v1/unload_lora_adapter", {"lora_name": "fresh"}).status_code == 404
    assert_serving(client)


@pytest.fixture
def slow_steps(engine, monkeypatch):
    """Each engine step takes at least 5 ms, so that a request of MAX_NEW tokens stays in flight
    for seconds while a test looks at it (the tiny model alone finishes it in a blink)."""
    forward = engine.model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.005)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", slow_forward)


def test_unload_while_in_use_is_refused_and_the_request_completes(client, engine, slow_steps):
    assert post(client, "/v1/load_lora_adapter", load("busy", "r16")).status_code == 200
    ids, max_new = [3, 1, 4, 1, 5], MAX_NEW
    body = {"adapter": "busy", "input_ids": ids, "max_new_tokens": max_new, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    stream = client.post("/generate", json=body, headers=AUTH, buffered=False)
    chunks = iter(stream.response)
    first = next(chunks)  # the request is prefilled and holds the adapter
    refused = post(client, "/v1/unload_lora_adapter", {"lora_name": "busy"})
    assert refused.status_code == 409 and "in use" in refused.get_json()["error"]["message"]
    events = [json.loads(f[6:]) for f in (first + b"".join(chunks)).decode().split("\n\n")
              if f.startswith("data: {")]  # fmt: skip
    assert events[-1]["finish_reason"] == "length"
    assert [t for e in events[:-1] for t in e["token_ids"]] + events[-1]["token_ids"] == greedy(
        engine, ids, max_new, "busy"
    )
    assert post(client, "/v1/unload_lora_adapter", {"lora_name": "busy"}).status_code == 200
    assert_serving(client)


def metric_values(client) -> dict[tuple[str, tuple], float]:
    text = client.get("/metrics", headers=AUTH).get_data(as_text=True)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_parse_and_move(client, engine):
    before = metric_values(client)
    for adapter in (None, "r8", "r8"):
        body = {"adapter": adapter, "prompt": "abc", "max_new_tokens": 5, "ignore_eos": True}
        assert post(client, "/generate", body).status_code == 200
    after = metric_values(client)

    def moved(name: str, labels: tuple = ()) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert moved("toppings:request_success_total", (("finished_reason", "length"),)) == 3
    assert moved("toppings:time_to_first_token_seconds_count") == 3
    assert moved("toppings:time_per_output_token_seconds_count") == 3
    assert moved("toppings:e2e_request_latency_seconds_count") == 3
    assert moved("toppings:generation_tokens_total") == 15
    assert moved("toppings:http_requests_total", (("endpoint", "generate"), ("status", "200"))) == 3
    assert moved("toppings:adapter_cache_hits_total") == 2  # r8 is pinned in cached mode
    assert moved("toppings:decode_steps_total") >= 4
    assert after[("toppings:num_requests_running", ())] == 0
    assert not any(name.endswith("_created") for name, _ in after)
    assert after[("toppings:kv_cache_reserved_tokens", ())] == 0
    assert after[("toppings:adapter_references", ())] == len(engine.adapters())  # the pins
    assert after[("toppings:adapters_resident", ())] == len(engine.adapters())
    if engine.governor is not None:  # cpu: the threads the steps run on
        assert after[("toppings:engine_threads", ())] == engine.governor.threads
    if engine.step_budget is not None:  # chunked prefill: the budget the steps are sized by
        assert after[("toppings:step_budget_tokens", ())] == engine.step_budget.tokens


def test_stats_lists_ranks_of_a_mixed_batch(client, engine, slow_steps):
    if "r16-too" not in {a["name"] for a in engine.adapters()}:
        # Loaded before the streams start, so that none of them ends while it loads.
        assert post(client, "/v1/load_lora_adapter", load("r16-too", "r16")).status_code == 200
    streams = []
    for adapter in ("r8", None, "r16-too", "r8"):
        body = {"adapter": adapter, "input_ids": [7, 8], "max_new_tokens": MAX_NEW,
                "ignore_eos": True, "stream": True}  # fmt: skip
        response = client.post("/generate", json=body, headers=AUTH, buffered=False)
        chunks = iter(response.response)
        next(chunks)  # prefilled: in the running batch now
        streams.append((response, chunks))
    stats = client.get("/stats", headers=AUTH).get_json()
    ranks = sorted((r["adapter"] or "", r["rank"]) for r in stats["running"])
    assert ranks == [("", 0), ("r16-too", 16), ("r8", 8), ("r8", 8)]
    bt = stats["memory"]["block_tokens"]  # KV is reserved in whole blocks
    assert stats["free_kv_tokens"] == 2048 - 4 * -(-(2 + MAX_NEW) // bt) * bt
    assert set(stats["resident_adapters"]) == {"r8", "r16-too"} and stats["loading_adapters"] == []
    for response, _ in streams:
        response.close()  # aborts each request
    assert_idle(engine)
    assert post(client, "/v1/unload_lora_adapter", {"lora_name": "r16-too"}).status_code == 200


def assert_idle(engine, timeout_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while engine.stats().running or engine.stats().queue:
        assert time.monotonic() < deadline, engine.stats().to_json()
        time.sleep(0.05)
    assert (
        engine.stats().to_json()["free_kv_tokens"] == engine.stats().to_json()["max_total_tokens"]
    )


def test_adapter_paths_unit(tmp_path):
    (tmp_path / "root" / "a").mkdir(parents=True)
    paths = AdapterPaths([tmp_path / "root"])
    with pytest.raises(RequestError, match="outside"):
        paths.resolve(str(tmp_path))  # the root's parent
    with pytest.raises(RequestError) as err:
        paths.resolve("a/../../root/a")
    assert err.value.code == 400
    # A sibling whose name only starts like the root is not inside it.
    (tmp_path / "root2" / "a").mkdir(parents=True)
    with pytest.raises(RequestError, match="outside"):
        paths.resolve(str(tmp_path / "root2" / "a"))


def test_discover_finds_peft_dirs_inside_the_root_only(dirs):
    found = discover(dirs["root"])
    assert set(found) == {"r8", "r16", "pickle_only", "other_base"}
