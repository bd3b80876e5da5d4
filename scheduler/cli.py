"""`toppings-scheduler`: the cluster scheduler, served by waitress.

    toppings-scheduler --registry FILE.sqlite [--host 127.0.0.1] [--port 8000]
        [--policy rank-aware|prefix-aware|loraserve|random|first-fit|least-loaded]
        [--perf-model FILE.json] [--tokenizer DIR] [--prefix-weight W] [--kv-index-stale-s S]
        [--slo-tpt-ms X] [--placement-interval-s S] [--max-concurrent-requests N] [--threads N]
        [--api-key KEY] [--admin-api-key KEY] [--server-api-key KEY] [--drain-timeout S]

Servers known to the registry are polled from the start; add more with POST /admin/servers.
Clients need --api-key, `/admin/*` needs --admin-api-key (without it, only clients on this host
reach `/admin/*`); the servers' key goes only to the servers registered (scheduler.auth,
scheduler.server_session).
Without --perf-model the policies use the paper's Fig. 6 coefficients (A100, Llama-7B), which
do not describe this cluster's hardware; fit a model with bench/fit_perf_model.py.

`--policy prefix-aware` adds to the rank-aware cost what each server has cached of the prompt:
the scheduler follows the KV cache events of every server whose /stats names them
(toppings-serve --kv-events-endpoint; scheduler/kv_index/feeds.py) and hashes each prompt as
the servers do, from its token ids (given as ids, or from `--tokenizer`, the servers'
checkpoint directory).

Waitress runs one thread per proxied request in flight (`--max-concurrent-requests`, 429 past
it) plus `--threads` more for everything else (see toppings.server.http.frontend).

The first SIGTERM or SIGINT drains: `/health` turns 503, new requests get 503, and requests in
flight run to their end (at most `--drain-timeout` seconds) while waitress keeps streaming
them; then the loops stop, the registry closes and the command exits 0 (scheduler.drain).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sqlite3
import sys
import threading
from collections.abc import Callable
from typing import Any

from toppings.scheduler.adapter_sync import AdapterSync
from toppings.scheduler.app import DEFAULT_MAX_IN_FLIGHT, create_app
from toppings.scheduler.auth import AccessKeys, is_loopback_host
from toppings.scheduler.cluster import Cluster
from toppings.scheduler.drain import in_flight_ended
from toppings.scheduler.kv_index.feeds import DEFAULT_STALE_S, KVFeeds
from toppings.scheduler.loraserve import PlacementConfig
from toppings.scheduler.paper_models import paper_fig6_models
from toppings.scheduler.perf_model import PerfModels
from toppings.scheduler.placement_loop import PlacementLoop
from toppings.scheduler.policies import (
    POLICIES,
    LoRAServe,
    PrefixAware,
    PrefixWeights,
    make_policy,
)
from toppings.scheduler.registry import Registry
from toppings.scheduler.router import PromptCounter, Router, estimate_prompt_tokens
from toppings.scheduler.server_session import ServerOrigins, ServerSession
from toppings.scheduler.state import BatchShape
from toppings.server.http.drain import Drainer
from toppings.server.http.frontend import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_RESERVE_THREADS,
    raise_open_files_limit,
    waitress_settings,
)
from toppings.server.http.waitress_server import GuardedServer

log = logging.getLogger("toppings-scheduler")
STATS_TIMEOUT_S = 1.0
SLO_FACTOR = 1.5  # the paper's SLO: 1.5x the time per token without LoRA
DRAIN_TIMEOUT_S = 30.0  # as toppings-serve --drain-timeout
HANDLER_GRACE_S = 5.0  # after the drain: handlers still ending get this long before the close


def make_fetch_json(
    session: ServerSession, timeout_s: float = STATS_TIMEOUT_S
) -> Callable[[str], dict[str, Any]]:
    """GET url -> JSON; raises on refusal, timeout, a redirect, non-2xx or a non-JSON body."""

    def fetch_json(url: str) -> dict[str, Any]:
        answer = session.get(url, timeout=timeout_s)
        answer.raise_for_status()
        body = answer.json()
        if not isinstance(body, dict):
            raise ValueError(f"{url} did not answer a JSON object")
        return body

    return fetch_json


def default_slo_ms(perf: PerfModels) -> float:
    """1.5x the slowest kernel's predicted decode iteration for one request without LoRA."""
    one_base_request = BatchShape(num=1)
    decode = [m.predict(one_base_request) for m in perf.models.values() if m.phase == "decode"]
    return SLO_FACTOR * max(decode)


