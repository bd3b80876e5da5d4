"""What the operator sets for the HTTP layer of one server (flags in the "HTTP API" group)."""

from __future__ import annotations

from argparse import ArgumentTypeError
from dataclasses import dataclass

from toppings.server.resolver.sources import make_source, resolver_spec
from toppings.server.settings import Bound, Flag, Settings, http_origin, positive, setting

ADAPTER_SERIES = ("all", "device", "off")  # --adapter-series (server.api.protocol_metrics)


@dataclass(frozen=True)
class ApiOptions(Settings):
    """Who may call the HTTP API and how much one request or all of them together may take.

    None: no key, no limit (without an admin key the operator's routes take the client key, as
    every other route); `max_concurrent_requests` None means frontend.default_max_in_flight
    (4x the batch).
    """

    title = "HTTP API"

    api_key: str | None = setting(
        None,
        flag=Flag(
            "require Authorization: Bearer KEY on every endpoint but /health "
            "(default: $TOPPINGS_API_KEY; prefer the variable, argv is visible to all users)",
            env="TOPPINGS_API_KEY",
        ),
    )
    admin_api_key: str | None = setting(
        None,
        flag=Flag(
            "the key of the operator's routes (adapter load and unload, an adapter's files): with "
            "it they want "
            "Authorization: Bearer ADMIN_KEY and the --api-key no longer opens them; the admin "
            "key also opens every other route (give it to the scheduler as its "
            "--server-api-key). Default: $TOPPINGS_SERVER_ADMIN_API_KEY",
            env="TOPPINGS_SERVER_ADMIN_API_KEY",
        ),
    )
    max_prompt_tokens: int | None = setting(
        None,
        bound=Bound.POSITIVE,
        flag=Flag(
            "longest prompt accepted (default: the context); longer is a 400",
            type=positive,
            metavar="N",
        ),  # fmt: skip
    )
    max_new_tokens_limit: int | None = setting(
        None,
        bound=Bound.POSITIVE,
        flag=Flag(
            "largest max_tokens a request may ask for (a default max_tokens is cut to it)",
            type=positive,
            metavar="N",
        ),
    )
    # Bytes of one request body; None: sized from the prompt's character bound (server.api.app).
    max_request_bytes: int | None = setting(
        None,
        bound=Bound.POSITIVE,
        flag=Flag(
            "largest request body in bytes; a larger one gets 413 before it is read (default: "
            "4 bytes per character of the longest prompt that can fit, plus 1 MiB)",
            type=positive,
            metavar="N",
        ),
    )
    # Generation requests in flight, queued included.
    max_concurrent_requests: int | None = setting(
        None,
        bound=Bound.POSITIVE,
        flag=Flag(
            "generation requests in flight (running or queued) past which a request gets 429 "
            "with Retry-After, one adapter (or the base model) at most 3/4 of them, the rest "
            "kept for the others; waitress runs a thread for each (default: 4x "
            "--max-batch-size)",
            type=positive,
            metavar="N",
        ),
    )
    # Which adapters get series of their own on /metrics (server.api.protocol_metrics).
    adapter_series: str = setting(
        "all",
        choices=ADAPTER_SERIES,
        flag=Flag(
            "which registered adapters /metrics gives series of their own "
            "(vllm:lora_adapter_loaded, toppings:lora_adapter_state; two each): all, only those "
            "on the device or loading there (as many as its adapter memory holds: bounded by "
            "--adapter-cache-bytes, every adapter used so far where that is unbounded), or "
            "off; the counts by residency are there whatever this says"
        ),
    )
    # Where adapters fetched from peers go; None: no fetching.
    adapter_store: str | None = setting(
        None,
        flag=Flag(
            "LoRAServe's adapter pool: adapters fetched from peer servers are written under DIR "
            "(/v1/load_lora_adapter with 'peers'); without it this server fetches nothing",
            metavar="DIR",
        ),
    )
    # The only servers adapters are fetched from (and sent the admin key, else the API key), as
    # http://HOST:PORT.
    peers: tuple[str, ...] = setting(
        (),
        flag=Flag(
            "a server this one may fetch adapters from, as http://HOST:PORT (repeatable); a "
            "load naming any other peer gets 400, and only these are sent the --api-key. List "
            "every server the scheduler may name as a holder",
            name="--peer",
            type=http_origin,
            metavar="URL",
            action="append",
            parse=tuple,
        ),
    )
    # The most one fetch from peers may take, every peer and byte together.
    peer_fetch_timeout_s: float = setting(
        120.0,
        bound=Bound.POSITIVE,
        flag=Flag(
            "the most one adapter fetch from peers may take in seconds, all peers and bytes "
            "together (a peer trickling bytes included); past it the load gets 504",
            type=float,
            metavar="S",
        ),
    )
    # Where a request's unregistered adapter name is looked up (server.resolver); None: nowhere.
    lora_resolver: str | None = setting(
        None,
        flag=Flag(
            "load an adapter a request names but nobody registered on its first use, from "
            "KIND:ARG; dir:PATH looks for the PEFT directory PATH/<name> (one path component), "
            "checked as /v1/load_lora_adapter checks a path under an allowed root. Concurrent "
            "first requests for a name share one load",
            type=resolver_spec,
            metavar="KIND:ARG",
        ),
    )
    lora_resolver_max_adapters: int = setting(
        64,
        bound=Bound.POSITIVE,
        flag=Flag(
            "resolved adapters registered at once; past it the least recently used one that no "
            "request holds is unloaded (while every one is held, a load waits for one up to 30 s, "
            "then 503 with Retry-After). Adapters "
            "of --lora, --lora-dir and /v1/load_lora_adapter are never unloaded by the resolver",
            type=positive,
            metavar="N",
        ),
    )
    lora_resolver_max_loading: int = setting(
        4,
        bound=Bound.POSITIVE,
        flag=Flag(
            "adapter names resolved at once (each waits on a load; their files are fetched "
            "beside each other, then parsed on at most as many threads as the engine leaves "
            "cores); a request for one more waits for one of them to end (30 s at most), "
            "then gets 503 with Retry-After",
            type=positive,
            metavar="N",
        ),
    )
    lora_resolver_host_bytes: int = setting(
        1 << 30,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "host memory for resolved adapters the resolver unloaded (their checked tensors, "
            "least recently unloaded out first): resolving one again while its files are "
            "unchanged reads nothing. 0 keeps none",
            type=int,
            metavar="N",
        ),
    )
    # Directories /v1/load_lora_adapter may read from (the command line's --lora-dir and
    # --allowed-lora-root).
    lora_roots: tuple[str, ...] = setting(())
    # The text of the command line's --chat-template (server.chat_template.file); None: the
    # checkpoint's own template.
    chat_template: str | None = setting(None)

    def check(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty")
        if self.admin_api_key is not None and not self.admin_api_key:
            raise ValueError("admin_api_key must not be empty")
        if self.lora_resolver is not None:
            make_source(self.lora_resolver)  # a bad kind or a missing directory: ValueError
        for peer in self.peers:
            try:
                http_origin(peer)
            except ArgumentTypeError as exc:
                raise ValueError(f"peers: {exc}") from None
