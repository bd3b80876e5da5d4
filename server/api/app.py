"""The inference server's HTTP API: parse a body, submit it to the engine, return JSON or SSE.

Handlers run on waitress worker threads; they only tokenize, call `engine.submit` and read the
requests' output queue, so a slow client never stalls the engine thread. One response may be many
engine requests (n choices, a list of prompts: a `RequestGroup`). Unknown routes and methods get
the JSON error of every other endpoint. `/tokenize` and `/detokenize` are vLLM's (see
server.api.openai.tokenize).

The routes come in groups, each registered given one `ApiContext` (server.api.context):
generation and tokenizer (server.api.openai.generation), models (server.api.openai.models),
adapters (server.api.admin.routes) and observability (`/health`, `/stats`, `/metrics`, here).
`create_app` builds the context, installs the API-key check and the error handlers, and
registers each group.

The generation endpoints share one in-flight limit (server.http.frontend): a request takes a slot
before it is submitted and gives it back when its answer ends, on every path; past the limit it
gets 429 with Retry-After at once. `cli.py` sizes waitress's thread pool from the same limit, so
streams never wait for a thread and the operator endpoints always find one.

Operator endpoints: `/metrics` (Prometheus, see server.api.metrics), `/v1/load_lora_adapter`
and `/v1/unload_lora_adapter` (see server.api.admin.lifecycle; a load naming `peers` fetches the
adapter from them, server.api.admin.peer_fetch), `GET /v1/adapters/NAME/files[/FILE]` (the PEFT
files of an adapter this server holds, for a peer to fetch; server.api.admin.files). With an API
key every endpoint but `/health` wants `Authorization: Bearer KEY`; with an admin key
(`--admin-api-key`) adapter load and unload want that key instead, and the client key keeps
generation and reads. While the server drains
(SIGTERM), `/health` answers 503 so that a scheduler stops routing here, and the engine refuses
new requests with 503. The operator's settings are `ApiOptions` (server.api.options).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from flask import Flask, Response, jsonify, request

from toppings.server.api.admin.lifecycle import AdapterAdmin, AdapterPaths
from toppings.server.api.admin.peer_fetch import FetchConfig, PeerFetcher
from toppings.server.api.admin.routes import register_adapters
from toppings.server.api.context import ApiContext, ServerState
from toppings.server.api.metrics import PREFIX, ServerMetrics
from toppings.server.api.openai.choices import LOGPROB_ENTRIES_IN_FLIGHT, RequestLimits
from toppings.server.api.openai.generation import register_generation, register_tokenizer
from toppings.server.api.openai.logprobs import TokenText
from toppings.server.api.openai.models import register_models
from toppings.server.api.options import ApiOptions
from toppings.server.api.tokenizer_pool import TokenizerPool
from toppings.server.http.frontend import TENANT_SHARE, InFlightLimit, default_max_in_flight
from toppings.server.http.metrics import install_metrics
from toppings.server.requests.errors import (
    API_KEY_REQUIRED,
    AUTHENTICATION,
    SERVER_ERROR,
    UNAVAILABLE,
    bearer_matches,
    error_response,
    install_error_handlers,
)
from toppings.server.requests.request import RequestError
from toppings.server.resolver.metrics import ResolverMetrics
from toppings.server.resolver.names import AdapterNames, RegisteredNames
from toppings.server.resolver.preparer import reader_threads
from toppings.server.resolver.resolved import ResolvedAdapters
from toppings.server.resolver.sources import make_source
from toppings.server.settings import process_cores

__all__ = ["ApiOptions", "create_app"]

logger = logging.getLogger(__name__)

# The default body limit: a prompt at the character bound in UTF-8 (at most 4 bytes a
# character), plus room for the rest of the body (parameters, token-id prompts).
BYTES_PER_PROMPT_CHAR = 4
BODY_EXTRA_BYTES = 1 << 20
OPEN_PATHS = frozenset({"/health"})  # answered without an API key (load balancers probe it)
# The operator's routes: they change what the server serves for every tenant, or hand out an
# adapter's weights (a tenant's, which another tenant's key must not read; peers fetch them).
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter",
                         "/v1/adapters/<path:name>/files",
                         "/v1/adapters/<path:name>/files/<file_name>"})  # fmt: skip
ADMIN_KEY_REQUIRED = (
    "a valid admin key is required on this route (Authorization: Bearer ADMIN_KEY, the "
    "server's --admin-api-key)"
)


def _install_auth(app: Flask, api_key: str | None, admin_api_key: str | None) -> None:
    """With a client key, every path but OPEN_PATHS wants `Authorization: Bearer KEY` (else 401).
    With an admin key, ADMIN_PATHS want it and only it; it opens the other paths too."""
    if api_key is not None and admin_api_key is None:
        logger.warning("--api-key without --admin-api-key: every holder of the client key may "
                       "load and unload adapters")  # fmt: skip

    @app.before_request
    def authenticate() -> None:
        # The matched rule decides what a request reaches, not the raw path.
        path = request.url_rule.rule if request.url_rule is not None else request.path
        if path in OPEN_PATHS:
            return
        authorization = request.headers.get("Authorization", "")
        is_admin = admin_api_key is not None and bearer_matches(authorization, admin_api_key)
        if path in ADMIN_PATHS and admin_api_key is not None:
            if not is_admin:
                raise RequestError(ADMIN_KEY_REQUIRED, 401, AUTHENTICATION)
            return
        if api_key is not None and not is_admin and not bearer_matches(authorization, api_key):
            raise RequestError(API_KEY_REQUIRED, 401, AUTHENTICATION)


def register_observability(app: Flask, ctx: ApiContext) -> None:
    """`/health` (503 while draining or when the engine is down), `/stats`, `/metrics`, and the
    count of every HTTP answer by endpoint and status."""
    engine, state = ctx.engine, ctx.state

    @app.get("/health")
    def health() -> Response:
        if state.draining.is_set():
            return error_response("the server is draining", 503, UNAVAILABLE)
        if engine.is_healthy():
            return jsonify({"status": "ok"})
        return error_response("the engine is not running", 503, SERVER_ERROR)

    @app.get("/stats")
    def stats() -> Response:
        body = dataclasses.replace(
            engine.stats(request.args.get("adapters_since")),
            draining=state.draining.is_set(),
            num_in_flight=state.in_flight.num_in_flight,
            max_concurrent_requests=state.in_flight.max_in_flight,
            lora_resolver=ctx.names.finds_unregistered,
        )
        return jsonify(body.to_json())

    install_metrics(app, state.metrics.registry, PREFIX)


def _context(engine, options: ApiOptions) -> ApiContext:
    """The routes' context: the in-flight limit (the operator's, else 4x the batch), the
    logprobs' budget, the metrics, the adapter admin and, with an adapter store, the peer
    fetcher."""
    max_in_flight = options.max_concurrent_requests or default_max_in_flight(
        engine.config.max_batch_size
    )
    resolves = options.lora_resolver is not None

    def several() -> bool:  # tenants: adapters registered, or found on first use
        return resolves or engine.num_adapters() > 0

    in_flight = InFlightLimit(max_in_flight, TENANT_SHARE, several)
    logprobs = InFlightLimit(LOGPROB_ENTRIES_IN_FLIGHT)
    metrics = ServerMetrics(engine, in_flight, logprobs, options.adapter_series)
    state = ServerState(in_flight, logprobs, metrics)
    admin = AdapterAdmin(engine, AdapterPaths(options.lora_roots))
    fetcher = None
    if options.adapter_store is not None:
        key = options.admin_api_key or options.api_key  # a peer's files want its admin key
        fetch = FetchConfig(options.adapter_store, key, peers=options.peers,
                            total_timeout_s=options.peer_fetch_timeout_s)  # fmt: skip
        fetcher = PeerFetcher(engine, fetch, thread=admin.thread)
    return ApiContext(
        engine=engine,
        state=state,
        names=_names(engine, options, admin, state.metrics),
        limits=RequestLimits.for_model(
            engine.tokenizer,
            engine.max_model_len,
            options.max_prompt_tokens,
            options.max_new_tokens_limit,
        ),
        token_text=TokenText(engine.tokenizer),
        admin=admin,
        fetcher=fetcher,
        tokenizers=TokenizerPool(engine.tokenizer, chat_template=options.chat_template),
        started=int(time.time()),
    )


def _names(
    engine, options: ApiOptions, admin: AdapterAdmin, metrics: ServerMetrics
) -> AdapterNames:
    """Registered names, and with --lora-resolver names its source finds, loaded through an
    admin of their own whose only allowed root is the source's (on the adapter thread)."""
    if options.lora_resolver is None:
        return RegisteredNames(engine)
    source = make_source(options.lora_resolver)
    registrar = AdapterAdmin(engine, AdapterPaths([source.root]), thread=admin.thread)
    engine_cores = 1 if engine.config.device == "cuda" else engine.num_threads
    readers = reader_threads(options.lora_resolver_max_loading,
                             len(process_cores()) - engine_cores)  # fmt: skip
    logger.info(
        "adapters found on first use: %d resolved at once, parsed on %d thread(s)",
        options.lora_resolver_max_loading,
        readers,
    )
    return ResolvedAdapters(
        engine,
        source,
        registrar,
        ResolverMetrics(metrics.registry, PREFIX),
        max_adapters=options.lora_resolver_max_adapters,
        max_loading=options.lora_resolver_max_loading,
        host_bytes=options.lora_resolver_host_bytes,
        max_parsing=readers,
    )


