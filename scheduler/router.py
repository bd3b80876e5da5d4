"""Place an OpenAI request on a server and forward it, falling back when a server fails.

The policy ranks the servers that serve the request (healthy, same base model, hosting the
adapter). The first is tried; a server that refuses the connection or fails before answering is
marked unhealthy and the next one is tried (a redirect counts as such a failure: it is not
followed, see scheduler.server_session); so is the next one after a 429 (the server is at its
limit of requests in flight: busy, not unhealthy); when no server took it and one of them was
only busy the client gets 429 with Retry-After (a server down beside a busy one is no reason for
a 502: the request can be sent again soon), 503 with Retry-After where one was draining, 502 when
every server failed. A 404 for an adapter goes on to the next server where there is one (the
adapter left that server since its last /stats). Once a server has answered any other status,
its answer goes to the client as is: a 4xx is the client's problem, and a streamed body cannot
be replayed.

Only what routing needs is checked here (the body is a JSON object, the model is known); every
other field is the server's to judge, so that a bad input gets the same answer through the
scheduler as from a server. A body goes to one server unchanged: a list of prompts and `n`
choices are not split across servers (the server batches them); the routing cost counts the
prompt tokens of every prompt, times n. Each attempt counts as in flight on its server from
the moment it is sent until its answer has ended: read whole, failed, or (streamed) closed by
the client at any point, even before the first chunk (see
scheduler.server_session.ProxiedStream).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import requests

from toppings.scheduler.cluster import Cluster
from toppings.scheduler.kv_index.prefix_key import PrefixKey
from toppings.scheduler.metrics import SchedulerMetrics
from toppings.scheduler.policies import Policy
from toppings.scheduler.prompt_tokens import (
    copies,
    estimate_prompt_tokens,
    given_token_ids,
    num_prompts,
    truncation,
)
from toppings.scheduler.registry import Registry
from toppings.scheduler.server_session import LiveStreams, ProxiedStream, ServerSession
from toppings.scheduler.state import RouteRequest, ServerState, hosted_anywhere
from toppings.server.requests.errors import (
    ADAPTER_NAME_RE,
    BAD_GATEWAY,
    INVALID_REQUEST,
    NO_SERVER_AVAILABLE,
    NO_SERVER_READY,
    NOT_FOUND,
    REQUEST_ID_HEADER,
    RETRY_AFTER_S,
    TOO_MANY_REQUESTS,
    UNAVAILABLE,
    unknown_adapter,
)

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 600.0
DEFAULT_MAX_TOKENS = {"completions": 16, "chat": 256, "responses": 256, "native": 16}  # servers'
MAX_TOKENS_KEYS = {"completions": ("max_tokens",), "chat": ("max_completion_tokens", "max_tokens"),
                   "responses": ("max_output_tokens",), "native": ("max_new_tokens",)}  # fmt: skip
UNSEEN_RANK = 16  # the rank routed for an adapter no server has reported yet (a resolver's)
RESP_LEN_EMA = 0.05  # weight of one finished request in the running mean response length


class SchedulerError(Exception):
    """An error answered as `{"error": {"message", "type", "code"}}` with HTTP status `code`."""

    def __init__(
        self,
        message: str,
        code: int = 400,
        error_type: str = INVALID_REQUEST,
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.error_type = error_type
        self.retry_after_s = retry_after_s


JSON_HEADERS = {"Content-Type": "application/json"}


# A server's response headers the client gets through the scheduler too: the request fields the
# server accepted and ignored, and the tool-call format it used (server.api.openai.generation).
PASSED_ON = ("X-Toppings-Ignored-Fields", "X-Toppings-Tool-Format")


@dataclass
class Forwarded:
    """A server's answer: `body` is bytes, or an iterator of chunks when streamed."""

    status: int
    content_type: str
    body: bytes | Iterator[bytes]
    server: str
    headers: tuple[tuple[str, str], ...] = ()  # the server's PASSED_ON headers it sent


