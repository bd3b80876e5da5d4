"""Fixtures of the scheduler tests: the scheduler's parts over stand-in servers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from toppings.scheduler.cluster import Cluster
from toppings.scheduler.paper_models import paper_fig6_models
from toppings.scheduler.policies import make_policy
from toppings.scheduler.registry import Registry
from toppings.scheduler.router import Router


class SchedulerParts(NamedTuple):
    """What a test builds the scheduler's app from (`create_app(router, cluster, ...)`)."""

    registry: Registry
    cluster: Cluster
    router: Router


@contextlib.contextmanager
def _scheduler_parts(
    root: Path, fetch_json: Callable[[str], dict], session: Any = None
) -> Iterator[SchedulerParts]:
    """A registry at root/reg.sqlite, a cluster that polls servers through fetch_json (URL ->
    JSON answer), and a router with rank-aware routing on the paper's Figure 6 models that
    calls servers through session (a ServerSession or a stand-in with its `post`; default: the
    router's own, without a key); on exit the cluster stops and the registry closes."""
    registry = Registry(root / "reg.sqlite")
    cluster = Cluster(registry, fetch_json)
    policy = make_policy("rank-aware", paper_fig6_models(), 50.0)
    router = Router(registry, cluster, policy, session=session)
    try:
        yield SchedulerParts(registry, cluster, router)
    finally:
        cluster.stop()
        registry.close()


@pytest.fixture(scope="session")
def scheduler_parts() -> Callable[..., contextlib.AbstractContextManager[SchedulerParts]]:
    """`with scheduler_parts(root, fetch_json, session) as (registry, cluster, router):` the
    scheduler's parts over stand-in servers, stopped and closed when the block ends."""
    return _scheduler_parts
