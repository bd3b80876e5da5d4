"""The scheduler's HTTP calls to servers, and the one place the servers' key is attached.

The key (`--server-api-key`, the servers' `--api-key`) is never a default header of a session:
`ServerSession` adds `Authorization: Bearer KEY` to a call only when the target's origin
(scheme, host, port) is the origin of a server the cluster registered (`ServerOrigins`: the
servers the registry knows at start, and those an operator adds through the admin API). A URL a
client names in a request body is not registered and never sees the key. Redirects are never
followed: a server answering 3xx could send the call, key and body, elsewhere; such an answer
is a failed call (`RedirectRefused`, a `requests.RequestException`).

A server's streamed answer reaches the client through a `ProxiedStream`, and `LiveStreams`
holds those being proxied: when the scheduler's drain runs out of time, it ends each of them
(`LiveStreams.end_all`) with an error event and `[DONE]`, as a server ends its own streams at
its drain's end, rather than cutting the connection; the server sees its stream closed and
aborts the request.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import requests

from toppings.server.requests.errors import BAD_GATEWAY, UNAVAILABLE, error_body

log = logging.getLogger(__name__)

DEFAULT_PORTS = {"http": 80, "https": 443}


def origin(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an http(s) URL, lower-cased with the default port filled in;
    None for anything else."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # a malformed port or host
        return None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname:
        return None
    return scheme, parts.hostname.lower(), port or DEFAULT_PORTS[scheme]


class ServerOrigins:
    """Thread-safe set of the registered servers' URLs, asked by origin."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._urls: set[str] = set()

    def add(self, url: str) -> None:
        with self._lock:
            self._urls.add(url)

    def discard(self, url: str) -> None:
        with self._lock:
            self._urls.discard(url)

    def trusts(self, url: str) -> bool:
        """Whether `url` has the origin of a registered server."""
        target = origin(url)
        if target is None:
            return False
        with self._lock:
            return any(origin(u) == target for u in self._urls)


class RedirectRefused(requests.RequestException):
    """A server answered a redirect; the scheduler does not follow one."""


class ServerRefused(requests.RequestException):
    """A server answered an operator's call with an error: its status and its own words."""

    @classmethod
    def check(cls, answer: requests.Response) -> None:
        """Raise unless `answer` succeeded, with the server's error message (a 403 for a path
        outside its adapter roots says so, where raise_for_status said only FORBIDDEN)."""
        if answer.ok:
            return
        try:
            message = str(answer.json()["error"]["message"])
        except (ValueError, KeyError, TypeError):
            message = answer.reason or "no message"
        cut = message if len(message) <= 300 else message[:300] + "..."
        raise cls(f"{answer.status_code} from {answer.url}: {cut}")


class ServerSession:
    """`get` and `post` to servers: the key on registered origins only, redirects refused.

    One `requests.Session` underneath (connection reuse), shared by the calling threads as the
    scheduler has always shared it; its default headers carry no key.
    """

    def __init__(
        self, origins: ServerOrigins, api_key: str | None = None, max_connections: int = 64
    ):
        """max_connections: kept-alive connections to each server (requests' default, 10,
        discarded a connection per request past ten in flight, with a warning each)."""
        self.origins = origins
        self.api_key = api_key
        self.session = requests.Session()
        pooled = requests.adapters.HTTPAdapter(pool_maxsize=max_connections)
        self.session.mount("http://", pooled)
        self.session.mount("https://", pooled)

    def get(self, url: str, **kwargs: Any) -> requests.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> requests.Response:
        return self.request("POST", url, **kwargs)

    def request(self, method: str, url: str, **kwargs: Any) -> requests.Response:
        """One call to a server (keywords as `requests.Session.request`, `allow_redirects`
        excepted); raises RedirectRefused on a 3xx answer."""
        headers = dict(kwargs.pop("headers", None) or {})
        if self.api_key is not None and self.origins.trusts(url):
            headers["Authorization"] = f"Bearer {self.api_key}"
        answer = self.session.request(method, url, headers=headers, allow_redirects=False, **kwargs)
        if 300 <= answer.status_code < 400:
            answer.close()
            where = answer.headers.get("Location", "nowhere")
            raise RedirectRefused(
                f"{url} answered {answer.status_code} (a redirect to {where}); not followed"
            )
        return answer


