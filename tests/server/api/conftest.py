"""Fixtures of the API tests: a served app driven with the `openai` client, and a Flask test
client of the API on the tiny engine for the checks of client JSON every route shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import openai


# Every route that reads a client's JSON body (server.requests.errors.parse_json_object).
JSON_ROUTES = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/generate",
    "/tokenize",
    "/detokenize",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
]


@pytest.fixture(scope="module")
def api_client(tiny_engine, tmp_path_factory):
    """A Flask test client of the API on the tiny engine (1,024 tokens of KV), an empty
    directory its one allowed adapter root."""
    from toppings.server.api.app import ApiOptions, create_app

    root = tmp_path_factory.mktemp("roots")
    with tiny_engine({}, max_total_tokens=1024) as engine:
        yield create_app(engine, ApiOptions(lora_roots=(str(root),))).test_client()


@pytest.fixture(scope="module")
def tiny_app(tiny_engine):
    """`(client, tokenizer)`: a Flask test client of the API on the tiny engine (1,024 tokens of
    KV) and the engine's tokenizer."""
    from toppings.server.api.app import create_app

    with tiny_engine({}, max_total_tokens=1024) as engine:
        yield create_app(engine).test_client(), engine.tokenizer


def _openai_client(base_url: str, timeout_s: float) -> openai.OpenAI:
    """An `openai` client of base_url's /v1 that never retries: a failed request fails the test
    at once instead of being sent again."""
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=timeout_s)


@pytest.fixture(scope="session")
def openai_client() -> Callable[[str, float], openai.OpenAI]:
    """`openai_client(base_url, timeout_s)`: an `openai` client of that server, no retries."""
    return _openai_client
