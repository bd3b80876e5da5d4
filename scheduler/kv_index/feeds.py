"""The KV events of the cluster's servers, as prefix routing reads them: a subscriber per server
that announces events, and per request the longest prefix each server holds, or unknown.

How the scheduler finds a server's events: from the server itself. Its `/stats` carries
`kv_events` (stats_schema KV_EVENTS: the endpoints as the server bound them, the topic, the
block size, and `stream`, which a new server process changes), so registering a server by its
URL is all an operator does. A wildcard host in a bound endpoint (`tcp://*:5557`, `0.0.0.0`,
`::`) is replaced by the host of the server's URL, as a client reaching a Kubernetes pod by its
address expects; an endpoint bound to a named host, or `ipc://`, is used as it is. A server
without `kv_events` (events off, or an older server) has no feed: its matches are unknown.

A server's matches are unknown (None), so that routing falls back to its other terms, when:
- its index is not exact: no AllBlocksCleared seen yet, or batches were lost (a sequence gap
  the replay could not fill) and the server has not resynced since (index.py);
- its index is behind for more than `stale_s`: the server's `/stats` said it had published
  batches the index still lacks `stale_s` after (the events do not arrive: a dead connection,
  a subscriber that fell behind). A server that publishes nothing is not stale: an idle one
  has nothing to announce.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from toppings.scheduler.kv_index.index import KVIndex
from toppings.scheduler.kv_index.prefix_key import PrefixKey
from toppings.scheduler.kv_index.subscriber import KVEventSubscriber

log = logging.getLogger(__name__)

DEFAULT_STALE_S = 5.0
WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


class Subscription(Protocol):
    def close(self) -> None: ...


Subscribe = Callable[[KVIndex, str, str, "str | None", str], Subscription]


def connect_address(bound: str, server_url: str) -> str:
    """The address to connect to for an endpoint a server bound: a wildcard host becomes the
    host of `server_url` (see the module docstring)."""
    scheme, sep, rest = bound.partition("://")
    if not sep or scheme != "tcp":
        return bound
    host, colon, port = rest.rpartition(":")
    if not colon or host not in WILDCARD_HOSTS:
        return bound
    server_host = urlsplit(server_url).hostname or "127.0.0.1"
    if ":" in server_host:  # IPv6
        server_host = f"[{server_host}]"
    return f"tcp://{server_host}:{port}"


@dataclass
class _Feed:
    endpoint: str
    stream: str
    block_size: int
    subscription: Subscription
    behind_target: int = 0  # batches the server said it had published, while the index lacked some
    behind_since: float | None = None  # when the index was first seen behind that count


class KVFeeds:
    """See the module docstring. Thread-safe: `/stats` refreshes update, the router reads."""

    def __init__(
        self,
        index: KVIndex | None = None,
        stale_s: float = DEFAULT_STALE_S,
        subscribe: Subscribe = KVEventSubscriber,
        clock: Callable[[], float] = time.monotonic,
    ):
        """subscribe(index, server url, endpoint, replay endpoint, topic): starts feeding the
        index (tests give a stand-in); clock: seconds, monotonic."""
        if stale_s <= 0:
            raise ValueError("stale_s must be positive")
        self.index = index if index is not None else KVIndex()
        self.stale_s = stale_s
        self._subscribe = subscribe
        self._clock = clock
        self._feeds: dict[str, _Feed] = {}
        self._lock = threading.Lock()

    def update(self, url: str, kv_events: Mapping[str, Any]) -> None:
        """A server's `/stats` `kv_events` (empty: none): (re)subscribe when its endpoint or
        its stream changed, and note whether the index is behind what it published."""
        if not kv_events:
            self.remove(url)
            return
        endpoint = connect_address(str(kv_events["endpoint"]), url)
        replay = kv_events.get("replay_endpoint")
        stream = str(kv_events.get("stream", ""))
        published = int(kv_events.get("batches", 0))
        old = None
        with self._lock:
            feed = self._feeds.get(url)
            if feed is None or feed.endpoint != endpoint or feed.stream != stream:
                old = feed
                self.index.forget(url)  # a new process numbers its batches from 0 again
                subscription = self._subscribe(
                    self.index,
                    url,
                    endpoint,
                    connect_address(str(replay), url) if replay else None,
                    str(kv_events.get("topic", "")),
                )
                feed = self._feeds[url] = _Feed(endpoint, stream, 0, subscription)
                log.info("KV events of %s: subscribed to %s", url, endpoint)
            feed.block_size = int(kv_events["block_size"])
            next_seq = self.index.status(url)[0]
            if next_seq >= published:
                feed.behind_since = None
            elif feed.behind_since is None or next_seq >= feed.behind_target:
                # behind from now on (or again, past what it caught up with since)
                feed.behind_target, feed.behind_since = published, self._clock()
        if old is not None:
            old.subscription.close()

    def remove(self, url: str) -> None:
        """Stop following `url` and forget its blocks."""
        with self._lock:
            feed = self._feeds.pop(url, None)
            self.index.forget(url)
        if feed is not None:
            feed.subscription.close()

    def close(self) -> None:
        with self._lock:
            feeds = list(self._feeds.values())
            self._feeds.clear()
        for feed in feeds:
            feed.subscription.close()

    def _known(self, url: str, now: float) -> _Feed | None:
        """The feed of `url` when its matches can be trusted now (caller holds the lock)."""
        feed = self._feeds.get(url)
        if feed is None:
            return None
        next_seq, exact, _ = self.index.status(url)
        if not exact:
            return None
        if feed.behind_since is not None:
            if next_seq >= feed.behind_target:
                feed.behind_since = None
            elif now - feed.behind_since > self.stale_s:
                return None
        return feed

    def matched_tokens(self, key: PrefixKey, urls: Iterable[str]) -> dict[str, int | None]:
        """Per server: how many of the key's leading tokens it holds KV for, or None where that
        is unknown (no feed, or a stale one: the module docstring)."""
        now = self._clock()
        out: dict[str, int | None] = {}
        with self._lock:
            known = {url: self._known(url, now) for url in urls}
        for url, feed in known.items():
            if feed is None:
                out[url] = None
                continue
            blocks = self.index.longest_prefix(url, key.hashes(feed.block_size))
            out[url] = blocks * feed.block_size
        return out

    def describe(self) -> dict[str, dict[str, Any]]:
        """Per followed server: its endpoint, blocks indexed, and whether its matches are
        trusted now (for /admin/state)."""
        now = self._clock()
        with self._lock:
            urls = list(self._feeds)
            rows = {url: (self._feeds[url], self._known(url, now) is not None) for url in urls}
        return {
            url: {
                "endpoint": feed.endpoint,
                "next_seq": self.index.status(url)[0],
                "blocks": len(self.index.blocks(url)),
                "fresh": fresh,
            }
            for url, (feed, fresh) in rows.items()
        }
