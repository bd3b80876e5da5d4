"""The scheduler's HTTP API: parse, call the router / cluster / registry, answer JSON.

Request endpoints mirror a server's (`/v1/completions`, `/v1/chat/completions`, `/v1/responses`,
`/generate`, `/tokenize`, `/detokenize`, streaming as server-sent events passed through; bodies
go to one server unchanged, see scheduler.router); `GET /v1/models` and `GET /v1/models/{id}`
list what registered servers serve (a model none does: 404); until a server is registered they
answer 503 with Retry-After. Errors use the server's contract (toppings.server.requests.errors).
Like a server, the request endpoints share one in-flight limit (toppings.server.http.frontend): a
proxied request holds a slot until its answer has ended, and past the limit a request gets 429
with Retry-After at once. While the scheduler drains (`draining` set, scheduler.drain) a new
request gets 503 with Retry-After; those in flight run on. Operator endpoints:
    GET    /health    200 once a server is registered, else 503 "no server ready yet"; 503
                      while draining
    GET    /stats     {"policy", "servers": [{"url", "ready", "in_flight"}], "num_servers",
                       "num_ready", "num_adapters", "num_base_models", "num_in_flight",
                       "draining"}
    GET    /metrics   Prometheus text (scheduler.metrics)
Admin endpoints manage the cluster:
    POST   /admin/servers   {"url"}            fetch its /v1/models and /stats, record it
    DELETE /admin/servers   {"url"} or ?url=   forget it
    POST   /admin/adapters  {"name", "base_model", "rank", "alpha"?, "target_modules"?,
                             "path"?, "bytes"?, "state"?, "sha256"?, "servers"?: [url]}
                            record an adapter (a name as a server's; another rank or base
                            than its record's: 409); with "servers" (each one registered,
                            else 400 and nothing recorded), ask each to load it from "path"
                            (none did: 502, and a new record is dropped)
    DELETE /admin/adapters  {"name"}           unload it on the servers hosting it, forget it
    GET    /admin/state                        servers, health, policy, perf-model source,
                                               loraserve's last placement step (else null), and
                                               with prefix-aware routing each server's KV events
                                               feed (endpoint, blocks, fresh) (else null)

Who may call which path (the client key, the admin key, loopback-only admin) is
scheduler.auth; the calls to servers go through scheduler.server_session, which attaches the
servers' key to registered servers only.

The routes come in groups (request proxying, `/admin/*` servers and state, `/admin/adapters`,
observability), each registered given one `SchedulerContext`; `create_app` builds it, installs
the error handlers and registers each group.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import requests
from flask import Flask, Response, jsonify, request

from toppings.scheduler.auth import AccessKeys, install_auth
from toppings.scheduler.cluster import Cluster
from toppings.scheduler.metrics import PREFIX
from toppings.scheduler.registry import AdapterRecord, Registry, RegistryError
from toppings.scheduler.router import Router, SchedulerError
from toppings.scheduler.server_session import ServerRefused
from toppings.server.http.frontend import (
    TENANT_SHARE,
    InFlightCollector,
    InFlightLimit,
    ReleasingBody,
)
from toppings.server.http.metrics import install_metrics
from toppings.server.requests.errors import (
    ADAPTER_NAME_RE,
    ADAPTER_NAME_RULE,
    BAD_GATEWAY,
    CONFLICT,
    NO_SERVER_READY,
    NOT_FOUND,
    RETRY_AFTER_S,
    TOO_MANY_REQUESTS,
    UNAVAILABLE,
    error_response,
    install_error_handlers,
    parse_json_object,
    request_id,
    shown,
    too_many_requests,
    unknown_adapter,
)

DEFAULT_MAX_IN_FLIGHT = 1024  # requests proxied at once, over the whole cluster

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
DRAINING = "the scheduler is draining"


def _json_body() -> dict[str, Any]:
    try:
        return parse_json_object(request.get_data())
    except ValueError as exc:
        raise SchedulerError(str(exc)) from exc


def _url(body: dict[str, Any]) -> str:
    """A server's URL, its scheme and host in lower case: one server, one spelling (another
    host name for the same address is still another server: give each server one)."""
    url = body.get("url", request.args.get("url"))
    if not isinstance(url, str) or not url.lower().startswith(("http://", "https://")):
        raise SchedulerError("'url' must be an http(s) URL")
    parts = urlsplit(url.rstrip("/"))
    if parts.username is not None or parts.password is not None:
        raise SchedulerError("'url' must not carry credentials (the servers' key goes in "
                             "--server-api-key)")  # fmt: skip
    return urlunsplit(parts._replace(scheme=parts.scheme.lower(), netloc=parts.netloc.lower()))


def _adapter(body: dict[str, Any]) -> AdapterRecord:
    name, base, alpha = body.get("name"), body.get("base_model"), body.get("alpha")
    if not isinstance(base, str) or not base:
        raise SchedulerError("'base_model' must be the base model's name (a string)")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))):
        raise SchedulerError("'alpha' must be a number")
    if not isinstance(name, str) or not ADAPTER_NAME_RE.fullmatch(name):
        raise SchedulerError(f"'name' must be {ADAPTER_NAME_RULE}, as a server's adapter names")
    try:
        return AdapterRecord(
            name=body["name"],
            base_model=body["base_model"],
            rank=body["rank"],
            alpha=None if body.get("alpha") is None else float(body["alpha"]),
            target_modules=_names(body.get("target_modules") or []),
            path=body.get("path"),
            num_bytes=body.get("bytes"),
            state=body.get("state", "active"),
            sha256=body.get("sha256"),
        )
    except KeyError as exc:
        raise SchedulerError(f"missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise SchedulerError(str(exc)) from None


def _names(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise SchedulerError("'target_modules' must be a list of module names")
    return tuple(value)


@dataclass(frozen=True)
class SchedulerContext:
    """What the routes use: the router (which proxies and holds the registry and metrics), the
    cluster of servers, the front end's in-flight limit, the `info` that /admin/state echoes and
    the drain flag (set: new requests are refused)."""

    router: Router
    cluster: Cluster
    registry: Registry
    in_flight: InFlightLimit
    info: dict[str, Any]
    draining: threading.Event = field(default_factory=threading.Event)


def _proxy(ctx: SchedulerContext, path: str, kind: str) -> Response:
    """Forward the body to one server; hold an in-flight slot until the answer has ended."""
    if ctx.draining.is_set():
        raise SchedulerError(DRAINING, 503, UNAVAILABLE, retry_after_s=RETRY_AFTER_S)
    ctx.router.check_ready()
    slot = ctx.in_flight.try_acquire()
    if slot is None:
        raise SchedulerError(too_many_requests(ctx.in_flight.max_in_flight), 429,
                             TOO_MANY_REQUESTS, retry_after_s=RETRY_AFTER_S)  # fmt: skip
    try:
        body = _json_body()
        model = body.get("model") if isinstance(body.get("model"), str) else None
        refused = ctx.in_flight.assign(slot, model or "", f"model {model!r}")  # its share
        if refused is not None:
            raise SchedulerError(refused, 429, TOO_MANY_REQUESTS, retry_after_s=RETRY_AFTER_S)
        answer = ctx.router.forward(path, body, kind, request_id())
    except BaseException:
        slot.release()
        raise
    headers = {"X-Toppings-Server": answer.server, **dict(answer.headers)}
    if isinstance(answer.body, bytes):
        slot.release()  # the server's answer has been read whole
        return Response(answer.body, answer.status, headers, content_type=answer.content_type)
    headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    body = ReleasingBody(answer.body, slot.release)  # released when the stream is closed
    return Response(body, answer.status, headers, content_type=answer.content_type)


# (path, endpoint, body kind) of the bodies proxied to a server: generation, and vLLM's tokenizer
# endpoints, answered by a server of the body's model.
PROXIED = (
    ("/v1/completions", "completions", "completions"),
    ("/v1/chat/completions", "chat", "chat"),
    ("/v1/responses", "responses", "responses"),
    ("/generate", "generate", "native"),
    ("/tokenize", "tokenize", "completions"),
    ("/detokenize", "detokenize", "completions"),
)


def _register_requests(app: Flask, ctx: SchedulerContext) -> None:
    """The request endpoints: generation and tokenizer bodies proxied to a server, the model
    cards from the registry."""
    router = ctx.router
    for path, endpoint, kind in PROXIED:
        app.add_url_rule(
            path, endpoint, lambda path=path, kind=kind: _proxy(ctx, path, kind), methods=["POST"]
        )

    @app.get("/v1/models")
    def models() -> Response:
        return jsonify(router.models())

    @app.get("/v1/models/<path:model_id>")
    def model(model_id: str) -> Response:
        card = next((m for m in router.models()["data"] if m["id"] == model_id), None)
        if card is None:
            raise SchedulerError(unknown_adapter(model_id), 404, NOT_FOUND)
        return jsonify(card)


def _register_observability(app: Flask, ctx: SchedulerContext) -> None:
    """`/health`, `/stats`, `/metrics` (the front end's in-flight gauge included), and the count
    of every HTTP answer by endpoint and status."""
    router, cluster, registry = ctx.router, ctx.cluster, ctx.registry
    router.metrics.registry.register(
        InFlightCollector(ctx.in_flight, PREFIX, "frontend_requests_in_flight",
                          "Requests taken by the HTTP front end and not ended")
    )  # fmt: skip

    @app.get("/health")
    def health() -> Response:
        if ctx.draining.is_set():
            return error_response(DRAINING, 503, UNAVAILABLE)
        servers = cluster.describe()
        if not servers:
            response = error_response(NO_SERVER_READY, 503, UNAVAILABLE)
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            return response
        healthy = sum(1 for s in servers if s["healthy"])
        return jsonify({"status": "ok", "num_servers": len(servers), "num_healthy": healthy})

    @app.get("/stats")
    def stats() -> Response:
        servers = [
            {"url": s["url"], "ready": s["healthy"], "in_flight": s["in_flight"]}
            for s in cluster.describe()
        ]
        return jsonify({
            "policy": router.policy.name,
            "servers": servers,
            "num_servers": len(servers),
            "num_ready": sum(1 for s in servers if s["ready"]),
            "num_in_flight": sum(s["in_flight"] for s in servers),
            "num_adapters": len(registry.list_adapters()),
            "num_base_models": len(registry.base_models()),
            "draining": ctx.draining.is_set(),
        })  # fmt: skip

    install_metrics(app, router.metrics.registry, PREFIX)


def _register_admin(app: Flask, ctx: SchedulerContext) -> None:
    """The operator's `/admin/*` routes but the adapters': servers in and out, and the
    cluster's state."""
    router, cluster, registry = ctx.router, ctx.cluster, ctx.registry

    @app.post("/admin/servers")
    def add_server() -> Response:
        url = _url(_json_body())
        try:
            added = cluster.add_server(url)
        except requests.RequestException as exc:
            raise SchedulerError(f"cannot reach {url}: {exc}", 502, BAD_GATEWAY) from None
        except (KeyError, TypeError, ValueError) as exc:
            raise SchedulerError(f"{url} answered an unexpected /stats or /v1/models: {exc}", 502,
                                 BAD_GATEWAY) from None  # fmt: skip
        return jsonify(added), 201

    @app.delete("/admin/servers")
    def remove_server() -> Response:
        url = _url(_json_body() if request.get_data() else {})
        if not cluster.remove_server(url):
            raise SchedulerError(f"unknown server {url}", 404, NOT_FOUND)
        return jsonify({"removed": url})

    @app.get("/admin/state")
    def state() -> Response:
        placer = getattr(router.policy, "placer", None)  # loraserve: its last placement step
        last_step = placer.history[-1] if placer is not None and placer.history else None
        return jsonify({
            "placement": last_step,
            **ctx.info,
            "policy": router.policy.name,
            "slo_tpt_ms": router.policy.slo_ms,
            "avg_resp_len": router.policy.avg_resp_len,
            "servers": cluster.describe(),
            "adapters": [a.name for a in registry.list_adapters()],
            "kv_events": cluster.kv_feeds.describe() if cluster.kv_feeds is not None else None,
        })  # fmt: skip


def _register_adapter_admin(app: Flask, ctx: SchedulerContext) -> None:
    """`/admin/adapters`: an adapter recorded (and loaded on the servers named), or unloaded
    on its servers and forgotten."""
    router, cluster, registry = ctx.router, ctx.cluster, ctx.registry

    @app.post("/admin/adapters")
    def add_adapter() -> Response:
        body = _json_body()
        adapter = _adapter(body)
        servers = body.get("servers") or []
        if not isinstance(servers, list) or not all(isinstance(u, str) for u in servers):
            raise SchedulerError("'servers' must be a list of server URLs")
        if servers and not adapter.path:
            raise SchedulerError("loading on servers needs the adapter's 'path'")
        servers = [u.rstrip("/") for u in servers]
        unknown = [u for u in servers if not cluster.is_registered(u)]
        if unknown:  # the servers' key goes to registered servers only
            raise SchedulerError(f"not registered servers: {', '.join(unknown)} (register a "
                                 "server with POST /admin/servers first)")  # fmt: skip
        known = registry.get_adapter(adapter.name)
        recorded = None if known is None else (known.rank, known.base_model)
        if recorded not in (None, (adapter.rank, adapter.base_model)):
            raise SchedulerError(f"adapter {shown(adapter.name)!r} is recorded with rank "
                                 f"{known.rank} on {known.base_model!r}: remove it first "
                                 "(DELETE /admin/adapters)", 409, CONFLICT)  # fmt: skip
        registry.put_adapter(adapter)
        loaded, failed = [], {}
        for url in servers:
            try:
                answer = router.session.post(
                    url + "/v1/load_lora_adapter",
                    json={"lora_name": adapter.name, "lora_path": adapter.path},
                    timeout=(3.0, 120.0),
                )
                if answer.status_code != 409:  # 409: the server has it already (idempotent)
                    ServerRefused.check(answer)
                registry.add_hosting(url, adapter.name)
                loaded.append(url)
            except (requests.RequestException, RegistryError) as exc:
                failed[url] = str(exc)
        for url in loaded:  # routing knows now, not at the next poll of its /stats
            cluster.refresh(url)
        if servers and not loaded:  # recorded for nothing: the record goes (a new one)
            if known is None:
                registry.remove_adapter(adapter.name)
            raise SchedulerError(f"no server loaded {shown(adapter.name)!r}: " + "; ".join(
                f"{url}: {why}" for url, why in failed.items()), 502, BAD_GATEWAY)  # fmt: skip
        return jsonify({"adapter": adapter.name, "loaded_on": loaded, "failed": failed}), 201

    @app.delete("/admin/adapters")
    def remove_adapter() -> Response:
        name = _json_body().get("name")
        if not isinstance(name, str):
            raise SchedulerError("'name' must be the adapter's name (a string)")
        if registry.get_adapter(name) is None:
            raise SchedulerError(unknown_adapter(shown(name)), 404, NOT_FOUND)
        unloaded, failed = [], {}
        for url, names in registry.hosting().items():  # else its next /stats records it again
            if name in names:
                try:
                    answer = router.session.post(
                        url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60.0
                    )
                    ServerRefused.check(answer)
                    unloaded.append(url)
                except requests.RequestException as exc:
                    failed[url] = str(exc)
        registry.remove_adapter(name)
        for url in unloaded:
            cluster.refresh(url)
        return jsonify({"removed": name, "unloaded_on": unloaded, "failed": failed})


def create_app(
    router: Router,
    cluster: Cluster,
    info: dict[str, Any],
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    keys: AccessKeys | None = None,
    draining: threading.Event | None = None,
) -> Flask:
    """Flask app around a router and cluster; `info` is echoed by /admin/state; past
    `max_in_flight` proxied requests, a request gets 429; `keys` guard it (scheduler.auth;
    none: no client key, /admin to loopback only); once `draining` is set, new requests get
    503. `app.extensions["toppings"]` is the in-flight limit (a drain waits for it to empty)."""
    app = Flask("toppings-scheduler")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    in_flight = InFlightLimit(max_in_flight, TENANT_SHARE, cluster.serves_adapters)
    flag = draining if draining is not None else threading.Event()
    ctx = SchedulerContext(router, cluster, router.registry, in_flight, info, flag)
    app.extensions["toppings"] = ctx.in_flight
    install_auth(app, keys or AccessKeys())
    _register_requests(app, ctx)
    _register_observability(app, ctx)
    _register_admin(app, ctx)
    _register_adapter_admin(app, ctx)
    install_error_handlers(app, log, SchedulerError, bad_input=(RegistryError,))
    return app
