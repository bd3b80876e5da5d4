"""Prometheus metrics of the scheduler, in its own registry (never the global one).

Names mirror the server's (`toppings:` in server/api/metrics.py) under the prefix
`toppings_scheduler:`. Routing decisions and outcomes are observed by the router and the app;
registry sizes and requests in flight are read at scrape time from the cluster and registry.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from toppings.server.http.metrics import new_registry

PREFIX = "toppings_scheduler:"
DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                    0.1, 0.25, 0.5, 1.0)  # fmt: skip
# How a proxied request ended: answered 2xx, answered otherwise, or cut before its end.
OUTCOMES = ("success", "error", "disconnected")


class ClusterCollector:
    """Registry sizes and requests in flight, read at scrape time."""

    def __init__(self, cluster, registry):
        self.cluster = cluster
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        servers = self.cluster.describe()
        yield GaugeMetricFamily(PREFIX + "servers", "Servers known", value=len(servers))
        yield GaugeMetricFamily(PREFIX + "servers_healthy", "Servers healthy now",
                                value=sum(1 for s in servers if s["healthy"]))  # fmt: skip
        yield GaugeMetricFamily(PREFIX + "adapters", "Adapters in the registry",
                                value=len(self.registry.list_adapters()))  # fmt: skip
        in_flight = GaugeMetricFamily(PREFIX + "num_requests_in_flight",
                                      "Requests proxied and not finished, by server",
                                      labels=["server"])  # fmt: skip
        for s in servers:
            in_flight.add_metric([s["url"]], s["in_flight"])
        yield in_flight


class SchedulerMetrics:
    """The registry of one scheduler app."""

    def __init__(self, cluster, registry):
        self.registry = new_registry()  # its /metrics route: server.http.metrics
        p = PREFIX
        self.routed = Counter(p + "requests_routed", "Requests sent to a server, by policy",
                              ["server", "policy"], registry=self.registry)  # fmt: skip
        self.finished = Counter(p + "requests_finished",
                                "Proxied requests ended, by outcome and server status",
                                ["outcome", "status"], registry=self.registry)  # fmt: skip
        self.decision = Histogram(p + "routing_decision_seconds",
                                  "Time to rank the servers for one request",
                                  buckets=DECISION_BUCKETS, registry=self.registry)  # fmt: skip
        self.registry.register(ClusterCollector(cluster, registry))
