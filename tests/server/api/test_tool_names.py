"""A tool's name is 1-64 letters, digits, `_` or `-` and nothing else
(server/api/openai/tools.py): a name with a trailing newline passed a `^...$` pattern,
since `$` also matches before one."""

from __future__ import annotations

import pytest

from toppings.server.api.openai.tools import parse_tools
from toppings.server.requests.request import RequestError


def _tools(name: str) -> dict:
    return {"tools": [{"type": "function", "function": {"name": name}}]}


@pytest.mark.parametrize("name", ["f\n", "", "a b", "x" * 65, "é"])
def test_a_bad_tool_name_is_a_400(name):
    with pytest.raises(RequestError, match="1-64 letters") as error:
        parse_tools(_tools(name))
    assert error.value.code == 400


@pytest.mark.parametrize("name", ["f", "get_weather-2", "x" * 64])
def test_good_tool_names_are_taken(name):
    assert parse_tools(_tools(name)) is not None
