"""Fixtures of the API tests that drive a served app with the `openai` client."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import openai


def _openai_client(base_url: str, timeout_s: float) -> openai.OpenAI:
    """An `openai` client of base_url's /v1 that never retries: a failed request fails the test
    at once instead of being sent again."""
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=timeout_s)


@pytest.fixture(scope="session")
def openai_client() -> Callable[[str, float], openai.OpenAI]:
    """`openai_client(base_url, timeout_s)`: an `openai` client of that server, no retries."""
    return _openai_client