class Router:
    """Resolves the requested model, asks the policy, forwards with failover."""

    def __init__(
        self,
        registry: Registry,
        cluster: Cluster,
        policy: Policy,
        count_prompt: Callable[[dict[str, Any]], int] = estimate_prompt_tokens,
        session: ServerSession | None = None,
    ):
        """count_prompt: prompt tokens of a request body (a PromptCounter gives exact counts,
        and the token ids prefix routing hashes; without one, only prompts given as token ids
        are hashed); session: the calls to servers (with the servers' key, if any; default:
        without)."""
        self.registry = registry
        self.cluster = cluster
        self.policy = policy
        self.count_prompt = count_prompt
        self.token_ids: Callable[[dict[str, Any], str], list[int] | None] = getattr(
            count_prompt, "token_ids", given_token_ids
        )
        self.session = session if session is not None else ServerSession(cluster.origins)
        self.streams = LiveStreams()  # the streamed answers being proxied (the drain ends them)
        self.metrics = SchedulerMetrics(cluster, registry)
        self.started = int(time.time())  # the `created` of the model cards, as a server's
        self._choose_lock = threading.Lock()

    def route_request(self, body: dict[str, Any], kind: str) -> RouteRequest:
        """What the policy needs of a request; raises SchedulerError for an unroutable model.

        A missing or malformed model means the base model when the cluster has exactly one (the
        server then uses it, or rejects the field's type). A malformed max_tokens is routed with
        the default and rejected by the server, in the server's words.
        """
        model = body.get("adapter") if kind == "native" else body.get("model")
        if not isinstance(model, str) or not model:
            bases = self.registry.base_models()
            if len(bases) != 1:
                raise SchedulerError("'model' must name an adapter or a base model")
            model = bases[0]
        max_tokens = next((body[k] for k in MAX_TOKENS_KEYS[kind] if body.get(k) is not None), None)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            max_tokens = DEFAULT_MAX_TOKENS[kind]
        adapter, (hosted, found) = self.registry.get_adapter(model), self.cluster.reach(model)
        resolve = not hosted  # a server that loads adapters on first use may find it
        if adapter is not None and adapter.state == "active":
            count, prefix = self._prompt(body, kind, model)
            return RouteRequest(model, adapter.rank, count, max_tokens, adapter.base_model, prefix,
                                resolve)  # fmt: skip
        if adapter is None and model in self.registry.base_models():
            count, prefix = self._prompt(body, kind, None)
            return RouteRequest(None, 0, count, max_tokens, model, prefix)
        if adapter is not None:
            raise SchedulerError(f"adapter {model!r} is disabled", 404, NOT_FOUND)
        if ADAPTER_NAME_RE.fullmatch(model) and found:
            count, prefix = self._prompt(body, kind, model)  # a name no server reported yet
            return RouteRequest(model, UNSEEN_RANK, count, max_tokens, "", prefix, resolve)
        raise SchedulerError(unknown_adapter(model), 404, NOT_FOUND)

    def _prompt(
        self, body: dict[str, Any], kind: str, adapter: str | None
    ) -> tuple[int, PrefixKey | None]:
        """The prompt's tokens (all prompts, times n; each cut as vLLM's `truncate_prompt_tokens`
        asks) and, when its ids are known, the blocks a server may hold of it under `adapter`
        (an activated one's: the base model's before its invocation, from the servers'
        /stats)."""
        ids, keep = self.token_ids(body, kind), truncation(body)
        if ids is None:  # each prompt cut to its last `keep` tokens, if the body asks
            count = self.count_prompt(body)
            return (count if keep is None else min(count, keep * num_prompts(body) * copies(body)),
                    None)  # fmt: skip
        ids = ids if keep is None else ids[-keep:]
        invocation = self.cluster.invocation_tokens(adapter) if adapter is not None else ()
        return len(ids) * copies(body), PrefixKey.of(ids, adapter, invocation)

    def forward(
        self, path: str, body: dict[str, Any], kind: str, request_id: str | None = None
    ) -> Forwarded:
        """Send `body` to the best ranked server that answers (the next one where a server
        cannot be reached or does not host the adapter); `request_id`: sent on as the server's
        X-Request-Id, so that both processes log the request under one id."""
        request = self.route_request(body, kind)
        began = time.perf_counter()
        with self._choose_lock:  # rank and note atomically, so concurrent requests spread
            states = self.cluster.states()
            ranked = [states[i].url for i in self.policy.order(request, states)]
            if ranked:
                self.cluster.note_routed(ranked[0], self.policy.routed_as(request, ranked[0]))
        self.metrics.decision.observe(time.perf_counter() - began)
        name = request.adapter or request.base_model
        if not ranked and not self._hosted(request, states):
            raise SchedulerError(
                f"{unknown_adapter(name)} on any registered server", 404, NOT_FOUND
            )
        if not ranked:
            raise SchedulerError(f"no healthy server hosts {name!r}", 503, NO_SERVER_AVAILABLE,
                                 retry_after_s=RETRY_AFTER_S)  # fmt: skip
        failures = []
        stream = bool(body.get("stream"))
        try:  # written once for every attempt; a body it cannot write fails no server
            data = json.dumps(body, allow_nan=False, ensure_ascii=False).encode()
        except (TypeError, ValueError) as exc:  # (its parser refused NaN and infinities first)
            raise SchedulerError(f"the body cannot be sent on as JSON: {exc}") from exc
        headers = dict(JSON_HEADERS)
        if request_id is not None:
            headers[REQUEST_ID_HEADER] = request_id
        for attempt, url in enumerate(ranked):
            if attempt:
                with self._choose_lock:
                    self.cluster.note_routed(url, self.policy.routed_as(request, url))
            self.metrics.routed.labels(url, self.policy.name).inc()
            done = _Done(self, url)
            try:
                answer = self.session.post(
                    url + path,
                    data=data,
                    headers=headers,
                    stream=stream,
                    timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
                )
            except requests.RequestException as exc:
                done(None)
                self.cluster.mark_unhealthy(url, f"{path}: {type(exc).__name__}")
                failures.append(f"{url}: {type(exc).__name__}")
                continue
            except BaseException:
                done(None)
                raise
            if answer.status_code in (429, 503):  # this server cannot take it now: next one
                answer.close()
                done(None)
                if answer.status_code == 503:
                    self.cluster.mark_unhealthy(url, f"{path}: 503")
                failures.append(f"{url}: {answer.status_code}")
                continue
            if answer.status_code == 404 and request.adapter is not None:
                self.cluster.resolve_failed(url, request.adapter)
                if attempt + 1 < len(ranked):  # unloaded there since its last /stats: next one
                    answer.close()
                    done(None)
                    continue
            done.status = answer.status_code
            return self._pass_on(answer, url, stream, done)
        listed = "; ".join(failures)
        if any(f.endswith(": 429") for f in failures):  # one is busy, not down: retry later
            raise SchedulerError("no server can take it now (busy, or down): " + listed, 429,
                                 TOO_MANY_REQUESTS, retry_after_s=RETRY_AFTER_S)  # fmt: skip
        if any(f.endswith(": 503") for f in failures):  # draining, or not ready yet
            raise SchedulerError("no server can take it now: " + listed, 503, UNAVAILABLE,
                                 retry_after_s=RETRY_AFTER_S)  # fmt: skip
        raise SchedulerError("every server failed: " + listed, 502, BAD_GATEWAY)

    def check_ready(self) -> None:
        """Raise a 503 with Retry-After while no server is registered."""
        if not self.cluster.urls():
            raise SchedulerError(NO_SERVER_READY, 503, UNAVAILABLE, retry_after_s=RETRY_AFTER_S)

    def _pass_on(
        self,
        answer: requests.Response,
        url: str,
        stream: bool,
        done: Callable[[str | None], None] | None = None,
    ) -> Forwarded:
        """The answer as Forwarded; `done(outcome)` runs exactly once, when the answer ends."""
        done = done or (lambda outcome: None)
        content_type = answer.headers.get("Content-Type", "application/json")
        status = answer.status_code
        headers = tuple((h, answer.headers[h]) for h in PASSED_ON if h in answer.headers)
        if stream and answer.ok:
            chunks = ProxiedStream(answer, self._learn_streamed_length, done, self.streams)
            return Forwarded(status, content_type, chunks, url, headers)
        outcome = "disconnected"  # until the body has been read whole
        try:
            data = answer.content
            outcome = "success" if answer.ok else "error"
        finally:
            answer.close()
            done(outcome)
        if answer.ok:
            self._learn_response_length(data)
        return Forwarded(status, content_type, data, url, headers)

    def _learn_response_length(self, data: bytes) -> None:
        try:
            tokens = json.loads(data)["usage"]["completion_tokens"]
        except (ValueError, KeyError, TypeError):
            return
        if isinstance(tokens, int):
            self._learn_streamed_length(tokens)

    def _learn_streamed_length(self, tokens: int) -> None:
        """Fold one finished response's output length into the policy's average."""
        if tokens > 0:
            mean = self.policy.avg_resp_len
            self.policy.avg_resp_len = (1 - RESP_LEN_EMA) * mean + RESP_LEN_EMA * tokens

    def models(self) -> dict[str, Any]:
        """`GET /v1/models`: the base models registered servers run, then the active adapters
        they host, with `parent`; each card has a server's fields (models_response's)."""

        def card(name: str, parent: str | None) -> dict[str, Any]:
            return {"id": name, "object": "model", "created": self.started,
                    "owned_by": "toppings", "root": name, "parent": parent}  # fmt: skip

        states = self.cluster.states()
        served = {s.base_model for s in states}
        data = [card(name, None) for name in self.registry.base_models() if name in served]
        for a in self.registry.list_adapters():
            if a.state == "active" and hosted_anywhere(states, a.name, a.base_model):
                data.append(card(a.name, a.base_model) | {"rank": a.rank})
        return {"object": "list", "data": data}

    def _hosted(self, request: RouteRequest, states: list[ServerState]) -> bool:
        """Whether a registered server serves the request's model, up or not (hosted_anywhere),
        or the policy would place its adapter (LoRAServe's rows: their servers fetch it)."""
        placer = getattr(self.policy, "placer", None)
        placed = placer is not None and placer.row(request.adapter) is not None
        return placed or hosted_anywhere(states, request.adapter, request.base_model,
                                         request.resolve)  # fmt: skip


class _Done:
    """Ends one attempt exactly once: the server's in-flight count goes back down."""

    def __init__(self, router: Router, url: str):
        self.cluster, self.metrics, self.url = router.cluster, router.metrics, url
        self.status = 0  # the server's HTTP status, once it answered
        self.ended = False
        self.cluster.begin_request(url)

    def __call__(self, outcome: str | None) -> None:
        """outcome: how the answer ended (see metrics.OUTCOMES); None for a failed attempt."""
        if self.ended:
            return
        self.ended = True
        self.cluster.end_request(self.url)
        if outcome is not None:
            self.metrics.finished.labels(outcome, str(self.status)).inc()
