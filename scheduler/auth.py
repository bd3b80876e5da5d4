"""Who may call the scheduler: the client key, the admin key, and loopback-only admin.

    --api-key KEY        every path but `/health` wants `Authorization: Bearer KEY` (else 401)
    --admin-api-key KEY  `/admin/*` wants `Authorization: Bearer KEY` (else 401); the client
                         key does not open it
    no admin key         `/admin/*` answers loopback clients only (127.0.0.0/8, ::1), 403 to
                         anyone else

The admin endpoints register servers, and the scheduler sends the servers' key to the servers
registered, so they are kept apart from the client key: a client that may generate may not point
the scheduler (and its server key) at a host of its choosing. The keys are compared as bytes in
constant time (`bearer_matches`, shared with the server). `request.remote_addr` is the peer
of the TCP connection: behind a reverse proxy on the same host every client looks local, so such
a deployment sets --admin-api-key.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from flask import Flask, request

from toppings.scheduler.router import SchedulerError
from toppings.server.requests.errors import (
    API_KEY_REQUIRED,
    AUTHENTICATION,
    PERMISSION_DENIED,
    bearer_matches,
)

OPEN_PATHS = frozenset({"/health"})  # answered without a key (load balancers and launchers probe)
ADMIN_PREFIX = "/admin/"
ADMIN_KEY_REQUIRED = "a valid admin key is required on /admin (Authorization: Bearer ADMIN_KEY)"
ADMIN_LOOPBACK_ONLY = (
    "/admin answers only clients on this host while the scheduler has no admin key; start it "
    "with --admin-api-key (or $TOPPINGS_ADMIN_API_KEY) to administer it from elsewhere"
)


@dataclass(frozen=True)
class AccessKeys:
    """The scheduler's own keys; None turns a check off (see the module docstring)."""

    api_key: str | None = None
    admin_api_key: str | None = None


def is_loopback(address: str | None) -> bool:
    """Whether a peer address is this host's loopback (an IPv4-mapped IPv6 address included)."""
    try:
        ip = ipaddress.ip_address(address or "")
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def is_loopback_host(host: str) -> bool:
    """Whether a listening host name or address is reachable from this host only."""
    return host == "localhost" or is_loopback(host)


def check_access(keys: AccessKeys, path: str, authorization: str, remote_addr: str | None) -> None:
    """Raise SchedulerError (401 or 403) unless a request to `path` may be answered."""
    if path in OPEN_PATHS:
        return
    if path.startswith(ADMIN_PREFIX.rstrip("/")):
        if keys.admin_api_key is not None:
            if not bearer_matches(authorization, keys.admin_api_key):
                raise SchedulerError(ADMIN_KEY_REQUIRED, 401, AUTHENTICATION)
        elif not is_loopback(remote_addr):
            raise SchedulerError(ADMIN_LOOPBACK_ONLY, 403, PERMISSION_DENIED)
        return
    if keys.api_key is not None and not bearer_matches(authorization, keys.api_key):
        raise SchedulerError(API_KEY_REQUIRED, 401, AUTHENTICATION)


def install_auth(app: Flask, keys: AccessKeys) -> None:
    """Check every request of `app` against `keys` before its handler runs."""

    @app.before_request
    def authenticate() -> None:
        # The matched rule, not the raw path, decides what a request reaches (a path the
        # router would normalise onto /admin is checked as /admin).
        path = request.url_rule.rule if request.url_rule is not None else request.path
        check_access(keys, path, request.headers.get("Authorization", ""), request.remote_addr)
