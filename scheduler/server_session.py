"""The scheduler's HTTP calls to servers, and the one place the servers' key is attached.

The key (`--server-api-key`, the servers' `--api-key`) is never a default header of a session:
`ServerSession` adds `Authorization: Bearer KEY` to a call only when the target's origin
(scheme, host, port) is the origin of a server the cluster registered (`ServerOrigins`: the
servers the registry knows at start, and those an operator adds through the admin API). A URL a
client names in a request body is not registered and never sees the key. Redirects are never
followed: a server answering 3xx could send the call, key and body, elsewhere; such an answer
is a failed call (`RedirectRefused`, a `requests.RequestException`).
"""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import urlsplit

import requests

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
