"""Where a waitress front listens and how it drains: the flags toppings-serve and
toppings-scheduler share, since both run the same front (frontend.py, waitress_server.py,
drain.py), and the probe both commands (and the launcher, the demo) run before anything slow: is
the port free. A command that listens elsewhere by default overrides `port` in its subclass."""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

from toppings.server.http.frontend import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_RESERVE_THREADS
from toppings.server.settings import Bound, Flag, Settings, positive, setting

DRAIN_TIMEOUT_S = 30.0


@dataclass(frozen=True, kw_only=True)
class ListenSettings(Settings):
    """Where the HTTP front listens, its spare threads, and how long a drain may take."""

    title = "listening"

    host: str = setting(
        "127.0.0.1",
        flag=Flag(
            "address to listen on (0.0.0.0: every interface; set the keys first: "
            "docs/production.md)"
        ),  # fmt: skip
    )
    port: int = setting(8100, flag=Flag("0 picks a free port", type=int))
    threads: int = setting(
        DEFAULT_RESERVE_THREADS,
        bound=Bound.POSITIVE,
        flag=Flag(
            "waitress threads beyond --max-concurrent-requests, kept for /health, /stats, "
            "/metrics, the operator's routes and quick 429s",
            type=positive,
            metavar="N",
        ),
    )
    header_timeout: int = setting(
        DEFAULT_HEADER_TIMEOUT_S,
        bound=Bound.POSITIVE,
        flag=Flag(
            "a connection whose request headers are not complete S seconds after they began (or "
            "that sends nothing for S seconds with no request running) is closed; a body not "
            "complete S seconds after its headers, plus a second per 500 bytes received, is "
            "answered 408; at the connection limit the longest-waiting incomplete header is "
            "closed to make room",
            type=positive,
            metavar="S",
        ),
    )
    drain_timeout: float = setting(
        DRAIN_TIMEOUT_S,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "on SIGTERM (or SIGINT, SIGHUP), how long requests in flight may take to finish; "
            "then the server ends what is left with finish_reason abort",
            type=float,
            metavar="S",
        ),
    )


def listen_problem(host: str, port: int) -> str | None:
    """Why host:port cannot be listened on now (taken, bad host), or None when it can."""
    if port == 0:
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as waitress does
            probe.bind(address)
    except OSError as e:
        return listen_error(host, port, e)
    return None


def listen_error(host: str, port: int, e: OSError) -> str:
    """What an error binding host:port means, in a user's words."""
    if e.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is already in use"
    return f"cannot listen on {host}:{port}: {e.strerror or e}"
