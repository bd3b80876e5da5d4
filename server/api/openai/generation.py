"""The generation routes (`/generate`, `/v1/completions`, `/v1/chat/completions`, and
`/v1/responses` over the chat's: server.api.openai.responses_api) and vLLM's tokenizer routes
(`/tokenize`, `/detokenize`, see server.api.openai.tokenize).

A generation request takes an in-flight slot before any work (past the limit: 429 with
Retry-After at once) and gives it back when its answer ends, on every path. Its text is checked
against the character bound, then tokenized by a copy of the tokenizer that no other thread uses
meanwhile (server.api.tokenizer_pool), submitted as one `RequestGroup` (n choices, a list of
prompts), and answered as one JSON body or as server-sent events. A stream whose client goes
away is aborted: waitress closes the response body (`_stream`, started or not), and
`RequestGroup.outputs` checks waitress's disconnect flag after each output and while none
arrives, which also covers non-streaming requests.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from flask import Flask, Response, jsonify, request

from toppings.server.api.context import ApiContext, json_body
from toppings.server.api.openai.choices import build_requests, logprob_entries
from toppings.server.api.openai.request_group import RequestGroup
from toppings.server.api.openai.response import (
    SSE_DONE,
    ResponseMeta,
    final_response,
    sse,
    stream_events,
)
from toppings.server.api.openai.responses_api import chat_body, input_words
from toppings.server.api.openai.responses_output import Reshaper
from toppings.server.api.openai.schema import (
    IGNORED_HEADER,
    ParsedBody,
    parse_chat,
    parse_completion,
    parse_native,
)
from toppings.server.api.openai.tokenize import detokenize, tokenize
from toppings.server.api.openai.tools import template_renders_tools
from toppings.server.http.frontend import ReleasingBody, Slot
from toppings.server.requests.errors import SERVER_ERROR, error_body, error_response
from toppings.server.requests.request import RequestError, RequestOutput

logger = logging.getLogger(__name__)


def _stream(events: Iterator[str], group: RequestGroup, slot: Slot, charge: Slot) -> ReleasingBody:
    """The SSE body; closing it (done, or the client gone) aborts the requests still running
    and gives the slot and the logprobs' charge back, even when the body was never iterated."""
    return ReleasingBody(_sse_or_error(events), group.abort, slot.release, charge.release)


def _sse_or_error(events: Iterator[str]) -> Iterator[str]:
    try:
        yield from events
    except Exception as e:  # headers are out: the error can only travel in the stream
        logger.exception("a stream failed")
        code = e.code if isinstance(e, RequestError) else 500
        yield sse(error_body(str(e), code, SERVER_ERROR))
        yield SSE_DONE


TOOL_FORMAT_HEADER = "X-Toppings-Tool-Format"
_generic_logged = threading.Event()


def _log_generic_once() -> None:
    if not _generic_logged.is_set():
        _generic_logged.set()
        logger.info("the chat template does not render tools: tool calls use the generic "
                    "format (tools described in a system message, the call read as JSON); "
                    "responses say so in %s", TOOL_FORMAT_HEADER)  # fmt: skip
    else:
        logger.debug("a tool call in the generic format")


@dataclass(frozen=True)
class Held:
    """What a submitted answer holds until it ends: its in-flight slot, its logprobs' charge and
    its requests."""

    slot: Slot
    charge: Slot
    group: RequestGroup


def _respond(
    parsed: ParsedBody, held: Held, meta: ResponseMeta, on_final: Callable[[RequestOutput], None]
) -> Response:
    """The submitted group's answer: a stream (whose body gives the slot and the charge back
    when it closes) or one JSON body (the slot given back when the group has ended, the charge
    when its JSON is made)."""
    gone = request.environ.get("waitress.client_disconnected") or (lambda: False)
    group = held.group
    if parsed.stream:
        outputs = group.outputs(gone, on_final)
        events = _stream(stream_events(parsed, meta, outputs), group, held.slot, held.charge)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return Response(events, mimetype="text/event-stream", headers=headers)
    try:
        try:
            outs = group.results(gone, on_final)
        finally:
            held.slot.release()
        failed = next((out for out in outs if out.finish_reason == "error"), None)
        if failed is not None:
            message = failed.error or "generation failed"
            return error_response(message, failed.error_code, failed.error_type)
        return jsonify(final_response(parsed, meta, outs))
    finally:
        held.charge.release()


