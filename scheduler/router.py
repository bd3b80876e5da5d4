"""Place an OpenAI request on a server and forward it, falling back when a server fails.

The policy ranks the servers that serve the request (healthy, same base model, hosting the
adapter). The first is tried; a server that refuses the connection or fails before answering is
marked unhealthy and the next one is tried. Once a server has answered (any status), its answer
goes to the client as is: a 4xx is the client's problem, and a streamed body cannot be replayed.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from toppings.scheduler.cluster import Cluster
from toppings.scheduler.policies import Policy
from toppings.scheduler.registry import Registry
from toppings.scheduler.state import RouteRequest

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 600.0
CHARS_PER_TOKEN = 4  # no tokenizer here: a rough prompt-length estimate for the perf models
DEFAULT_MAX_TOKENS = {"completions": 16, "chat": 256}  # OpenAI's default, and a chat guess
RESP_LEN_EMA = 0.05  # weight of one finished request in the running mean response length


class SchedulerError(Exception):
    """An error answered as `{"error": {"message", "type", "code"}}` with HTTP status `code`."""

    def __init__(self, message: str, code: int = 400, error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.code = code
        self.error_type = error_type


@dataclass
class Forwarded:
    """A server's answer: `body` is bytes, or an iterator of chunks when streamed."""

    status: int
    content_type: str
    body: bytes | Iterator[bytes]
    server: str


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """Prompt length in tokens, estimated from characters (token ids are counted exactly)."""
    if "messages" in body:
        messages = body["messages"] if isinstance(body["messages"], list) else []
        chars = sum(len(str(m.get("content", ""))) + 16 for m in messages if isinstance(m, dict))
        return max(1, math.ceil(chars / CHARS_PER_TOKEN))
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list):
        text = "".join(map(str, prompt))
    else:
        text = prompt if isinstance(prompt, str) else ""  # the server rejects it
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


class PromptCounter:
    """Exact prompt lengths with the base model's tokenizer (and chat template).

    Costs a tokenization per routed request (well under a millisecond for chat-sized prompts);
    without it the router estimates from characters. A body the tokenizer cannot take falls
    back to the estimate: the server, not the router, reports bad input.
    """

    def __init__(self, tokenizer_dir: str):
        from transformers import AutoTokenizer

        if not Path(tokenizer_dir).is_dir():  # never a hub id: nothing is fetched at run time
            raise ValueError("not a directory")
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)

    def __call__(self, body: dict[str, Any]) -> int:
        try:
            if "messages" in body:
                ids = self.tokenizer.apply_chat_template(
                    body["messages"], add_generation_prompt=True, tokenize=True
                )
                ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # BatchEncoding
                return max(1, len(ids))
            prompt = body.get("prompt", "")
            if isinstance(prompt, str):
                return max(1, len(self.tokenizer.encode(prompt)))
        except Exception:  # malformed messages, a template error: the estimate will do
            pass
        return estimate_prompt_tokens(body)


class Router:
    """Resolves the requested model, asks the policy, forwards with failover."""

    def __init__(
        self,
        registry: Registry,
        cluster: Cluster,
        policy: Policy,
        count_prompt: Callable[[dict[str, Any]], int] = estimate_prompt_tokens,
    ):
        """count_prompt: prompt tokens of a request body (PromptCounter for exact counts)."""
        self.registry = registry
        self.cluster = cluster
        self.policy = policy
        self.count_prompt = count_prompt
        self.session = requests.Session()
        self._choose_lock = threading.Lock()

    def route_request(self, body: dict[str, Any], kind: str) -> RouteRequest:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise SchedulerError("'model' must name an adapter or a base model")
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS[kind]
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise SchedulerError("'max_tokens' must be a positive integer")
        adapter = self.registry.get_adapter(model)
        if adapter is not None and adapter.state == "active":
            return RouteRequest(
                model, adapter.rank, self.count_prompt(body), max_tokens, adapter.base_model
            )
        if adapter is None and model in self.registry.base_models():
            return RouteRequest(None, 0, self.count_prompt(body), max_tokens, model)
        if adapter is not None:
            raise SchedulerError(f"the adapter {model!r} is disabled", 404, "model_not_found")
        raise SchedulerError(f"the model {model!r} does not exist", 404, "model_not_found")

    def forward(self, path: str, body: dict[str, Any], kind: str) -> Forwarded:
        request = self.route_request(body, kind)
        with self._choose_lock:  # rank and note atomically, so concurrent requests spread
            states = self.cluster.states()
            ranked = [states[i].url for i in self.policy.order(request, states)]
            if ranked:
                self.cluster.note_routed(ranked[0], request)
        if not ranked:
            raise SchedulerError(
                f"no healthy server hosts {request.adapter or request.base_model!r}",
                503,
                "no_server_available",
            )
        failures = []
        for attempt, url in enumerate(ranked):
            if attempt:
                self.cluster.note_routed(url, request)
            try:
                answer = self.session.post(
                    url + path,
                    json=body,
                    stream=bool(body.get("stream")),
                    timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
                )
            except requests.RequestException as exc:
                self.cluster.mark_unhealthy(url, f"{path}: {type(exc).__name__}")
                failures.append(f"{url}: {type(exc).__name__}")
                continue
            if answer.status_code == 503:  # the server says it cannot serve now: next one
                answer.close()
                self.cluster.mark_unhealthy(url, f"{path}: 503")
                failures.append(f"{url}: 503")
                continue
            return self._pass_on(answer, url, bool(body.get("stream")))
        raise SchedulerError("every server failed: " + "; ".join(failures), 502, "bad_gateway")

    def _pass_on(self, answer: requests.Response, url: str, stream: bool) -> Forwarded:
        content_type = answer.headers.get("Content-Type", "application/json")
        if stream and answer.ok:
            chunks = _chunks(answer, self._learn_streamed_length)
            return Forwarded(answer.status_code, content_type, chunks, url)
        data = answer.content
        answer.close()
        if answer.ok:
            self._learn_response_length(data)
        return Forwarded(answer.status_code, content_type, data, url)

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
        """`GET /v1/models`: base models, then active adapters with `parent`."""
        data = [
            {"id": name, "object": "model", "owned_by": "toppings", "parent": None}
            for name in self.registry.base_models()
        ]
        for a in self.registry.list_adapters():
            if a.state == "active":
                data.append({"id": a.name, "object": "model", "owned_by": "toppings",
                             "parent": a.base_model, "rank": a.rank})  # fmt: skip
        return {"object": "list", "data": data}


def _chunks(answer: requests.Response, learn: Callable[[int], None]) -> Iterator[bytes]:
    """The SSE body as it arrives; closes the upstream when the client goes away.

    Counts the stream's events as it passes: a server sends one event per output step (about
    one token), so a stream that ends with `data: [DONE]` tells `learn` roughly how many tokens
    it carried (the usage-only event of include_usage counts one too much).
    """
    events, done, tail = 0, False, b""
    try:
        for chunk in answer.iter_content(chunk_size=None):
            seen = tail + chunk  # a marker may straddle two chunks
            # Markers wholly inside the tail were counted with the previous chunk.
            events += seen.count(b"data: ") - tail.count(b"data: ")
            done = done or b"data: [DONE]" in seen
            tail = seen[-11:]  # one byte short of b"data: [DONE]"
            yield chunk
    finally:
        answer.close()
    if done:
        learn(events - 1)
