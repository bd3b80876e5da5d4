"""Routing policies: pick a server for a request from the servers' states.

One module per family: base.py (the `Policy` interface), rank_aware.py (Toppings' Algorithm 1),
prefix_aware.py, simple.py (random, first-fit, least-loaded), loraserve.py (LoRAServe and its
ablations). Policies are picked by name from POLICIES; the scheduler and the simulator run the
same objects.
"""

from __future__ import annotations

from typing import Any

from toppings.scheduler.perf_model import PerfModels
from toppings.scheduler.policies.base import (
    DEFAULT_AVG_RESP_LEN,
    KeyedPolicy,
    Policy,
    candidates,
)
from toppings.scheduler.policies.loraserve import LoRAServe, LoRAServeGroup, LoRAServeRow
from toppings.scheduler.policies.prefix_aware import PrefixAware, PrefixSource, PrefixWeights
from toppings.scheduler.policies.rank_aware import RankAware
from toppings.scheduler.policies.simple import FirstFit, LeastLoaded, RandomPolicy

__all__ = [
    "DEFAULT_AVG_RESP_LEN", "POLICIES", "FirstFit", "KeyedPolicy", "LeastLoaded", "LoRAServe",
    "LoRAServeGroup", "LoRAServeRow", "Policy", "PrefixAware", "PrefixSource", "PrefixWeights",
    "RandomPolicy", "RankAware", "candidates", "make_policy",
]  # fmt: skip

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        RankAware,
        PrefixAware,
        RandomPolicy,
        FirstFit,
        LeastLoaded,
        LoRAServe,
        LoRAServeRow,
        LoRAServeGroup,
    )
}


def make_policy(
    name: str,
    perf: PerfModels,
    slo_ms: float,
    avg_resp_len: float = DEFAULT_AVG_RESP_LEN,
    seed: int = 0,
    **options: Any,
) -> Policy:
    """The policy registered under `name` (see POLICIES); `options` go to its class (loraserve:
    `placement=PlacementConfig(...)`; prefix-aware: `prefix=`, `weights=PrefixWeights(...)`)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
    return cls(perf, slo_ms, avg_resp_len, seed, **options)
