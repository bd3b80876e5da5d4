"""The queue policy classes by name (`--queue-policy`; config.QUEUE_POLICIES lists the names)."""

from __future__ import annotations

from toppings.server.config import EngineConfig
from toppings.server.sched.chameleon import ChameleonQueue
from toppings.server.sched.queueing import FcfsQueue, QueuePolicy

QUEUE_POLICY_CLASSES: dict[str, type[QueuePolicy]] = {
    cls.name: cls for cls in (FcfsQueue, ChameleonQueue)
}


def make_queue_policy(config: EngineConfig) -> QueuePolicy:
    """The queue policy `config.queue_policy` names, sized from `config`."""
    return QUEUE_POLICY_CLASSES[config.queue_policy](config)
