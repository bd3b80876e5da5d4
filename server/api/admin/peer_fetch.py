"""LoRAServe's distributed adapter pool, server side: fetch an adapter from a peer that holds it.

`POST /v1/load_lora_adapter {"lora_name", "sha256", "peers": [url, ...]}` (the scheduler sends
it to the servers of an adapter's new row; an operator may too) makes this server fetch the
adapter's two PEFT files (server/api/admin/files.py) from the first peer that delivers them
intact, then register it as a load from disk would. Every peer's answer is untrusted:
- the file list must name exactly the two PEFT files, each within its size cap (a 1 MiB config,
  8 GiB of weights; FetchConfig), and a peer that streams more bytes than it announced is cut
  off at the first byte too many;
- the bytes are hashed as they arrive and must match the SHA-256 the registry recorded (the
  scheduler passes it; a peer's own claim is never asked for), else the copy is deleted and the
  next peer is tried; so is a peer that is down, times out or answers anything but the files;
- files are written only under the store directory (`--adapter-store`), into a fresh temporary
  directory renamed into place once the digest matched; the adapter's directory name is derived
  from its (already validated) name and digest, never from a peer's words.
When every peer failed, the answer is a 424 naming each peer's failure; nothing stays on disk.

Only the operator decides whom this server talks to: a peer must be one of the `--peer` URLs
(FetchConfig.peers, compared as `scheme://host:port`), else the load gets a 400 naming the flag
before any connection is made. That holds for the scheduler too (its requests carry the same
API key as an operator's), so every server the scheduler may name as a holder is listed with
`--peer` on each server. The API key of this server (`--api-key`; a cluster shares one key) is
sent to those peers only. A redirect is a failed peer, never followed. One load, all peers and
bytes together, takes at most `--peer-fetch-timeout-s` (FetchConfig.total_timeout_s): every
socket wait is cut to the time left and the clock is checked between chunks, so a peer that
trickles the bytes of a body cannot hold a fetch for longer; past it the load gets a 504. Fetches
of different adapters run in parallel (one slow peer delays only the loads it serves); two loads
of the same adapter (name and digest) wait for each other, so that one copy is written. (A listed
peer trickling its response headers is bounded only per socket read: http.client reads them.)
The temporary `.partial-*` directories of the store are removed on every failure, when the
fetcher starts (what a killed server left) and when it closes (at interpreter exit).
"""

from __future__ import annotations

import atexit
import glob
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from argparse import ArgumentTypeError
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import quote

import requests
import urllib3

from toppings.gpu_lora.peft.config import AdapterError
from toppings.server.api.admin.files import FILES, MAX_BYTES, Digest, adapter_digest, is_digest
from toppings.server.api.admin.lifecycle import AdapterThread, check_name, is_within
from toppings.server.requests.errors import NOT_FOUND, nests_too_deep, unknown_adapter
from toppings.server.requests.request import RequestError
from toppings.server.settings import http_origin

log = logging.getLogger(__name__)

MAX_PEERS = 16
MAX_LIST_BYTES = 64 << 10
CHUNK_BYTES = 1 << 20
PARTIAL_PREFIX = ".partial-"
FAILED_DEPENDENCY = "failed_dependency"
GATEWAY_TIMEOUT = "gateway_timeout"
_OPEN_STORES: set[str] = set()  # the stores of live fetchers, cleaned at interpreter exit


class PeerFailed(Exception):
    """One peer could not deliver the adapter (down, garbage, too big, wrong digest)."""


class FetchTimedOut(Exception):
    """The whole load ran past FetchConfig.total_timeout_s."""


@dataclass(frozen=True)
class FetchConfig:
    """store_dir: where fetched adapters go; peers: the only servers fetched from (and sent
    api_key); total_timeout_s: the most one load may take over all its peers."""

    store_dir: str
    api_key: str | None = None
    peers: tuple[str, ...] = ()
    total_timeout_s: float = 120.0
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 60.0
    max_bytes: dict[str, int] = field(default_factory=lambda: dict(MAX_BYTES))


def held_adapter_dir(engine, name: str) -> str:
    """The directory of an adapter this server holds (404 when it holds none of that name)."""
    for adapter in engine.adapters():
        if adapter["name"] == name and adapter.get("path"):
            return adapter["path"]
    raise RequestError(unknown_adapter(name), 404, NOT_FOUND)


def _store_name(name: str, digest: str) -> str:
    """The store directory of an adapter: from its validated name and its digest only."""
    return f"{re.sub(r'[^A-Za-z0-9._-]', '_', name)[:100]}-{digest[:16]}"


