"""The queue policy classes by name (`--queue-policy`; config.QUEUE_POLICIES lists the names)."""

from __future__ import annotations

from toppings.server.config import SchedulingConfig
from toppings.server.sched.chameleon import ChameleonQueue
from toppings.server.sched.queueing import FcfsQueue, QueuePolicy

QUEUE_POLICY_CLASSES: dict[str, type[QueuePolicy]] = {
    cls.name: cls for cls in (FcfsQueue, ChameleonQueue)
}


def make_queue_policy(config: SchedulingConfig, max_total_tokens: int) -> QueuePolicy:
    """The queue policy `config.queue_policy` names, sized from `config` and the KV cache's
    `max_total_tokens` (the memory part's)."""
    return QUEUE_POLICY_CLASSES[config.queue_policy](config, max_total_tokens)
