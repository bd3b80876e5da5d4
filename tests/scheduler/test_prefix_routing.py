"""Prefix-aware routing without servers: the prefix key (an activated adapter's prompt hashed as
the base model's before its invocation), the feeds' freshness (unknown until exact, after a
loss, and when the index lags what a server published), the endpoint a wildcard bind means, and
the policy's order (a held prefix beats an idle server; an unknown one counts as nothing)."""

from __future__ import annotations

import msgpack
import pytest

from toppings.scheduler.kv_index.feeds import KVFeeds, connect_address
from toppings.scheduler.kv_index.prefix_key import PrefixKey
from toppings.scheduler.perf_model import LinearPerfModel, PerfModels
from toppings.scheduler.policies import PrefixWeights, make_policy
from toppings.scheduler.state import BatchShape, RouteRequest, ServerState
from toppings.server.kv_events.block_hash import prompt_hashes

BS = 4


def batch(*events) -> bytes:
    return msgpack.packb([0.0, list(events), 0])


def stored(hashes, name=None):
    return ["BlockStored", hashes, None, [1] * (BS * len(hashes)), BS, None, "GPU", name]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class NoSubscription:
    def __init__(self, *args):
        self.args = args
        self.closed = False

    def close(self) -> None:
        self.closed = True


def feeds_with(clock: Clock, subscriptions: list) -> KVFeeds:
    def subscribe(*args):
        subscriptions.append(NoSubscription(*args))
        return subscriptions[-1]

    return KVFeeds(stale_s=5.0, subscribe=subscribe, clock=clock)


def events(batches: int = 1, stream: str = "s1", endpoint: str = "tcp://*:5557") -> dict:
    return {"endpoint": endpoint, "replay_endpoint": "tcp://*:5558", "topic": "kv-events",
            "block_size": BS, "stream": stream, "batches": batches}  # fmt: skip


def test_an_activated_adapters_key_is_the_base_prompt_before_its_invocation():
    prompt = list(range(10, 30)) + [7, 8, 9] + [40, 41]
    key = PrefixKey.of(prompt, "chk", invocation=(7, 8, 9))
    assert key == PrefixKey(tuple(range(10, 30)), None)
    assert key.hashes(BS) == prompt_hashes(list(range(10, 30)), BS, None)
    assert PrefixKey.of(list(range(10, 30)), "chk", invocation=(7, 8, 9)) is None  # refused
    plain = PrefixKey.of(prompt, "a")
    assert plain.adapter == "a" and plain.token_ids == tuple(prompt[:-1])  # the last: computed


def test_a_wildcard_bind_is_reached_at_the_servers_host():
    assert connect_address("tcp://*:5557", "http://10.0.0.5:8100") == "tcp://10.0.0.5:5557"
    assert connect_address("tcp://0.0.0.0:5557", "http://srv:8100") == "tcp://srv:5557"
    assert connect_address("tcp://[::]:5557", "http://[fd00::1]:8100") == "tcp://[fd00::1]:5557"
    assert connect_address("tcp://10.0.0.9:5557", "http://10.0.0.5:8100") == "tcp://10.0.0.9:5557"
    assert connect_address("ipc:///tmp/kv", "http://10.0.0.5:8100") == "ipc:///tmp/kv"


def test_matches_are_unknown_until_exact_and_after_a_loss():
    clock, subs = Clock(), []
    feeds = feeds_with(clock, subs)
    url = "http://10.0.0.5:8100"
    key = PrefixKey(tuple(range(12)), None)
    assert feeds.matched_tokens(key, [url]) == {url: None}  # not followed
    feeds.update(url, events(batches=0))
    assert subs[0].args[2:] == ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "kv-events")
    assert feeds.matched_tokens(key, [url]) == {url: None}  # no AllBlocksCleared yet
    feeds.index.apply(url, 0, batch(["AllBlocksCleared"], stored(key.hashes(BS)[:2])))
    assert feeds.matched_tokens(key, [url]) == {url: 2 * BS}
    feeds.index.skip_to(url, 5)  # batches lost
    assert feeds.matched_tokens(key, [url]) == {url: None}
    feeds.index.apply(url, 5, batch(["AllBlocksCleared"], stored(key.hashes(BS))))  # a resync
    assert feeds.matched_tokens(key, [url]) == {url: 3 * BS}


def test_an_index_behind_what_the_server_published_goes_stale():
    clock, subs = Clock(), []
    feeds = feeds_with(clock, subs)
    url = "http://h:1"
    key = PrefixKey(tuple(range(8)), None)
    feeds.update(url, events(batches=1))
    feeds.index.apply(url, 0, batch(["AllBlocksCleared"], stored(key.hashes(BS))))
    feeds.update(url, events(batches=3))  # two batches the index lacks
    clock.now += 4.0
    assert feeds.matched_tokens(key, [url]) == {url: 2 * BS}  # a lag within stale_s
    clock.now += 2.0
    assert feeds.matched_tokens(key, [url]) == {url: None}
    feeds.index.apply(url, 1, batch())
    feeds.index.apply(url, 2, batch())
    assert feeds.matched_tokens(key, [url]) == {url: 2 * BS}  # caught up
    clock.now += 60.0  # an idle server publishes nothing: not stale
    feeds.update(url, events(batches=3))
    assert feeds.matched_tokens(key, [url]) == {url: 2 * BS}


