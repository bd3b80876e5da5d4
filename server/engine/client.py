"""How the API sees an engine: the `EngineClient` protocol (server.engine.engine.Engine is one).

The HTTP routes resolve adapter names into references, submit generation requests and aborts,
manage adapters, read the model's identity and the engine's reports, and drain or stop it;
nothing else of the engine."""

from __future__ import annotations

from typing import Any, Protocol

from toppings.gpu_lora.host_memory import ContentKey
from toppings.gpu_lora.peft.adapter import LoraAdapter
from toppings.server.config import EngineConfig
from toppings.server.model.config import ModelConfig
from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.engine_counters import EngineCounters
from toppings.server.requests.request import GenerationRequest, RequestHandle
from toppings.server.requests.stats_schema import ServerStats


class EngineClient(Protocol):
    """An engine as the API uses it (see the module docstring)."""

    config: EngineConfig
    model_name: str
    model_config: ModelConfig
    max_model_len: int
    tokenizer: Any  # a Hugging Face tokenizer

    def resolve_adapter(self, name: str | None) -> AdapterRef | None:
        """The reference a request for adapter `name` carries (None: the base model); raises
        RequestError 404 when no adapter has that name."""

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises RequestError when it can never be served."""

    def submit_all(self, requests: list[GenerationRequest]) -> list[RequestHandle]:
        """Queue requests together (they share a prefill step), or none."""

    def abort(self, request_id: str) -> None: ...

    def add_adapter(self, name: str, path: str) -> LoraAdapter: ...

    def open_adapter(self, name: str, path: str) -> LoraAdapter:
        """Read and check an adapter directory without registering it (any thread)."""

    def register_adapter(
        self, adapter: LoraAdapter, content: ContentKey | None = None
    ) -> AdapterRef:
        """Register an adapter `open_adapter` read (or `remove_adapter` returned)."""

    def remove_adapter(self, name: str) -> LoraAdapter: ...

    def adapters(self) -> list[dict]:
        """The registered adapters: name, rank, path, target modules."""

    def num_adapters(self) -> int:
        """How many adapters are registered (cheap: no list)."""

    def stats(self, adapters_since: str | None = None) -> ServerStats: ...

    def counters(self) -> EngineCounters: ...

    def is_healthy(self) -> bool: ...

    def drain(self, timeout_s: float) -> bool: ...

    def shutdown(self) -> None: ...
