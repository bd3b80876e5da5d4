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
it, and past 3/4 of it for one model) plus `--threads` more for everything else (see
toppings.server.http.frontend).

The first SIGTERM or SIGINT drains: `/health` turns 503, new requests get 503, and requests in
flight run to their end (at most `--drain-timeout` seconds) while waitress keeps streaming
them; a stream still running then ends with an error event (503) and `[DONE]` and its server's
stream is closed; then the loops stop, the registry closes and the command exits 0
(scheduler.drain).
"""

from __future__ import annotations

import argparse
import errno
import logging
import sqlite3
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from toppings.scheduler.adapter_sync import AdapterSync
from toppings.scheduler.app import create_app
from toppings.scheduler.auth import AccessKeys, is_loopback_host
from toppings.scheduler.cli_args import (
    RoutingSettings,
    SchedulerSettings,
    build_parser,
    parse_settings,
)
from toppings.scheduler.cluster import Cluster
from toppings.scheduler.drain import DRAIN_ENDED, in_flight_ended
from toppings.scheduler.kv_index.feeds import KVFeeds
from toppings.scheduler.loraserve import PlacementConfig
from toppings.scheduler.paper_models import paper_fig6_models
from toppings.scheduler.perf_model import PerfModels
from toppings.scheduler.placement_loop import PlacementLoop
from toppings.scheduler.policies import PrefixWeights, make_policy
from toppings.scheduler.prompt_tokens import PromptCounter, estimate_prompt_tokens
from toppings.scheduler.registry import Registry
from toppings.scheduler.router import Router
from toppings.scheduler.server_session import ServerOrigins, ServerSession
from toppings.scheduler.state import BatchShape
from toppings.server.http.drain import Drainer
from toppings.server.http.frontend import raise_open_files_limit, waitress_settings
from toppings.server.http.listen import listen_problem
from toppings.server.http.waitress_server import GuardedServer

log = logging.getLogger("toppings-scheduler")
STATS_TIMEOUT_S = 1.0
SLO_FACTOR = 1.5  # the paper's SLO: 1.5x the time per token without LoRA
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


def _usage_error(message: str) -> NoReturn:
    """A user mistake: one line on stderr and exit status 2, as argparse does (no traceback)."""
    print(f"toppings-scheduler: error: {message}", file=sys.stderr)
    sys.exit(2)


def load_perf_models(path: str | None) -> tuple[PerfModels, str]:
    """The fitted models of --perf-model (and where they came from), else the paper's."""
    if not path:
        perf = paper_fig6_models()
        log.warning("no --perf-model: routing on %s", perf.source)
        return perf, perf.source
    try:
        return PerfModels.load(path), path
    except (OSError, ValueError, KeyError, TypeError) as e:  # missing, not JSON, not ours
        _usage_error(f"--perf-model {path}: {e}")


def prompt_counter(tokenizer: str | None) -> Callable[[dict[str, Any]], int]:
    """How the router counts a request's prompt tokens: the tokenizer's, else an estimate."""
    if not tokenizer:
        return estimate_prompt_tokens
    try:
        return PromptCounter(tokenizer)
    except Exception as e:  # any failure to load it: say so and stop, before serving
        _usage_error(f"--tokenizer {tokenizer}: {e}")


def policy_options(routing: RoutingSettings) -> tuple[dict[str, Any], KVFeeds | None]:
    """The policy's own options (make_policy) and the KV events feeds it follows, if any."""
    options: dict[str, Any] = {}
    feeds = None
    if routing.is_prefix_aware:
        feeds = KVFeeds(stale_s=routing.kv_index_stale_s)
        options.update(prefix=feeds, weights=PrefixWeights(prefix=routing.prefix_weight))
        if not routing.tokenizer:
            log.warning("prefix-aware without --tokenizer: only prompts given as token ids are"
                        " matched against the servers' caches")  # fmt: skip
    if routing.places_adapters:
        options["placement"] = PlacementConfig(interval_s=routing.placement_interval_s)
    return options, feeds


def listen(app: Any, front: SchedulerSettings, registry: Registry) -> GuardedServer:
    """Waitress on --host:--port, sized for --max-concurrent-requests; a port in use is a usage
    error (the registry closed first)."""
    sizing = waitress_settings(front.max_concurrent_requests, front.threads, front.header_timeout)
    raise_open_files_limit(sizing["connection_limit"])
    try:
        return GuardedServer(app, front.header_timeout, host=front.host, port=front.port, **sizing)
    except OSError as e:
        registry.close()
        if e.errno == errno.EADDRINUSE:
            _usage_error(
                f"port {front.port} on {front.host} is already in use (pick another with --port)"
            )
        _usage_error(f"cannot listen on {front.host}:{front.port}: {e.strerror or e}")


def main(argv: list[str] | None = None) -> None:
    try:
        front, keys_given, routing = parse_settings(parse_args(argv))
    except ValueError as e:
        _usage_error(str(e))
    logging.basicConfig(level=front.log_level, format="%(asctime)s %(name)s %(message)s")
    perf, source = load_perf_models(routing.perf_model)
    count = prompt_counter(routing.tokenizer)
    if problem := listen_problem(front.host, front.port):  # before the registry file is made
        _usage_error(f"{problem} (pick another with --port)")
    try:
        registry = Registry(front.registry)
    except sqlite3.Error as e:
        _usage_error(f"--registry {front.registry}: {e}")
    origins = ServerOrigins()  # the cluster's servers: the only origins the server key goes to
    session = ServerSession(origins, keys_given.server_api_key)  # /stats polling, adapter sync
    options, feeds = policy_options(routing)
    refresh_s = routing.refresh_ms / 1000.0
    cluster = Cluster(registry, make_fetch_json(session), refresh_s, origins, feeds)
    slo_ms = routing.slo_tpt_ms or default_slo_ms(perf)
    policy = make_policy(routing.policy, perf, slo_ms, seed=routing.seed, **options)
    sync = AdapterSync(registry, cluster.hosting, session)
    placement_loop = PlacementLoop(policy, cluster, registry, refresh_s, sync)
    router_session = ServerSession(origins, keys_given.server_api_key,
                                   max_connections=front.max_concurrent_requests)  # fmt: skip
    router = Router(registry, cluster, policy, count, router_session)
    info = {"perf_model_source": source, "registry": front.registry}
    keys = AccessKeys(keys_given.api_key, keys_given.admin_api_key)
    draining = threading.Event()
    app = create_app(router, cluster, info, front.max_concurrent_requests, keys, draining)
    server = listen(app, front, registry)
    in_flight = app.extensions["toppings"]
    drainer = Drainer(
        draining, in_flight_ended(in_flight), front.drain_timeout,
        lambda: server.stop(HANDLER_GRACE_S), lambda: router.streams.end_all(DRAIN_ENDED),
    )  # fmt: skip
    drainer.install_signals()
    warn_if_admin_unreachable(front.host, keys)
    cluster.start()
    placement_loop.start()
    log.info("scheduler on http://%s:%s, policy %s, SLO %.1f ms per token",
             front.host, server.effective_port, routing.policy, slo_ms)  # fmt: skip
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
