"""The `GET /stats` body of a server: one schema, built by the engine, read by the scheduler.

Part of the HTTP contract (DESIGN.md): the scheduler parses it with `ServerStats.from_json`, and
`tests/scheduler/test_stats_contract.py` feeds a live engine's stats through the scheduler's
parser. Imports nothing else of the server, so the scheduler may import it.

    {"model": str, "kernel": "bgmv"|"mbgmv", "device": str, "lora_mode": str,
     "running": [REQ], "queue": [REQ],
     "adapters": [{"name": str, "rank": int, "resident": bool,
                   "state": "device"|"loading"|"host", "pinned": bool,
                   "invocation_tokens": [int]}],
     "free_kv_tokens": int, "max_total_tokens": int,
     "cpu_workers": [{"pid": int, "core": int, "alive": bool, "restarts": int}],
     "healthy": bool, "resident_adapters": [str], "loading_adapters": [str],
     "draining": bool, "num_in_flight": int, "max_concurrent_requests": int,
     "num_device_adapters": int, "num_loading_adapters": int, "num_host_adapters": int,
     "max_device_adapters": int, "adapter_load_seconds": LOAD_TIMES,
     "queueing": QUEUEING, "memory": MEMORY, "kv_events": KV_EVENTS, "lora_resolver": bool,
     "adapters_version": int, "adapters_unchanged": bool}
    (`GET /stats?adapters_since=V`, V an earlier body's adapters_version: while no adapter was
    registered or dropped since, "adapters" is [] and "adapters_unchanged" true.)
    REQ = {"id": str, "adapter": str|null, "rank": int, "prompt_tokens": int,
           "output_tokens": int, "max_new_tokens": int}
    QUEUEING = {"policy": "fcfs"|"chameleon", "queue_lengths": [int], "fair_share": bool,
                "tenants_with_claims": int (adapters whose claims order the queue),
                "kv_admission": "expected"|"worst-case", "preemptions": int, and for
                chameleon "cutoffs": [float], "quotas": [int], "bypasses": int, "squashes": int,
                "reserved": int, "backfilled": int, ...}
    LOAD_TIMES = {"bounds": [float], "cumulative": [int], "sum_s": float, "count": int}
                 (adapter loads, submission to last layer on the device: how many took at most
                 each bound in seconds; "count" all of them)
    MEMORY = {"layout": "pool"|"static", "block_tokens": int, "block_bytes": int,
              "blocks": {"total", "free", "kv_in_use", "kv_cached", "adapters_in_use",
                         "adapters_cached": int}, "host_blocks": {"total", "used": int},
              "reserved_blocks": int, "committed_blocks": int, "prompt_tokens": int,
              "prefix_hit_tokens": int, "swaps_in": int, "swaps_out": int,
              "evictions_kv": int, "evictions_adapter": int}
    KV_EVENTS = {} (no KV cache events) or {"endpoint": str, "replay_endpoint": str|null,
                 "topic": str, "encoding": "array"|"map", "block_size": int, "stream": str,
                 "batches": int, "dropped": int}
                (the server's --kv-events-* addresses as bound, e.g. "tcp://*:5557": a consumer
                puts the server's host for a wildcard one; `stream` names this publisher, a
                new one per server process, so that a consumer sees a restart; `batches`
                published and tree changes `dropped` to a full queue so far)

`invocation_tokens` is an activated LoRA's invocation sequence ([] for any other adapter): a
router hashes such a request's prompt before it as the base model's (server/kv_events).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from enum import Enum
from typing import Any


class Residency(str, Enum):
    """Where a registered adapter is: every layer on the device, on its way there, or in host
    memory only (every registered adapter is in host memory)."""

    DEVICE = "device"
    LOADING = "loading"
    HOST = "host"


@dataclass(frozen=True)
class RequestView:
    """One queued or running request; rank 0 for the base model."""

    id: str
    adapter: str | None
    rank: int
    prompt_tokens: int
    output_tokens: int
    max_new_tokens: int


@dataclass(frozen=True)
class AdapterView:
    """One registered adapter; resident: every layer is on the device (state DEVICE); pinned:
    it cannot leave the device now (a request holds it, its load is running, or the LoRA mode
    keeps every adapter there). A server older than `state` reports HOST for all."""

    name: str
    rank: int
    resident: bool
    state: Residency = Residency.HOST
    pinned: bool = False
    invocation_tokens: tuple[int, ...] = ()  # an activated LoRA's; () for any other

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", Residency(self.state))  # from JSON: a str
        object.__setattr__(self, "invocation_tokens", tuple(int(t) for t in self.invocation_tokens))


@dataclass(frozen=True)
class WorkerView:
    """One CPU LoRA worker process."""

    pid: int
    core: int
    alive: bool
    restarts: int


@dataclass(frozen=True)
class ServerStats:
    """What the cluster scheduler needs of one server, at one instant."""

    model: str
    kernel: str
    device: str
    lora_mode: str
    running: tuple[RequestView, ...]
    queue: tuple[RequestView, ...]
    adapters: tuple[AdapterView, ...]  # () when adapters_unchanged
    free_kv_tokens: int
    max_total_tokens: int
    healthy: bool
    cpu_workers: tuple[WorkerView, ...] = ()
    resident_adapters: tuple[str, ...] = ()
    loading_adapters: tuple[str, ...] = ()
    draining: bool = False
    num_in_flight: int = 0  # generation requests the HTTP front end holds (running or queued)
    max_concurrent_requests: int = 0  # the front end's limit (429 past it); 0: not reported
    # Registered adapters by Residency (they sum to len(adapters)), and how many adapters of the
    # registered ones' mean size the device's adapter memory holds when it holds nothing else.
    num_device_adapters: int = 0
    num_loading_adapters: int = 0
    num_host_adapters: int = 0
    max_device_adapters: int = 0
    adapter_load_seconds: dict[str, Any] = field(default_factory=dict)  # LOAD_TIMES
    queueing: dict[str, Any] = field(default_factory=dict)  # the queue policy's view
    memory: dict[str, Any] = field(default_factory=dict)  # pool blocks by kind, counters
    # host bytes charged to adapters: budget_bytes, charged_bytes, copies, names
    adapter_host_memory: dict[str, Any] = field(default_factory=dict)
    kv_events: dict[str, Any] = field(default_factory=dict)  # KV_EVENTS; {} when off
    lora_resolver: bool = False  # whether it loads an adapter name on first use (--lora-resolver)
    # Moves whenever an adapter is registered or dropped; `GET /stats?adapters_since=V` with the
    # version still V leaves `adapters` out (empty) and says so (`adapters_unchanged`): the
    # residency of each is then in resident_adapters / loading_adapters only.
    adapters_version: int = 0
    adapters_unchanged: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kernel not in ("bgmv", "mbgmv"):
            raise ValueError(f"unknown kernel {self.kernel!r}")

    def to_json(self) -> dict[str, Any]:
        """The JSON body (lists, not tuples, as a client decodes it)."""
        body = asdict(self)
        body.pop("extra")
        return json.loads(json.dumps(body))

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> ServerStats:
        """Parse a /stats body; raises KeyError, TypeError or ValueError when it is malformed.
        Unknown keys (a newer server) are kept in `extra`."""
        if not isinstance(body, dict):
            raise TypeError("/stats must be a JSON object")
        known = {f.name for f in fields(cls)} - {"extra"}
        args: dict[str, Any] = {}
        for name in known:
            if name not in body:
                continue
            value = body[name]
            view = _NESTED.get(name)
            if view is not None:
                value = tuple(view(**_exact(view, item)) for item in value)
            elif name in _NAME_LISTS:
                value = tuple(str(v) for v in value)
            args[name] = value
        extra = {k: v for k, v in body.items() if k not in known}
        return cls(**args, extra=extra)


_NAME_LISTS = ("resident_adapters", "loading_adapters")
_NESTED = {"running": RequestView, "queue": RequestView, "adapters": AdapterView,
           "cpu_workers": WorkerView}  # fmt: skip


def _exact(view: type, item: dict[str, Any]) -> dict[str, Any]:
    """The fields of `view` from one JSON object (unknown keys dropped, missing ones raise
    unless the field has a default: an older server)."""
    if not isinstance(item, dict):
        raise TypeError(f"expected an object for {view.__name__}, got {type(item).__name__}")
    return {
        f.name: item[f.name]
        for f in fields(view)
        if f.name in item or (f.default is MISSING and f.default_factory is MISSING)
    }
