"""What the server's route groups share: one `ApiContext` built by `create_app`.

Each group (server.api.openai.generation, server.api.openai.models, server.api.admin.routes,
the observability routes of server.api.app) registers its routes given this context and reads
only the fields it needs, so no route depends on another group's state. `ServerState` is the
part the command line and tests also reach (`app.extensions["toppings"]`): the in-flight limit,
the metrics and the drain flag.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

from flask import request

from toppings.server.api.admin.lifecycle import AdapterAdmin
from toppings.server.api.admin.peer_fetch import PeerFetcher
from toppings.server.api.metrics import ServerMetrics
from toppings.server.api.openai.choices import RequestLimits
from toppings.server.api.openai.logprobs import TokenText
from toppings.server.api.tokenizer_pool import TokenizerPool
from toppings.server.engine.client import EngineClient
from toppings.server.http.frontend import InFlightLimit, Slot
from toppings.server.requests.errors import (
    RETRY_AFTER_S,
    TOO_MANY_REQUESTS,
    UNAVAILABLE,
    parse_json_object,
    too_many_requests,
)
from toppings.server.requests.request import RequestError
from toppings.server.resolver.names import AdapterNames


@dataclass
class ServerState:
    """Per-app state the command line and tests reach: the in-flight limit, the logprob entries
    the answers in flight may hold (`choices.LOGPROB_ENTRIES_IN_FLIGHT`), metrics, drain flag."""

    in_flight: InFlightLimit
    logprobs: InFlightLimit
    metrics: ServerMetrics
    draining: threading.Event = dataclasses.field(default_factory=threading.Event)

    def take_slot(self) -> Slot:
        """A place in flight for one generation request; a 429 with Retry-After past the limit
        (a 503 with Retry-After while draining: another replica may take it, this one not)."""
        if self.draining.is_set():
            raise RequestError("the server is draining", 503, UNAVAILABLE,
                               retry_after_s=RETRY_AFTER_S)  # fmt: skip
        slot = self.in_flight.try_acquire()
        if slot is None:
            raise RequestError(too_many_requests(self.in_flight.max_in_flight), 429,
                               TOO_MANY_REQUESTS, retry_after_s=RETRY_AFTER_S)  # fmt: skip
        return slot

    def assign_tenant(self, slot: Slot, adapter: str | None) -> None:
        """Count `slot` as its adapter's (None: the base model's), a tenant of its own; a 429
        with Retry-After when that adapter holds its whole share of the places in flight
        (frontend.TENANT_SHARE: the rest is kept for the others)."""
        who = f"adapter {adapter!r}" if adapter else "the base model"
        refused = self.in_flight.assign(slot, adapter or "", who)
        if refused is not None:
            raise RequestError(refused, 429, TOO_MANY_REQUESTS, retry_after_s=RETRY_AFTER_S)

    def charge_logprobs(self, entries: int) -> Slot:
        """An answer's logprob entries (`choices.logprob_entries`, 0 for none) charged to the
        process's budget until it is written; a 429 with Retry-After while the answers in
        flight hold too much of it."""
        charge = self.logprobs.try_acquire(entries)
        if charge is None:
            held, most = self.logprobs.num_in_flight, self.logprobs.max_in_flight
            raise RequestError(
                f"the answers in flight hold {held} of the {most} logprob entries this process "
                f"holds at once, and this one asks for {entries}; retry after the Retry-After "
                f"delay", 429, TOO_MANY_REQUESTS, retry_after_s=RETRY_AFTER_S,
            )  # fmt: skip
        return charge


@dataclass(frozen=True)
class ApiContext:
    """What the routes use: the engine, the per-app state and the helpers built from the options.

    `tokenizers` lends the generation and tokenizer routes (handlers run on many waitress
    threads) copies of the engine's tokenizer, one thread per copy (server.api.tokenizer_pool);
    `started` is the creation time that `/v1/models` reports; `fetcher` is None unless the
    operator gave an adapter store; `names` resolves a request's adapter name (registered
    names, and with --lora-resolver names found on first use: server.resolver).
    """

    engine: EngineClient
    state: ServerState
    limits: RequestLimits
    token_text: TokenText
    admin: AdapterAdmin
    names: AdapterNames
    fetcher: PeerFetcher | None
    tokenizers: TokenizerPool
    started: int


def json_body() -> dict:
    """The request's JSON object; a 400 when the body is not one."""
    try:
        return parse_json_object(request.get_data())
    except ValueError as e:
        raise RequestError(str(e)) from e