def warn_if_admin_unreachable(host: str, keys: AccessKeys) -> None:
    """One WARNING when the scheduler listens beyond loopback with no admin key: /admin then
    answers only clients on this host, which a remote operator would not expect."""
    if keys.admin_api_key is None and not is_loopback_host(host):
        log.warning("listening on %s without --admin-api-key: /admin answers only clients on "
                    "this host", host)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """The scheduler's flags (docs/flags.md is generated from them)."""
    parser = argparse.ArgumentParser(prog="toppings-scheduler", description=__doc__.split("\n")[0])
    parser.add_argument("--registry", required=True, help="SQLite registry file (created if new)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--policy", choices=sorted(POLICIES), default="rank-aware")
    parser.add_argument("--perf-model", help="perf-model JSON from bench/fit_perf_model.py")
    parser.add_argument(
        "--slo-tpt-ms",
        type=float,
        help="SLO on time per token, bounding the predicted decode latency (default: 1.5x the"
        " perf model's decode iteration of one request without LoRA)",
    )
    parser.add_argument(
        "--placement-interval-s",
        type=float,
        default=PlacementConfig.interval_s,
        help="loraserve: seconds between placement steps (a dead server re-places at once)",
    )
    parser.add_argument("--refresh-ms", type=float, default=100.0, help="/stats polling period")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=DEFAULT_MAX_IN_FLIGHT,
        metavar="N",
        help="proxied requests in flight past which a request gets 429 with Retry-After; "
        "waitress runs a thread for each",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_RESERVE_THREADS,
        metavar="N",
        help="waitress threads beyond --max-concurrent-requests, kept for /health, /stats, "
        "/metrics, /admin and quick 429s",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TOPPINGS_SCHEDULER_API_KEY") or None,
        help="clients must send `Authorization: Bearer KEY` on every path but /health (not"
        " /admin, which takes --admin-api-key); default $TOPPINGS_SCHEDULER_API_KEY",
    )
    parser.add_argument(
        "--admin-api-key",
        default=os.environ.get("TOPPINGS_ADMIN_API_KEY") or None,
        help="/admin/* wants `Authorization: Bearer KEY`; without it /admin/* answers clients on"
        " this host only; default $TOPPINGS_ADMIN_API_KEY",
    )
    parser.add_argument(
        "--server-api-key",
        default=os.environ.get("TOPPINGS_API_KEY") or None,
        help="bearer key of the servers (toppings-serve --api-key), sent only to the servers"
        " registered; default $TOPPINGS_API_KEY",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DRAIN_TIMEOUT_S,
        metavar="S",
        help="on SIGTERM, how long requests in flight may take to finish",
    )
    parser.add_argument(
        "--header-timeout",
        type=int,
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="S",
        help="a connection whose request headers are not complete S seconds after they began "
        "is closed (as toppings-serve --header-timeout)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="the base model's Hugging Face directory: count prompt tokens exactly (default:"
        " estimate them from characters)",
    )
    parser.add_argument(
        "--prefix-weight",
        type=float,
        default=PrefixWeights.prefix,
        metavar="W",
        help="prefix-aware: weight of the prefill a server's cached prefix saves the request"
        " (1: its predicted milliseconds; 0: the events are followed but not used)",
    )
    parser.add_argument(
        "--kv-index-stale-s",
        type=float,
        default=DEFAULT_STALE_S,
        metavar="S",
        help="prefix-aware: a server whose KV events lag what its /stats says it published for"
        " longer than this counts as holding an unknown prefix",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser


def _usage_error(message: str) -> None:
    """A user mistake: one line on stderr and exit status 2, as argparse does (no traceback)."""
    print(f"toppings-scheduler: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.max_concurrent_requests < 1 or args.threads < 1:
        _usage_error("--max-concurrent-requests and --threads must be positive")
    if args.drain_timeout < 0:
        _usage_error("--drain-timeout must not be negative")
    if "" in (args.api_key, args.admin_api_key, args.server_api_key):
        _usage_error("an empty key: --api-key, --admin-api-key and --server-api-key want a value")
    try:
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    except ValueError as e:
        _usage_error(f"--log-level: {e}")
    if args.perf_model:
        try:
            perf, source = PerfModels.load(args.perf_model), args.perf_model
        except (OSError, ValueError, KeyError, TypeError) as e:  # missing, not JSON, not ours
            _usage_error(f"--perf-model {args.perf_model}: {e}")
    else:
        perf = paper_fig6_models()
        source = perf.source
        log.warning("no --perf-model: routing on %s", source)
    try:
        count = PromptCounter(args.tokenizer) if args.tokenizer else estimate_prompt_tokens
    except Exception as e:  # any failure to load it: say so and stop, before serving
        _usage_error(f"--tokenizer {args.tokenizer}: {e}")
    try:
        registry = Registry(args.registry)
    except sqlite3.Error as e:
        _usage_error(f"--registry {args.registry}: {e}")
    origins = ServerOrigins()  # the cluster's servers: the only origins the server key goes to
    session = ServerSession(origins, args.server_api_key)  # /stats polling and adapter sync
    options: dict[str, Any] = {}
    feeds = None
    if issubclass(POLICIES[args.policy], PrefixAware):
        if args.kv_index_stale_s <= 0 or args.prefix_weight < 0:
            _usage_error("--kv-index-stale-s must be positive, --prefix-weight not negative")
        feeds = KVFeeds(stale_s=args.kv_index_stale_s)
        options.update(prefix=feeds, weights=PrefixWeights(prefix=args.prefix_weight))
        if not args.tokenizer:
            log.warning("prefix-aware without --tokenizer: only prompts given as token ids are"
                        " matched against the servers' caches")  # fmt: skip
    cluster = Cluster(registry, make_fetch_json(session), args.refresh_ms / 1000.0, origins, feeds)
    slo_ms = args.slo_tpt_ms or default_slo_ms(perf)
    if issubclass(POLICIES[args.policy], LoRAServe):
        if args.placement_interval_s <= 0:
            _usage_error("--placement-interval-s must be positive")
        options["placement"] = PlacementConfig(interval_s=args.placement_interval_s)
    policy = make_policy(args.policy, perf, slo_ms, seed=args.seed, **options)
    sync = AdapterSync(registry, cluster.hosting, session)
    placement_loop = PlacementLoop(policy, cluster, registry, args.refresh_ms / 1000.0, sync)
    router = Router(registry, cluster, policy, count, ServerSession(origins, args.server_api_key))
    info = {"perf_model_source": source, "registry": args.registry}
    keys = AccessKeys(args.api_key, args.admin_api_key)
    draining = threading.Event()
    app = create_app(router, cluster, info, args.max_concurrent_requests, keys, draining)
    sizing = waitress_settings(args.max_concurrent_requests, args.threads, args.header_timeout)
    raise_open_files_limit(sizing["connection_limit"])
    try:
        server = GuardedServer(app, args.header_timeout, host=args.host, port=args.port, **sizing)
    except OSError as e:
        registry.close()
        if e.errno == errno.EADDRINUSE:
            _usage_error(
                f"port {args.port} on {args.host} is already in use (pick another with --port)"
            )
        _usage_error(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}")
    in_flight = app.extensions["toppings"]
    drainer = Drainer(
        draining, in_flight_ended(in_flight), args.drain_timeout,
        lambda: server.stop(HANDLER_GRACE_S),
    )  # fmt: skip
    drainer.install_signals()
    warn_if_admin_unreachable(args.host, keys)
    cluster.start()
    placement_loop.start()
    log.info("scheduler on http://%s:%s, policy %s, SLO %.1f ms per token",
             args.host, server.effective_port, args.policy, slo_ms)  # fmt: skip
    try:
        server.run()  # returns once the drain has closed waitress's sockets
        server.release()
    finally:
        placement_loop.stop()
        sync.close()
        cluster.stop()
        registry.close()
        log.info("stopped")


if __name__ == "__main__":
    main()
