"""Where a waitress front listens and how it drains: the flags toppings-serve and
toppings-scheduler share, since both run the same front (frontend.py, waitress_server.py,
drain.py). A command that listens elsewhere by default overrides `port` in its subclass."""

from __future__ import annotations

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
            "on SIGTERM, how long requests in flight may take to finish", type=float, metavar="S"
        ),
    )