def max_request_bytes(options: ApiOptions, limits: RequestLimits) -> int:
    """The largest body read (Flask answers 413 past it): the operator's, else room for a
    prompt at the character bound."""
    if options.max_request_bytes is not None:
        return options.max_request_bytes
    return BYTES_PER_PROMPT_CHAR * (limits.max_prompt_chars or 0) + BODY_EXTRA_BYTES


def create_app(engine, options: ApiOptions | None = None) -> Flask:
    """The Flask app of one inference server around a started engine."""
    options = options or ApiOptions()
    app = Flask("toppings-server")
    ctx = _context(engine, options)
    max_bytes = max_request_bytes(options, ctx.limits)
    app.config["MAX_CONTENT_LENGTH"] = max_bytes

    @app.errorhandler(413)
    def too_large(_: Exception) -> Response:
        return error_response(f"the request body is over this server's limit of {max_bytes} "
                              "bytes (--max-request-bytes)", 413)  # fmt: skip

    app.extensions["toppings"] = ctx.state
    _install_auth(app, options.api_key, options.admin_api_key)
    register_generation(app, ctx)
    register_models(app, ctx)
    register_tokenizer(app, ctx)
    register_observability(app, ctx)
    register_adapters(app, ctx)
    install_error_handlers(app, logger, RequestError)
    return app