class LiveStreams:
    """The `ProxiedStream`s being proxied now (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: set[ProxiedStream] = set()

    def add(self, stream: ProxiedStream) -> None:
        with self._lock:
            self._streams.add(stream)

    def discard(self, stream: ProxiedStream) -> None:
        with self._lock:
            self._streams.discard(stream)

    def __len__(self) -> int:
        return len(self._streams)

    def end_all(self, message: str) -> None:
        """End every stream being proxied: each sends its client an error event (503,
        `message`) and `[DONE]` next, and closes its server's stream now."""
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.end_early(message)


class ProxiedStream:
    """A server's SSE body as it arrives; closes the upstream and ends the attempt however it
    ends.

    An iterator object rather than a generator: the WSGI server calls `close()` when the client
    goes away, and a generator never started would skip its `finally` (the request would stay
    in flight forever, and the upstream connection open).

    Counts the stream's events as it passes: a server sends one event per output step (about
    one token), so a stream that ends with `data: [DONE]` tells `learn` roughly how many tokens
    it carried (the usage-only event of include_usage counts one too much).
    """

    def __init__(
        self,
        answer: requests.Response,
        learn: Callable[[int], None],
        done: Callable[[str | None], None],
        live: LiveStreams,
    ):
        self.answer, self.learn, self.done, self.live = answer, learn, done, live
        self._chunks: Iterator[bytes] | None = None
        self.events, self.saw_done, self.tail = 0, False, b""
        self.closed = False
        self._ended: str | None = None  # why the scheduler ends it early (end_early)
        live.add(self)

    def __iter__(self) -> ProxiedStream:
        return self

    def __next__(self) -> bytes:
        if self.closed:
            raise StopIteration
        if self._ended is not None:
            return self._end_early_event()
        if self._chunks is None:
            self._chunks = self.answer.iter_content(chunk_size=None)
        try:
            chunk = next(self._chunks)
        except StopIteration:
            if self._ended is not None:
                return self._end_early_event()
            self._end("success")
            if self.saw_done:
                self.learn(self.events - 1)
            raise
        except requests.RequestException as exc:  # the server went away mid-stream
            if self._ended is not None:
                return self._end_early_event()
            self._end("error")
            where = getattr(self.answer, "url", "a server")
            log.warning("a stream from %s broke off: %s", where, type(exc).__name__)
            return self._final_event("the server's stream broke off", 502, BAD_GATEWAY)
        except Exception:
            if self._ended is not None:  # its upstream closed under the read
                return self._end_early_event()
            self._end("error")
            raise
        except BaseException:
            self._end("error")
            raise
        seen = self.tail + chunk  # a marker may straddle two chunks
        # Markers wholly inside the tail were counted with the previous chunk.
        self.events += seen.count(b"data: ") - self.tail.count(b"data: ")
        self.saw_done = self.saw_done or b"data: [DONE]" in seen
        self.tail = seen[-11:]  # one byte short of b"data: [DONE]"
        return chunk

    def end_early(self, message: str) -> None:
        """End this stream from another thread: its next chunk is an error event (503,
        `message`) and `[DONE]`; its server's stream is closed now (a read waiting on it
        fails)."""
        self._ended = message
        self.answer.close()

    def _end_early_event(self) -> bytes:
        self._end("error")
        return self._final_event(self._ended or "", 503, UNAVAILABLE)

    def _final_event(self, message: str, code: int, error_type: str) -> bytes:
        """An error event in the server's shape (after a blank line, where an event was cut
        short) and `[DONE]`, as a server ends a generation that failed mid-stream."""
        cut = b"" if not self.tail or self.tail.endswith(b"\n\n") else b"\n\n"
        error = error_body(message, code, error_type)
        return cut + b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"

    def close(self) -> None:
        """Called by the WSGI server when the response ends or the client goes away."""
        self._end("disconnected")

    def _end(self, outcome: str) -> None:
        if not self.closed:
            self.closed = True
            self.live.discard(self)
            self.answer.close()
            self.done(outcome)
