"""`toppings-demo` on a fresh HOME serves the shipped adapters and answers (no training), and the
clients people point at it work through its scheduler: the `openai` client and LangChain's
`ChatOpenAI` (langchain-openai, an agent framework's OpenAI client class) each run a chat, a
streamed chat and a JSON-schema request without a 400, with the fields they send."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from toppings.scripts.demo import SHIPPED, STYLES
from toppings.scripts.train_demo_adapters import is_trained

CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def demo(tmp_path_factory, free_port, smollm2_dir) -> Iterator[tuple[str, list[str]]]:
    """The demo running on a fresh HOME: (the scheduler's URL, the lines it printed)."""
    assert all(is_trained(SHIPPED / s) for s in STYLES), "the demo adapters are not shipped"
    home = tmp_path_factory.mktemp("home")
    # A fresh HOME; the model cache is shared with the other SmolLM2 tests (converted once).
    cache = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    env = dict(os.environ, HOME=str(home), XDG_CACHE_HOME=cache)
    exe = os.path.join(os.path.dirname(sys.executable), "toppings-demo")
    port = free_port()
    cmd = [exe, "--port", str(port), "--server-port", str(free_port())]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        yield f"http://127.0.0.1:{port}", lines
    finally:
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, "".join(lines) + rest


@pytest.mark.slow
def test_demo_answers_on_a_fresh_home(demo):
    _, lines = demo
    answers = [ln for ln in lines if any(ln.strip().startswith(f"{m}:") for m in STYLES)]
    assert len(answers) == 3, "".join(lines)
    assert all(len(a.split(":", 1)[1].strip()) > 2 for a in answers), "".join(lines)
    assert not any("Training the demo adapters" in ln for ln in lines)


@pytest.mark.slow
def test_the_openai_client_chats_streams_and_follows_a_schema(demo):
    import openai

    url, _ = demo
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    # What agent frameworks send beside the messages: accepted, and named in a header.
    extra = {"metadata": {"run": "t1"}, "user": "u-1", "parallel_tool_calls": False,
             "store": False, "service_tier": "auto"}  # fmt: skip
    raw = client.chat.completions.with_raw_response.create(
        model="terse", max_tokens=16, temperature=0,
        messages=[{"role": "user", "content": "Name a fruit."}], extra_body=extra | {"min_p": 0.1},
    )  # fmt: skip
    assert raw.parse().choices[0].message.content
    named = raw.headers["x-toppings-ignored-fields"].split(", ")
    assert named == ["metadata", "service_tier", "store", "user", "parallel_tool_calls"]
    text = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model="french", max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "Hi!"}],
        )
        if chunk.choices
    )  # fmt: skip
    assert text
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": "Which city is the capital of Italy?"}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}},
    )  # fmt: skip
    assert set(json.loads(reply.choices[0].message.content)) == {"city"}


@pytest.mark.slow
def test_langchain_chat_openai_chats_streams_and_follows_a_schema(demo):
    langchain_openai = pytest.importorskip(
        "langchain_openai", reason="langchain-openai is not installed (not in the test extras)"
    )
    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=20)

    url, _ = demo
    llm = langchain_openai.ChatOpenAI(base_url=url + "/v1", api_key="none", model="terse",
                                      temperature=0, max_tokens=24, max_retries=0)  # fmt: skip
    assert llm.invoke("Name a fruit.").content
    assert "".join(str(chunk.content) for chunk in llm.stream("Name a colour."))
    base = llm.model_copy(update={"model_name": "SmolLM2-135M-Instruct", "max_tokens": 40})
    structured = base.with_structured_output(City, method="json_schema")
    assert isinstance(structured.invoke("Which city is the capital of Italy?"), City)
