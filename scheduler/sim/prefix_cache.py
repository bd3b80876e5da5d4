"""What each simulated server has cached of conversations, for prefix-aware routing in the
simulator.

A trace request of a conversation (`TraceRequest.prefix_id` >= 0) shares its first
`prefix_tokens` tokens with the conversation's earlier turns. Each server keeps, per
conversation, how many leading tokens it holds KV for (LRU over conversations, bounded by
`capacity_tokens` per server, as a prefix cache evicts its least recently used blocks): a
request prefills only what its server does not hold (`cached`), and leaves its whole prompt
cached (`store`). The same object is the policy's `PrefixSource` (policies.PrefixAware): a
trace has no token ids, so a request's key names its conversation and the tokens it shares,
`PrefixKey((prefix_id, prefix_tokens), SIM_KEY)`, and a server's match is what it holds of
that conversation, up to the tokens shared. The simulated index is always fresh.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from toppings.scheduler.kv_index.prefix_key import PrefixKey
from toppings.scheduler.sim.trace import TraceRequest

SIM_KEY = "sim-conversation"


class SimPrefixCaches:
    """See the module docstring; servers are named by their simulated url."""

    def __init__(self, capacity_tokens: int):
        if capacity_tokens < 1:
            raise ValueError("capacity_tokens must be positive")
        self.capacity_tokens = capacity_tokens
        self.caches: dict[str, OrderedDict[int, int]] = {}
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0

    @staticmethod
    def key(request: TraceRequest) -> PrefixKey | None:
        if request.prefix_id < 0:
            return None
        return PrefixKey((request.prefix_id, request.prefix_tokens), SIM_KEY)

    def matched_tokens(self, key: PrefixKey, urls: Iterable[str]) -> dict[str, int | None]:
        conversation, shared = key.token_ids
        return {u: min(self.caches.get(u, {}).get(conversation, 0), shared) for u in urls}

    def cached(self, url: str, request: TraceRequest) -> int:
        """Tokens of `request`'s prompt that `url` holds (the last one is always computed)."""
        cache = self.caches.setdefault(url, OrderedDict())
        held = cache.get(request.prefix_id, 0) if request.prefix_id >= 0 else 0
        if held:
            cache.move_to_end(request.prefix_id)
        tokens = min(held, request.prefix_tokens, request.prompt_tokens - 1)
        self.num_prompt_tokens += request.prompt_tokens
        self.num_cached_tokens += tokens
        return tokens

    def store(self, url: str, request: TraceRequest) -> None:
        """`request`'s prompt is now cached on `url`; least recently used conversations go
        while the server holds more than its capacity."""
        if request.prefix_id < 0:
            return
        cache = self.caches.setdefault(url, OrderedDict())
        cache[request.prefix_id] = max(cache.get(request.prefix_id, 0), request.prompt_tokens)
        cache.move_to_end(request.prefix_id)
        while sum(cache.values()) > self.capacity_tokens and len(cache) > 1:
            cache.popitem(last=False)

    def hit_rate(self) -> float:
        """Prompt tokens served from the caches, as a fraction of all prompt tokens."""
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0