def test_a_new_stream_resubscribes_and_forgets_the_old_one():
    clock, subs = Clock(), []
    feeds = feeds_with(clock, subs)
    url = "http://h:1"
    feeds.update(url, events(stream="s1"))
    feeds.index.apply(url, 0, batch(["AllBlocksCleared"], stored([1, 2])))
    feeds.update(url, events(stream="s1"))
    assert len(subs) == 1
    feeds.update(url, events(stream="s2"))  # the server restarted
    assert subs[0].closed and len(subs) == 2
    assert feeds.index.blocks(url) == {} and feeds.index.status(url)[0] == 0
    feeds.update(url, {})  # events turned off
    assert subs[1].closed and feeds.matched_tokens(PrefixKey((1,), None), [url]) == {url: None}


class Fixed:
    """A PrefixSource that answers fixed matches."""

    def __init__(self, matched: dict):
        self.matched = matched

    def matched_tokens(self, key, urls):
        return {u: self.matched.get(u) for u in urls}


def perf() -> PerfModels:
    models = {}
    for kernel in ("bgmv", "mbgmv"):
        models[f"{kernel}_decode"] = LinearPerfModel(kernel, "decode", 50.0, (0.05,))
        models[f"{kernel}_prefill"] = LinearPerfModel(kernel, "prefill", 5.0, (1.6, 0.001))
    return PerfModels(models, source="test")


def server(url: str, running: int = 0) -> ServerState:
    batch_shape = BatchShape.of([8] * running, [2000] * running)
    return ServerState(url, "bgmv", True, running, 0, batch_shape, BatchShape(), 30_000,
                       adapters=frozenset({"a"}), device_adapters=frozenset({"a"}))  # fmt: skip


def test_a_held_prefix_beats_an_idle_server_and_unknown_counts_as_nothing():
    request = RouteRequest("a", 8, 2000, 16, prefix=PrefixKey(tuple(range(1999)), "a"))
    servers = [server("idle"), server("busy", running=3)]
    held = make_policy("prefix-aware", perf(), 1000.0, prefix=Fixed({"busy": 1984}))
    assert held.order(request, servers) == [1, 0]
    rank_aware = make_policy("rank-aware", perf(), 1000.0)
    assert rank_aware.order(request, servers) == [0, 1]  # the idle one, by Algorithm 1
    unknown = make_policy("prefix-aware", perf(), 1000.0, prefix=Fixed({"busy": None}))
    assert unknown.order(request, servers) == [0, 1]
    ignored = make_policy("prefix-aware", perf(), 1000.0, prefix=Fixed({"busy": 1984}),
                          weights=PrefixWeights(prefix=0.0))  # fmt: skip
    assert ignored.order(request, servers) == [0, 1]
    no_key = RouteRequest("a", 8, 2000, 16)
    assert held.order(no_key, servers) == [0, 1]


def test_a_longer_prefix_wins_between_equal_servers():
    request = RouteRequest(None, 0, 800, 16, prefix=PrefixKey(tuple(range(799)), None))
    servers = [server("s0"), server("s1"), server("s2")]
    policy = make_policy("prefix-aware", perf(), 1000.0,
                         prefix=Fixed({"s0": 64, "s1": 512, "s2": None}))  # fmt: skip
    assert policy.order(request, servers) == [1, 0, 2]


def test_negative_weights_are_refused():
    with pytest.raises(ValueError):
        PrefixWeights(load=-1.0)


def test_a_request_routed_to_its_prefix_counts_only_what_is_left_to_prefill():
    request = RouteRequest("a", 8, 2000, 16, prefix=PrefixKey(tuple(range(1999)), "a"))
    servers = [server("idle"), server("busy", running=3)]
    policy = make_policy("prefix-aware", perf(), 1000.0, prefix=Fixed({"busy": 1984}))
    assert policy.order(request, servers) == [1, 0]
    assert policy.routed_as(request, "busy").prompt_tokens == 16
    assert policy.routed_as(request, "idle") is request
    other = RouteRequest("a", 8, 2000, 16)
    assert policy.routed_as(other, "busy") is other  # not the request just ranked
    # The next turn, while the first is still counted as queued on "busy": it stays there.
    noted = servers[1].with_routed(8, policy.routed_as(request, "busy").prompt_tokens, 16)
    follow = RouteRequest("a", 8, 2100, 16, prefix=PrefixKey(tuple(range(2099)), "a"))
    assert policy.order(follow, [servers[0], noted]) == [1, 0]
    whole = servers[1].with_routed(8, 2000, 16)  # as it was counted before
    assert policy.order(follow, [servers[0], whole]) == [0, 1]
