"""`toppings-serve --model smollm2` answers a chat through the openai client, as a user runs it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import openai
import pytest
import requests

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_url(smollm2_dir, free_port):  # smollm2_dir: converted once before the server starts
    port = free_port()
    # float32: a 135M model's greedy answer in bfloat16 depends on the CPU's GEMM (on an Intel
    # Xeon with AMX it answered "L'Etoile, la Marseillaise..." where an AMD EPYC said Paris).
    proc = subprocess.Popen(
        [sys.executable, "-m", "toppings.server.cli", "--model", "smollm2", "--port", str(port),
         "--dtype", "float32"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if requests.get(f"{url}/health", timeout=1).ok:
                    break
            except requests.ConnectionError:
                time.sleep(0.5)
        else:
            pytest.fail("toppings-serve did not become healthy in 180 s")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def ask(client, stream: bool) -> str:
    kwargs = dict(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_answers_sensibly(smollm2_url, stream):
    client = openai.OpenAI(base_url=f"{smollm2_url}/v1", api_key="unused")
    assert "Paris" in ask(client, stream)


def test_models_lists_the_base_model(smollm2_url):
    client = openai.OpenAI(base_url=f"{smollm2_url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
