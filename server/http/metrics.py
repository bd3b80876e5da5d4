"""The one `/metrics` route of every HTTP front (toppings-serve and toppings-scheduler).

Each app keeps its series in a registry of its own (never prometheus-client's global one, so
that two apps in one process never share a series); `install_metrics` serves that registry in
Prometheus' text format at `GET /metrics` and counts every answer of the app by endpoint and
status under the app's prefix (`toppings:http_requests`, `toppings_scheduler:http_requests`).
What each app measures stays its own (server.api.metrics, scheduler.metrics).
"""

from __future__ import annotations

from flask import Flask, Response, request
from prometheus_client import CollectorRegistry, Counter, disable_created_metrics
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST


def new_registry() -> CollectorRegistry:
    """An app's own registry. No *_created series (a timestamp per counter that dashboards do
    not use): a process-wide setting of prometheus-client, so it is made before any metric."""
    disable_created_metrics()
    return CollectorRegistry()


def install_metrics(app: Flask, registry: CollectorRegistry, prefix: str) -> Counter:
    """`GET /metrics` on `app`, rendering `registry`; returns the counter of the app's answers
    (`PREFIX + http_requests`, by endpoint and status), registered in `registry`."""
    answers = Counter(prefix + "http_requests", "HTTP requests answered, by endpoint and status",
                      ["endpoint", "status"], registry=registry)  # fmt: skip

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), content_type=CONTENT_TYPE)

    @app.after_request
    def count(response: Response) -> Response:
        endpoint = request.url_rule.endpoint if request.url_rule else "unmatched"
        answers.labels(endpoint, str(response.status_code)).inc()
        return response

    return answers
