"""`toppings-scheduler`'s command line, generated from settings classes (server.settings), as
toppings-serve's is.

Three groups: the command's own `SchedulerSettings` (registry, logging, and the HTTP front it
shares with toppings-serve, server.http.listen), the keys (`AccessSettings`) and the routing
(`RoutingSettings`). Each is validated as `parse_settings` builds it, before the registry opens
or a model loads; a check that concerns one policy only (the prefix-aware weights, LoRAServe's
interval) runs only with that policy, so the others accept what they never read.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from toppings.scheduler.app import DEFAULT_MAX_IN_FLIGHT
from toppings.scheduler.kv_index.feeds import DEFAULT_STALE_S
from toppings.scheduler.loraserve import PlacementConfig
from toppings.scheduler.policies import POLICIES, LoRAServe, PrefixAware, PrefixWeights
from toppings.server.http.listen import ListenSettings
from toppings.server.settings import (
    Bound,
    Flag,
    Settings,
    build,
    command_parser,
    log_level,
    positive,
    setting,
)


@dataclass(frozen=True, kw_only=True)
class SchedulerSettings(ListenSettings):
    """Where the registry lives, where the scheduler listens, how much it proxies at once."""

    title = "scheduler"

    registry: str = setting(flag=Flag("SQLite registry file (created if new)"))
    port: int = setting(8000, flag=Flag("0 picks a free port", type=int))
    max_concurrent_requests: int = setting(
        DEFAULT_MAX_IN_FLIGHT,
        bound=Bound.POSITIVE,
        flag=Flag(
            "proxied requests in flight past which a request gets 429 with Retry-After, one "
            "model (an adapter or a base model) at most 3/4 of them, the rest kept for the "
            "others; waitress runs a thread for each",
            type=positive,
            metavar="N",
        ),
    )
    log_level: str = setting("INFO", flag=Flag("DEBUG, INFO, WARNING or ERROR", type=log_level))


@dataclass(frozen=True)
class AccessSettings(Settings):
    """Who may call the scheduler, and the key it sends to the servers."""

    title = "keys"

    api_key: str | None = setting(
        None,
        flag=Flag(
            "clients must send `Authorization: Bearer KEY` on every path but /health (not "
            "/admin, which takes --admin-api-key); default $TOPPINGS_SCHEDULER_API_KEY",
            env="TOPPINGS_SCHEDULER_API_KEY",
        ),
    )
    admin_api_key: str | None = setting(
        None,
        flag=Flag(
            "/admin/* wants `Authorization: Bearer KEY`; without it /admin/* answers clients on "
            "this host only; default $TOPPINGS_ADMIN_API_KEY",
            env="TOPPINGS_ADMIN_API_KEY",
        ),
    )
    server_api_key: str | None = setting(
        None,
        flag=Flag(
            "bearer key of the servers, sent only to the servers registered: their "
            "--admin-api-key where they have one (it opens adapter load and unload too), else "
            "their --api-key; default $TOPPINGS_SERVER_ADMIN_API_KEY, then $TOPPINGS_API_KEY (the "
            "servers' own variables: one environment serves both)",
            env=("TOPPINGS_SERVER_ADMIN_API_KEY", "TOPPINGS_API_KEY"),
        ),
    )

    def check(self) -> None:
        if "" in (self.api_key, self.admin_api_key, self.server_api_key):
            raise ValueError(
                "an empty key: --api-key, --admin-api-key and --server-api-key want a value"
            )


@dataclass(frozen=True)
class RoutingSettings(Settings):
    """Which server each request goes to: the policy, its latency models and its SLO."""

    title = "routing"

    policy: str = setting(
        "rank-aware",
        choices=tuple(sorted(POLICIES)),
        flag=Flag(
            "how a request's server is chosen: rank-aware (Toppings' Algorithm 1: the fitted "
            "latency models' cost), prefix-aware (rank-aware plus each server's cached prefix, "
            "from its KV events; text prompts need --tokenizer), loraserve (LoRAServe's "
            "placement and routing; loraserve-group and loraserve-row its ablations), or the "
            "baselines least-loaded, first-fit, random"
        ),
    )
    perf_model: str | None = setting(
        None, flag=Flag("perf-model JSON from bench/fit_perf_model.py")
    )
    slo_tpt_ms: float | None = setting(
        None,
        flag=Flag(
            "SLO on time per token, bounding the predicted decode latency (default: 1.5x the "
            "perf model's decode iteration of one request without LoRA)",
            type=float,
        ),
    )
    placement_interval_s: float = setting(
        PlacementConfig.interval_s,
        flag=Flag(
            "loraserve: seconds between placement steps (a dead server re-places at once)",
            type=float,
        ),
    )
    refresh_ms: float = setting(100.0, flag=Flag("/stats polling period", type=float))
    seed: int = setting(0, flag=Flag("seed of the random policy", type=int))
    tokenizer: str | None = setting(
        None,
        flag=Flag(
            "the base model's Hugging Face directory: count prompt tokens exactly (default: "
            "estimate them from characters)",
            metavar="DIR",
        ),
    )
    prefix_weight: float = setting(
        PrefixWeights.prefix,
        flag=Flag(
            "prefix-aware: weight of the prefill a server's cached prefix saves the request "
            "(1: its predicted milliseconds; 0: the events are followed but not used)",
            type=float,
            metavar="W",
        ),
    )
    kv_index_stale_s: float = setting(
        DEFAULT_STALE_S,
        flag=Flag(
            "prefix-aware: a server whose KV events lag what its /stats says it published for "
            "longer than this counts as holding an unknown prefix",
            type=float,
            metavar="S",
        ),
    )

    def check(self) -> None:
        if self.is_prefix_aware and (self.kv_index_stale_s <= 0 or self.prefix_weight < 0):
            raise ValueError("--kv-index-stale-s must be positive, --prefix-weight not negative")
        if self.places_adapters and self.placement_interval_s <= 0:
            raise ValueError("--placement-interval-s must be positive")

    @property
    def is_prefix_aware(self) -> bool:
        """Whether the policy follows the servers' KV events."""
        return issubclass(POLICIES[self.policy], PrefixAware)

    @property
    def places_adapters(self) -> bool:
        """Whether the policy moves adapters between servers (LoRAServe's placement loop)."""
        return issubclass(POLICIES[self.policy], LoRAServe)


# Every settings class whose fields are flags of toppings-scheduler, in --help's order.
SETTINGS_CLASSES: tuple[type[Settings], ...] = (SchedulerSettings, AccessSettings, RoutingSettings)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `toppings-scheduler` (docs/flags.md is generated from the same classes)."""
    return command_parser(
        "toppings-scheduler", "The cluster scheduler, served by waitress.", SETTINGS_CLASSES
    )


def parse_settings(
    args: argparse.Namespace,
) -> tuple[SchedulerSettings, AccessSettings, RoutingSettings]:
    """The three parts from the parsed flags; raises ValueError naming what is out of range."""
    return build(SchedulerSettings, args), build(AccessSettings, args), build(RoutingSettings, args)