class KeyedLocks:
    """One lock per key, made while some thread holds or waits for it, then dropped (so that
    the table never outgrows the fetches in flight)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    @contextmanager
    def holding(self, key: str) -> Iterator[None]:
        with self._lock:
            lock, users = self._locks.get(key, (None, 0))
            lock = lock or threading.Lock()
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._lock:
                lock, users = self._locks[key]
                if users == 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)


class PeerFetcher:
    def __init__(
        self,
        engine,
        config: FetchConfig,
        session: requests.Session | None = None,
        thread: AdapterThread | None = None,
    ):
        """thread: where fetched adapters are registered (the adapter admin's)."""
        self.engine = engine
        self.thread = thread or AdapterThread()
        self.config = config
        self.peers = frozenset(http_origin(p) for p in config.peers)
        os.makedirs(config.store_dir, exist_ok=True)
        self.store = os.path.realpath(config.store_dir)
        self.session = session or requests.Session()
        self._locks = KeyedLocks()  # one fetch at a time per store directory, others in parallel
        _remove_partials(self.store)
        _OPEN_STORES.add(self.store)

    def close(self) -> None:
        """Remove what an unfinished fetch left in the store (at interpreter exit for every
        store whose fetcher was not closed)."""
        _OPEN_STORES.discard(self.store)
        _remove_partials(self.store)

    def load(self, body: dict) -> dict:
        """Fetch and register `lora_name`; returns its card and the peer it came from."""
        unknown = set(body) - {"lora_name", "sha256", "peers"}
        if unknown:
            raise RequestError(f"unknown fields: {', '.join(sorted(unknown))}")
        name = check_name(body.get("lora_name"), self.engine.model_name)
        digest = body.get("sha256")
        if not is_digest(digest):
            raise RequestError("'sha256' must be the adapter's SHA-256: 64 lowercase hex digits")
        peers = self._allowed(body.get("peers"))
        with self._locks.holding(_store_name(name, digest)):  # no two copies of one adapter
            deadline = time.monotonic() + self.config.total_timeout_s  # a queued load's own
            if any(a["name"] == name for a in self.engine.adapters()):
                raise RequestError(f"adapter {name!r} is already loaded", 409, "conflict")
            failures = []
            for peer in peers:
                try:
                    directory = self._fetch(peer, name, digest, deadline)
                except PeerFailed as exc:
                    log.warning("fetching %s from %s failed: %s", name, peer, exc)
                    failures.append(f"{peer}: {exc}")
                    continue
                except FetchTimedOut:
                    log.warning("fetching %s timed out (at %s)", name, peer)
                    failures.append(f"{peer}: still fetching when the time ran out")
                    raise RequestError(
                        f"could not fetch adapter {name!r} within "
                        f"{self.config.total_timeout_s:g} s (--peer-fetch-timeout-s): "
                        + "; ".join(failures),
                        504,
                        GATEWAY_TIMEOUT,
                    ) from None
                return self._register(name, directory, digest, peer)
        raise RequestError(
            f"could not fetch adapter {name!r} from any peer: " + "; ".join(failures),
            424,
            FAILED_DEPENDENCY,
        )

    def _allowed(self, peers: object) -> list[str]:
        """The request's peers as `scheme://host:port`; a 400 unless each is a --peer."""
        shape = f"'peers' must be a list of 1 to {MAX_PEERS} http(s) server URLs"
        if not isinstance(peers, list) or not 1 <= len(peers) <= MAX_PEERS:
            raise RequestError(shape)
        origins = []
        for peer in peers:
            try:
                origins.append(http_origin(peer) if isinstance(peer, str) else None)
            except ArgumentTypeError:
                origins.append(None)
            if origins[-1] is None:
                raise RequestError(shape)
        for peer, origin in zip(peers, origins):
            if origin not in self.peers:
                raise RequestError(
                    f"peer {peer!r} is not one this server may fetch from: the operator lists "
                    "its peers with --peer URL (repeatable)",
                    400,
                )
        return origins

    def _register(self, name: str, directory: str, digest: str, peer: str) -> dict:
        try:
            adapter = self.thread.run(self.engine.add_adapter, name, directory)
        except AdapterError as exc:  # intact bytes of a bad adapter: the registry's mistake
            shutil.rmtree(directory, ignore_errors=True)
            raise RequestError(f"fetched adapter {name!r} is not valid: {exc}") from None
        log.info("fetched adapter %s (sha256 %s) from %s into %s", name, digest, peer, directory)
        return {"lora_name": name, "rank": adapter.rank, "sha256": digest,
                "target_modules": adapter.target_modules, "fetched_from": peer}  # fmt: skip

    def _fetch(self, peer: str, name: str, digest: str, deadline: float) -> str:
        """Download into a fresh directory of the store; its path once the digest matched."""
        final = os.path.join(self.store, _store_name(name, digest))
        if not is_within(os.path.realpath(final), self.store):  # cannot happen; stay sure
            raise PeerFailed("adapter directory would leave the store")
        if os.path.isdir(final) and _digest_or_none(final) == digest:
            return final  # fetched before (then unloaded): the same bytes
        sizes = self._file_list(peer, name, deadline)
        tmp = tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=self.store)
        try:
            hashed = Digest()
            for file_name in FILES:
                hashed.begin_file(file_name, sizes[file_name])
                self._download(peer, name, file_name, sizes[file_name], tmp, hashed, deadline)
            if hashed.hexdigest() != digest:
                raise PeerFailed(f"SHA-256 mismatch: the files hash to {hashed.hexdigest()}, "
                                 f"the registry records {digest}")  # fmt: skip
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            return final
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _url(self, peer: str, name: str, file_name: str = "") -> str:
        tail = f"/{file_name}" if file_name else ""
        return f"{peer}/v1/adapters/{quote(name, safe='')}/files{tail}"

    def _headers(self, peer: str) -> dict[str, str]:
        headers = {"Accept-Encoding": "identity"}
        if self.config.api_key and peer in self.peers:  # the key goes to listed peers only
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return headers

    def _get(self, peer: str, url: str, deadline: float) -> requests.Response:
        left_s = _left(deadline)
        timeout = (min(self.config.connect_timeout_s, left_s),
                   min(self.config.read_timeout_s, left_s))  # fmt: skip
        try:
            answer = self.session.get(url, headers=self._headers(peer), stream=True,
                                      timeout=timeout, allow_redirects=False)  # fmt: skip
        except requests.RequestException as exc:
            _left(deadline)  # a socket wait cut short by the deadline is the deadline's failure
            raise PeerFailed(f"unreachable ({type(exc).__name__})") from None
        if answer.is_redirect or 300 <= answer.status_code < 400:
            answer.close()
            raise PeerFailed(f"answered a redirect (HTTP {answer.status_code}); redirects are "
                             "not followed")  # fmt: skip
        if answer.status_code != 200:
            answer.close()
            raise PeerFailed(f"answered HTTP {answer.status_code}")
        return answer

    def _file_list(self, peer: str, name: str, deadline: float) -> dict[str, int]:
        answer = self._get(peer, self._url(peer, name), deadline)
        raw = b""
        try:
            for chunk in _chunks(answer, deadline):
                raw += chunk
                if len(raw) > MAX_LIST_BYTES:
                    break
            fits = len(raw) <= MAX_LIST_BYTES and not nests_too_deep(raw)
            body = json.loads(raw) if fits else None
        except (ValueError, requests.RequestException, urllib3.exceptions.HTTPError, OSError):
            _left(deadline)
            body = None
        finally:
            answer.close()
        files = body.get("files") if isinstance(body, dict) else None
        sizes = {}
        for entry in files if isinstance(files, list) else []:
            if isinstance(entry, dict) and entry.get("name") in FILES:
                sizes[entry["name"]] = entry.get("bytes")
        if not isinstance(files, list) or len(files) != len(FILES) or set(sizes) != set(FILES):
            raise PeerFailed("answered a malformed file list")
        for file_name, size in sizes.items():
            cap = self.config.max_bytes[file_name]
            if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= cap:
                raise PeerFailed(f"{file_name}: size {size!r} is not within 0..{cap} bytes")
        return sizes

    def _download(self, peer, name, file_name, size, directory, hashed: Digest, deadline) -> None:
        answer = self._get(peer, self._url(peer, name, file_name), deadline)
        received = 0
        try:
            with open(os.path.join(directory, file_name), "xb") as out:
                for chunk in _chunks(answer, deadline):
                    received += len(chunk)
                    if received > size:
                        raise PeerFailed(f"{file_name}: more bytes than the {size} announced")
                    hashed.update(chunk)
                    out.write(chunk)
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
            _left(deadline)
            raise PeerFailed(f"{file_name}: transfer broke ({type(exc).__name__})") from None
        finally:
            answer.close()
        if received != size:
            raise PeerFailed(f"{file_name}: {received} bytes of the {size} announced")


def _remove_partials(store: str) -> None:
    """Remove the temporary directories of fetches into `store` that never finished."""
    for path in glob.glob(os.path.join(glob.escape(store), PARTIAL_PREFIX + "*")):
        shutil.rmtree(path, ignore_errors=True)


@atexit.register
def _remove_all_partials() -> None:
    for store in list(_OPEN_STORES):
        _remove_partials(store)


def _left(deadline: float) -> float:
    """Seconds left before `deadline`; raises FetchTimedOut when none are."""
    left_s = deadline - time.monotonic()
    if left_s <= 0:
        raise FetchTimedOut
    return left_s


def _chunks(answer: requests.Response, deadline: float) -> Iterator[bytes]:
    """The body of `answer` as it arrives (read1: whatever one socket read returns), the
    deadline checked before every read."""
    while True:
        _left(deadline)
        chunk = answer.raw.read1(CHUNK_BYTES, decode_content=True)
        if not chunk:
            return
        yield chunk


def _digest_or_none(directory: str) -> str | None:
    try:
        return adapter_digest(directory)
    except OSError:  # a file of an earlier copy went missing: fetch again
        return None
