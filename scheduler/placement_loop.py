"""The scheduler's periodic hook: `policy.tick` on the live cluster, and LoRAServe's routing
table written to the registry whenever a placement step changed it.

Runs every `period_s` (the /stats refresh period) so that a server that died is noticed within
one period (loraserve re-places its adapters at once); the placement itself runs only every
`--placement-interval-s` (see scheduler/loraserve.py). The universe of adapters is the
registry's active adapters. On start, the last routing table in the registry (or, when there
is none, where the adapters are: the servers' hosting) becomes the previous placement, so that
the first step moves as little as it can. After each new table, `sync` (scheduler/adapter_sync.py)
has the servers fetch the adapters of their rows and drop the others.
"""

from __future__ import annotations

import logging
import threading
import time

from toppings.scheduler.adapter_sync import AdapterSync
from toppings.scheduler.cluster import Cluster
from toppings.scheduler.policies import Policy
from toppings.scheduler.registry import Registry, RegistryError

log = logging.getLogger(__name__)


class PlacementLoop:
    def __init__(
        self,
        policy: Policy,
        cluster: Cluster,
        registry: Registry,
        period_s: float,
        sync: AdapterSync | None = None,
    ):
        if period_s <= 0:
            raise ValueError("period_s must be positive")
        self.policy = policy
        self.cluster = cluster
        self.registry = registry
        self.period_s = period_s
        self.placer = getattr(policy, "placer", None)  # loraserve policies only
        self.sync = sync
        if self.placer is not None:
            self.placer.assignment = registry.routes() or _hosting_as_assignment(registry)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self, now_s: float | None = None) -> bool:
        """One tick; True when it wrote a new routing table."""
        adapters = {a.name: a.rank for a in self.registry.list_adapters() if a.state == "active"}
        before = self.placer.version if self.placer is not None else None
        now_s = time.monotonic() if now_s is None else now_s
        self.policy.tick(now_s, self.cluster.states(), adapters)
        if self.placer is None or self.placer.version == before:
            return False
        rows = [(r.adapter, r.server, r.probability) for r in self.placer.routes()]
        try:
            self.registry.put_routes(rows, self.placer.version)
        except RegistryError as exc:  # a server or adapter removed meanwhile: next step
            log.warning("routing table of step %d not recorded: %s", self.placer.version, exc)
            return False
        if self.sync is not None:
            self.sync.sync(self.placer.assignment)
        return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="placement", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.run_once()
            except Exception:  # never let the loop die; the next tick retries
                log.exception("placement tick failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _hosting_as_assignment(registry: Registry) -> dict[str, dict[str, float]]:
    """Where the adapters are, as a placement (equal shares over each adapter's hosts)."""
    hosts: dict[str, list[str]] = {}
    for url, names in registry.hosting().items():
        for name in names:
            hosts.setdefault(name, []).append(url)
    return {name: {u: 1.0 / len(urls) for u in urls} for name, urls in hosts.items()}