def register_generation(app: Flask, ctx: ApiContext) -> None:
    """`/generate`, `/v1/completions` and `/v1/chat/completions`: one parser each, one path."""
    engine, state = ctx.engine, ctx.state

    def generate(parse: Callable[[dict, str], ParsedBody]) -> Response:
        slot = state.take_slot()  # before any work: a refusal costs next to nothing
        try:
            return answer(parse(json_body(), engine.model_name), slot)
        except BaseException:
            slot.release()  # idempotent; once a stream's body exists, its close() releases too
            raise

    def answer(parsed: ParsedBody, slot: Slot) -> Response:
        response = _answer(parsed, slot)
        if parsed.ignored:
            logger.info("%s: ignored %s (they change nothing here)", request.path,
                        ", ".join(parsed.ignored))  # fmt: skip
            response.headers[IGNORED_HEADER] = ", ".join(parsed.ignored)
        if parsed.tools is not None:
            with ctx.tokenizers.borrow() as tokenizer:  # its template is the one in force
                generic = not template_renders_tools(tokenizer)
            if generic:
                response.headers[TOOL_FORMAT_HEADER] = "generic"
                _log_generic_once()
        return response

    def _answer(parsed: ParsedBody, slot: Slot) -> Response:
        with ctx.names.lease() as resolve:  # the adapter stays registered until submitted
            # Resolved before a tokenizer copy is borrowed: a first use may wait on a load.
            adapter = resolve(parsed.adapter)
            state.assign_tenant(slot, adapter.name if adapter else None)
            with ctx.tokenizers.borrow() as tokenizer:
                reqs, prompt_ids = build_requests(
                    parsed, tokenizer, engine.max_model_len, engine.model_config.vocab_size,
                    lambda _: adapter, ctx.limits,
                )  # fmt: skip
                # A prompt of ids echoes every token, special ones too (vLLM's decode): its
                # logprobs list each token, whose text_offset must point into this text.
                echo = tuple(
                    p if isinstance(p, str) else tokenizer.decode(p)
                    for p in (parsed.prompts if parsed.echo else ())
                )
            # the answer's logprobs charged before it is submitted: 429 while others hold them
            charge = state.charge_logprobs(logprob_entries(reqs))
            try:
                group = RequestGroup(engine, reqs)
            except BaseException:
                charge.release()
                raise
        try:
            meta = ResponseMeta.new(parsed, prompt_ids, ctx.token_text, echo)
            on_final = state.metrics.requests.observe_final
            return _respond(parsed, Held(slot, charge, group), meta, on_final)
        except BaseException:  # idempotent: a stream's body, once made, gives them back too
            group.abort()
            charge.release()
            raise

    app.add_url_rule("/generate", "generate", lambda: generate(parse_native), methods=["POST"])
    app.add_url_rule(
        "/v1/completions", "completions", lambda: generate(parse_completion), methods=["POST"]
    )
    app.add_url_rule("/v1/chat/completions", "chat", lambda: generate(parse_chat), methods=["POST"])

    @app.post("/v1/responses")
    def responses() -> Response:  # the chat path, its answer reshaped (responses_api.py)
        slot = state.take_slot()
        try:
            body = json_body()
            shape = Reshaper(body)
            try:
                return shape.answer(answer(parse_chat(chat_body(body), engine.model_name), slot))
            except RequestError as exc:  # named in the body's words
                raise input_words(exc, body) from None
        except BaseException:
            slot.release()
            raise


def register_tokenizer(app: Flask, ctx: ApiContext) -> None:
    """`/tokenize` (on a borrowed tokenizer copy, as generation) and `/detokenize` (on the
    engine's tokenizer: decoding sets no tokenizer state)."""

    @app.post("/tokenize")
    def tokenize_route() -> Response:
        body = json_body()
        with ctx.tokenizers.borrow() as tokenizer:
            return jsonify(tokenize(body, ctx.engine, tokenizer, ctx.limits))

    @app.post("/detokenize")
    def detokenize_route() -> Response:
        return jsonify(detokenize(json_body(), ctx.engine))
