"""A real waitress server on a loopback port, driven by the `openai` client, `requests`, and the
`toppings-serve` command itself."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import requests

from tests.helpers import spy_on_submissions
from toppings.server.api.app import create_app
from toppings.server.requests.request import RequestOutput

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_model_dir, tiny_engine):
    from toppings.scripts.make_adapters import make_random_adapter

    root = tmp_path_factory.mktemp("client_adapters")
    loras = {
        "sql": str(
            make_random_adapter(
                root / "sql", tiny_model_dir, rank=8, target_modules=("q_proj", "v_proj"), seed=3
            )
        )
    }
    with tiny_engine(loras, max_total_tokens=4096) as eng:
        yield eng


@pytest.fixture(scope="module")
def base_url(engine, serve_app):
    with serve_app(create_app(engine), channel_request_lookahead=1) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url, openai_client):
    return openai_client(base_url, 60)


def test_models(client, engine):
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {engine.model_name, "sql"}
    assert models["sql"].model_extra["parent"] == engine.model_name


@pytest.mark.parametrize("model", ["sql", None])
def test_completions_stream_and_not(client, engine, model):
    model = model or engine.model_name
    kwargs = dict(
        model=model, prompt="The cat", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**kwargs)
    assert full.model == model and full.usage.completion_tokens == 8
    assert full.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_stream_and_not(client):
    kwargs = dict(
        model="sql",
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 6
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_client_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match=r"'n' must be in \[1, 16\]"):
        client.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "x"}], n=17
        )
    assert (
        client.completions.create(model="sql", prompt="x", max_tokens=1).usage.completion_tokens
        == 1
    )


def _final_outputs(engine, monkeypatch) -> list[RequestOutput]:
    """Spy on engine.submit: the list fills with each request's final output as it is sent."""
    finals: list[RequestOutput] = []

    def spy(req, handle):
        put = handle.put

        def put_and_record(out: RequestOutput) -> None:
            put(out)
            if out.finish_reason is not None:
                finals.append(out)

        handle.put = put_and_record

    spy_on_submissions(engine, monkeypatch, spy)
    return finals


def test_hanging_up_on_a_plain_request_aborts(base_url, engine, monkeypatch):
    finals = _final_outputs(engine, monkeypatch)
    max_new = engine.max_model_len - 3
    body = json.dumps({"input_ids": [1, 2, 3], "max_new_tokens": max_new, "ignore_eos": True})
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        head = f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body.encode())
        deadline = time.monotonic() + 60
        while (
            not engine.stats().to_json()["running"] and not finals
        ):  # hang up once it is generating
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    _wait_for(finals)
    assert finals[0].finish_reason == "abort" and finals[0].output_tokens < max_new


def test_hanging_up_mid_stream_aborts(base_url, engine, monkeypatch):
    finals = _final_outputs(engine, monkeypatch)
    max_new = engine.max_model_len - 3
    body = {"input_ids": [1, 2, 3], "max_new_tokens": max_new, "stream": True, "ignore_eos": True}
    with requests.post(f"{base_url}/generate", json=body, stream=True, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: {")
    # The connection is closed now; waitress notices and closes the response iterator.
    _wait_for(finals)
    assert finals[0].finish_reason == "abort" and finals[0].output_tokens < max_new
    ok = requests.post(
        f"{base_url}/generate", json={"prompt": "hi", "max_new_tokens": 2}, timeout=60
    )
    assert ok.status_code == 200


def _wait_for(finals: list) -> None:
    deadline = time.monotonic() + 60
    while not finals:
        assert time.monotonic() < deadline, "the request never ended"
        time.sleep(0.05)


def test_toppings_serve_command(tiny_model_dir, free_port):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "toppings.server.cli",
        "--model",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--max-total-tokens",
        "1024",
        "--cpu-workers",
        "2",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        log = []
        for line in proc.stderr:  # the command logs the URL to use once it serves
            log.append(line)
            if "serving" in line:
                break
        url = re.search(r"at (http://\S+)", "".join(log)).group(1)
        assert url == f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:  # waitress may take a moment after the log line to accept
            try:
                assert requests.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        body = {"prompt": "hi", "max_new_tokens": 3, "ignore_eos": True}
        assert len(json.loads(requests.post(f"{url}/generate", json=body).text)["token_ids"]) == 3
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    assert "shutting down the engine" in rest
