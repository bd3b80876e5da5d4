"""The inference server's HTTP API: parse a body, submit it to the engine, return JSON or SSE.

Handlers run on waitress worker threads; they only tokenize, call `engine.submit` and read the
requests' output queue, so a slow client never stalls the engine thread. One response may be many
engine requests (n choices, a list of prompts: a `RequestGroup`). A stream whose client goes away
is aborted: waitress closes the response body (`_stream`, started or not), and
`RequestGroup.outputs` checks waitress's disconnect flag after each output and while none
arrives, which also covers non-streaming requests. Unknown routes and methods get the JSON error
of every other endpoint. `/tokenize` and `/detokenize` are vLLM's (see server.api.tokenize).

The generation endpoints share one in-flight limit (server.api.frontend): a request takes a slot
before it is submitted and gives it back when its answer ends, on every path; past the limit it
gets 429 with Retry-After at once. `cli.py` sizes waitress's thread pool from the same limit, so
streams never wait for a thread and the operator endpoints always find one.

Operator endpoints: `/metrics` (Prometheus, see server.api.metrics), `/v1/load_lora_adapter`
and `/v1/unload_lora_adapter` (see server.api.lifecycle; a load naming `peers` fetches the
adapter from them, server.api.peer_fetch), `GET /v1/adapters/NAME/files[/FILE]` (the PEFT files
of an adapter this server holds, for a peer to fetch; server.api.adapter_files). With an API
key every endpoint but `/health` wants `Authorization: Bearer KEY`. While the server drains
(SIGTERM), `/health` answers 503 so that a scheduler stops routing here, and the engine refuses
new requests with 503. The operator's settings are `ApiOptions` (server.api.options).
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from flask import Flask, Response, jsonify, request

from toppings.server.api.adapter_files import FILES, manifest, read_chunks
from toppings.server.api.choices import RequestLimits, build_requests
from toppings.server.api.frontend import InFlightLimit, ReleasingBody, Slot, default_max_in_flight
from toppings.server.api.lifecycle import AdapterAdmin, AdapterPaths
from toppings.server.api.logprobs import TokenText
from toppings.server.api.metrics import CONTENT_TYPE, ServerMetrics
from toppings.server.api.options import ApiOptions
from toppings.server.api.peer_fetch import FetchConfig, PeerFetcher, held_adapter_dir
from toppings.server.api.request_group import RequestGroup
from toppings.server.api.response import (
    SSE_DONE,
    ResponseMeta,
    final_response,
    models_response,
    sse,
    stream_events,
)
from toppings.server.api.schema import ParsedBody, parse_chat, parse_completion, parse_native
from toppings.server.api.tokenize import detokenize, tokenize
from toppings.server.requests.errors import (
    NOT_FOUND,
    RETRY_AFTER_S,
    SERVER_ERROR,
    TOO_MANY_REQUESTS,
    UNAVAILABLE,
    error_body,
    error_response,
    install_error_handlers,
    parse_json_object,
    too_many_requests,
    unknown_adapter,
)
from toppings.server.requests.request import RequestError

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20  # larger bodies get a 413
OPEN_PATHS = frozenset({"/health"})  # answered without an API key (load balancers probe it)


@dataclass
class ServerState:
    """Per-app state the command line and tests reach: in-flight limit, metrics, drain flag."""

    in_flight: InFlightLimit
    metrics: ServerMetrics
    draining: threading.Event = dataclasses.field(default_factory=threading.Event)

    def take_slot(self) -> Slot:
        """A place in flight for one generation request; a 429 with Retry-After past the limit."""
        slot = self.in_flight.try_acquire()
        if slot is None:
            raise RequestError(too_many_requests(self.in_flight.max_in_flight), 429,
                               TOO_MANY_REQUESTS, retry_after_s=RETRY_AFTER_S)  # fmt: skip
        return slot


def _json_body() -> dict:
    try:
        return parse_json_object(request.get_data())
    except ValueError as e:
        raise RequestError(str(e)) from e


def _stream(events: Iterator[str], group: RequestGroup, slot: Slot) -> ReleasingBody:
    """The SSE body; closing it (done, or the client gone) aborts the requests still running
    and gives the slot back, even when the body was never iterated."""
    return ReleasingBody(_sse_or_error(events), group.abort, slot.release)


def _sse_or_error(events: Iterator[str]) -> Iterator[str]:
    try:
        yield from events
    except Exception as e:  # headers are out: the error can only travel in the stream
        logger.exception("a stream failed")
        code = e.code if isinstance(e, RequestError) else 500
        yield sse(error_body(str(e), code, SERVER_ERROR))
        yield SSE_DONE


def _check_key(expected: str) -> None:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), expected):
        raise RequestError("a valid API key is required (Authorization: Bearer KEY)", 401,
                           "authentication_error")  # fmt: skip


def create_app(engine, options: ApiOptions | None = None) -> Flask:
    """The Flask app of one inference server around a started engine."""
    options = options or ApiOptions()
    app = Flask("toppings-server")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    max_in_flight = options.max_concurrent_requests or default_max_in_flight(
        engine.config.max_batch_size
    )
    in_flight = InFlightLimit(max_in_flight)
    state = ServerState(in_flight, ServerMetrics(engine, in_flight))
    app.extensions["toppings"] = state
    admin = AdapterAdmin(engine, AdapterPaths(options.lora_roots))
    fetcher = None
    if options.adapter_store is not None:
        fetcher = PeerFetcher(engine, FetchConfig(options.adapter_store, options.api_key))
    limits = RequestLimits(options.max_prompt_tokens, options.max_new_tokens_limit)
    tokenizer_lock = threading.Lock()
    started = int(time.time())

    token_text = TokenText(engine.tokenizer)

    def generate(parse: Callable[[dict, str], ParsedBody]) -> Response:
        slot = state.take_slot()  # before any work: a refusal costs next to nothing
        try:
            return answer(parse(_json_body(), engine.model_name), slot)
        except BaseException:
            slot.release()  # idempotent; once a stream's body exists, its close() releases too
            raise

    def answer(parsed: ParsedBody, slot: Slot) -> Response:
        with tokenizer_lock:
            reqs, prompt_ids = build_requests(
                parsed,
                engine.tokenizer,
                engine.max_model_len,
                engine.model_config.vocab_size,
                limits,
            )
            echo = tuple(
                p if isinstance(p, str) else engine.tokenizer.decode(p, skip_special_tokens=True)
                for p in (parsed.prompts if parsed.echo else ())
            )
        group = RequestGroup(engine, reqs)
        meta = ResponseMeta.new(parsed, prompt_ids, token_text, echo)
        gone = request.environ.get("waitress.client_disconnected") or (lambda: False)
        on_final = state.metrics.requests.observe_final
        if parsed.stream:
            outputs = group.outputs(gone, on_final)
            events = _stream(stream_events(parsed, meta, outputs), group, slot)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return Response(events, mimetype="text/event-stream", headers=headers)
        try:
            outs = group.results(gone, on_final)
        except BaseException:
            group.abort()
            raise
        finally:
            slot.release()
        failed = next((out for out in outs if out.finish_reason == "error"), None)
        if failed is not None:
            return error_response(failed.error or "generation failed", 500, SERVER_ERROR)
        return jsonify(final_response(parsed, meta, outs))

    app.add_url_rule("/generate", "generate", lambda: generate(parse_native), methods=["POST"])
    app.add_url_rule(
        "/v1/completions", "completions", lambda: generate(parse_completion), methods=["POST"]
    )
    app.add_url_rule("/v1/chat/completions", "chat", lambda: generate(parse_chat), methods=["POST"])

    @app.get("/v1/models")
    def models() -> Response:
        return jsonify(models_response(engine.model_name, engine.adapters(), started))

    @app.get("/v1/models/<path:model_id>")
    def model(model_id: str) -> Response:
        cards = models_response(engine.model_name, engine.adapters(), started)["data"]
        card = next((c for c in cards if c["id"] == model_id), None)
        if card is None:
            raise RequestError(unknown_adapter(model_id), 404, NOT_FOUND)
        return jsonify(card)

    @app.post("/tokenize")
    def tokenize_route() -> Response:
        with tokenizer_lock:
            return jsonify(tokenize(_json_body(), engine))

    @app.post("/detokenize")
    def detokenize_route() -> Response:
        with tokenizer_lock:
            return jsonify(detokenize(_json_body(), engine))

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
            engine.stats(),
            draining=state.draining.is_set(),
            num_in_flight=in_flight.num_in_flight,
            max_concurrent_requests=in_flight.max_in_flight,
        )
        return jsonify(body.to_json())

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(state.metrics.render(), content_type=CONTENT_TYPE)

    @app.post("/v1/load_lora_adapter")
    def load_lora_adapter() -> Response:
        body = _json_body()
        if "peers" not in body:
            return jsonify(admin.load(body))
        if fetcher is None:
            raise RequestError("fetching adapters from peers is disabled: start the server with "
                               "--adapter-store", 403, "permission_denied")  # fmt: skip
        return jsonify(fetcher.load(body))

    @app.get("/v1/adapters/<path:name>/files")
    def adapter_file_list(name: str) -> Response:
        return jsonify(manifest(name, held_adapter_dir(engine, name)))

    @app.get("/v1/adapters/<path:name>/files/<file_name>")
    def adapter_file(name: str, file_name: str) -> Response:
        directory = held_adapter_dir(engine, name)
        if file_name not in FILES:
            raise RequestError(f"{file_name!r} is not an adapter file", 404, NOT_FOUND)
        return Response(read_chunks(directory, file_name), content_type="application/octet-stream")

    @app.post("/v1/unload_lora_adapter")
    def unload_lora_adapter() -> Response:
        return jsonify(admin.unload(_json_body()))

    @app.before_request
    def authenticate() -> None:
        if options.api_key is not None and request.path not in OPEN_PATHS:
            _check_key(options.api_key)

    @app.after_request
    def count(response: Response) -> Response:
        endpoint = request.url_rule.endpoint if request.url_rule else "unmatched"
        state.metrics.requests.observe_http(endpoint, response.status_code)
        return response

    install_error_handlers(app, logger, RequestError)
    return app
