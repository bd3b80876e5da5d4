"""The queue policies by name (`--queue-policy`; config.QUEUE_POLICIES lists the names)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from toppings.server.sched.chameleon import ChameleonQueue
from toppings.server.sched.queueing import FcfsQueue, QueuePolicy

if TYPE_CHECKING:
    from toppings.server.config import EngineConfig

QUEUE_POLICIES: dict[str, type[QueuePolicy]] = {
    FcfsQueue.name: FcfsQueue,
    ChameleonQueue.name: ChameleonQueue,
}


def make_queue_policy(config: EngineConfig) -> QueuePolicy:
    return QUEUE_POLICIES[config.queue_policy](config)
