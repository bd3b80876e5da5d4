"""Bounds of the sampling parameters a client sets (server/requests/request.py): a stop string
past MAX_STOP_CHARS is refused, since the detokenizer holds back and searches that much text at
every token of the request."""

from __future__ import annotations

import pytest

from toppings.server.requests.request import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    RequestError,
    SamplingParams,
)


def test_stop_strings_up_to_the_bounds_are_taken():
    params = SamplingParams(stop=("x" * MAX_STOP_CHARS,) * MAX_STOP_STRINGS)
    assert len(params.stop) == MAX_STOP_STRINGS


@pytest.mark.parametrize(
    "stop, message",
    [
        (("x" * (MAX_STOP_CHARS + 1),), f"at most {MAX_STOP_CHARS} characters"),
        (("a",) * (MAX_STOP_STRINGS + 1), f"1 to {MAX_STOP_STRINGS}"),
        (("",), "non-empty"),
    ],
    ids=["too-long", "too-many", "empty"],
)
def test_stop_strings_past_the_bounds_are_a_400(stop, message):
    with pytest.raises(RequestError, match=message) as error:
        SamplingParams(stop=stop)
    assert error.value.code == 400
