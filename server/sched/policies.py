"""The queue policy classes by name (`--queue-policy`; config.QUEUE_POLICIES lists the names)."""

from __future__ import annotations

from toppings.server.config import QUEUE_POLICIES, EngineConfig
from toppings.server.sched.chameleon import ChameleonQueue
from toppings.server.sched.queueing import FcfsQueue, QueuePolicy

QUEUE_POLICY_CLASSES: dict[str, type[QueuePolicy]] = {
    cls.name: cls for cls in (FcfsQueue, ChameleonQueue)
}
if tuple(QUEUE_POLICY_CLASSES) != QUEUE_POLICIES:
    raise ImportError(f"queue policy classes {tuple(QUEUE_POLICY_CLASSES)} != {QUEUE_POLICIES}")


def make_queue_policy(config: EngineConfig) -> QueuePolicy:
    """The queue policy `config.queue_policy` names, sized from `config`."""
    return QUEUE_POLICY_CLASSES[config.queue_policy](config)
