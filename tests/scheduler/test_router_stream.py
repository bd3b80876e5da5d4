"""The router learns the mean response length from streamed answers too (SSE events counted)."""

from __future__ import annotations

import json

import pytest

from toppings.scheduler.router import RESP_LEN_EMA


class StreamedAnswer:
    """A requests.Response stand-in whose body arrives in awkward pieces."""

    status_code, ok = 200, True
    headers = {"Content-Type": "text/event-stream"}

    def __init__(self, body: bytes, piece: int) -> None:
        self._pieces = [body[i : i + piece] for i in range(0, len(body), piece)]
        self.closed = False

    def iter_content(self, chunk_size=None):
        yield from self._pieces

    def close(self) -> None:
        self.closed = True


def sse_body(num_tokens: int, done: bool = True) -> bytes:
    events = [{"choices": [{"index": 0, "text": f"t{i}"}]} for i in range(num_tokens)]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    return body + (b"data: [DONE]\n\n" if done else b"")


@pytest.fixture
def router(tmp_path, scheduler_parts):
    with scheduler_parts(tmp_path, lambda url: {}) as parts:
        yield parts.router


@pytest.mark.parametrize("piece", [1, 5, 7, 4096])  # markers split at every possible place
def test_a_finished_stream_teaches_its_length(router, piece):
    before = router.policy.avg_resp_len
    answer = StreamedAnswer(sse_body(40), piece)
    forwarded = router._pass_on(answer, "http://s", stream=True)
    assert b"".join(forwarded.body) == sse_body(40)  # passed on unchanged
    assert answer.closed
    want = (1 - RESP_LEN_EMA) * before + RESP_LEN_EMA * 40
    assert router.policy.avg_resp_len == pytest.approx(want)


def test_a_cut_stream_teaches_nothing(router):
    before = router.policy.avg_resp_len
    forwarded = router._pass_on(StreamedAnswer(sse_body(40, done=False), 64), "http://s", True)
    b"".join(forwarded.body)
    assert router.policy.avg_resp_len == before
