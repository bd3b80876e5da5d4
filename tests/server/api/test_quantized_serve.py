"""`toppings-serve --quantization int8` end to end: the process starts, says which base weights
it quantized, and serves base and adapter requests with the tokens of an in-process engine of
the same configuration (whose exactness tests/server/model/test_quant_exactness.py checks)."""

from __future__ import annotations

import subprocess
import sys

import requests

from tests.helpers import running_engine, wait_healthy
from toppings.server.requests.request import GenerationRequest, SamplingParams


def test_serve_int8_end_to_end(tmp_path, tiny_model_dir, free_port):
    from toppings.scripts.make_adapters import make_random_adapter

    adapter = make_random_adapter(tmp_path / "q8", tiny_model_dir, rank=8, seed=3)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "toppings.server.cli", "--model", str(tiny_model_dir), "--port",
           str(port), "--lora", f"q8={adapter}", "--quantization", "int8", "--dtype", "float32",
           "--max-total-tokens", "1024"]  # fmt: skip
    prompt = [5, 17, 33, 9, 41, 2, 60]
    got = {}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, proc, log)
            for name in ("q8", None):
                body = {"adapter": name, "input_ids": prompt, "max_new_tokens": 12,
                        "temperature": 0.0, "ignore_eos": True}  # fmt: skip
                reply = requests.post(url + "/generate", json=body, timeout=120)
                assert reply.status_code == 200, reply.text
                got[name] = reply.json()["token_ids"]
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    assert "base weights int8" in log.read_text()
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    with running_engine(tiny_model_dir, {"q8": str(adapter)}, quantization="int8") as engine:
        for name in ("q8", None):
            ref = engine.resolve_adapter(name)
            want = engine.submit(GenerationRequest(prompt, params, ref)).result(timeout_s=120)
            assert got[name] == want.new_token_ids, name
    assert got["q8"] != got[None], "the adapter changed nothing"
