"""LoRAServe's distributed adapter pool, server side: fetch an adapter from a peer that holds it.

`POST /v1/load_lora_adapter {"lora_name", "sha256", "peers": [url, ...]}` (the scheduler sends
it to the servers of an adapter's new row; an operator may too) makes this server fetch the
adapter's two PEFT files (server/api/adapter_files.py) from the first peer that delivers them
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
The API key of this server (`--api-key`) is sent to the peers: a cluster shares one key.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from urllib.parse import quote

import requests

from toppings.gpu_lora.peft_config import AdapterError
from toppings.server.api.adapter_files import FILES, MAX_BYTES, Digest, adapter_digest, is_digest
from toppings.server.api.lifecycle import check_name, is_within
from toppings.server.requests.errors import NOT_FOUND, unknown_adapter
from toppings.server.requests.request import RequestError

log = logging.getLogger(__name__)

MAX_PEERS = 16
MAX_LIST_BYTES = 64 << 10
FAILED_DEPENDENCY = "failed_dependency"


class PeerFailed(Exception):
    """One peer could not deliver the adapter (down, garbage, too big, wrong digest)."""


@dataclass(frozen=True)
class FetchConfig:
    store_dir: str
    api_key: str | None = None
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 60.0
    max_bytes: dict[str, int] = field(default_factory=lambda: dict(MAX_BYTES))


def held_adapter_dir(engine, name: str) -> str:
    """The directory of an adapter this server holds (404 when it holds none of that name)."""
    for adapter in engine.adapters():
        if adapter["name"] == name and adapter.get("path"):
            return adapter["path"]
    raise RequestError(unknown_adapter(name), 404, NOT_FOUND)


class PeerFetcher:
    def __init__(self, engine, config: FetchConfig, session: requests.Session | None = None):
        self.engine = engine
        self.config = config
        os.makedirs(config.store_dir, exist_ok=True)
        self.store = os.path.realpath(config.store_dir)
        self.session = session or requests.Session()
        if config.api_key:
            self.session.headers["Authorization"] = f"Bearer {config.api_key}"
        self._lock = threading.Lock()  # one fetch at a time: no two copies of one adapter

    def load(self, body: dict) -> dict:
        """Fetch and register `lora_name`; returns its card and the peer it came from."""
        unknown = set(body) - {"lora_name", "sha256", "peers"}
        if unknown:
            raise RequestError(f"unknown fields: {', '.join(sorted(unknown))}")
        name = check_name(body.get("lora_name"), self.engine.model_name)
        digest = body.get("sha256")
        if not is_digest(digest):
            raise RequestError("'sha256' must be the adapter's SHA-256: 64 lowercase hex digits")
        peers = body.get("peers")
        if (
            not isinstance(peers, list)
            or not 1 <= len(peers) <= MAX_PEERS
            or not all(isinstance(p, str) and p.startswith(("http://", "https://")) for p in peers)
        ):
            raise RequestError(f"'peers' must be a list of 1 to {MAX_PEERS} http(s) server URLs")
        with self._lock:
            if any(a["name"] == name for a in self.engine.adapters()):
                raise RequestError(f"adapter {name!r} is already loaded", 409, "conflict")
            failures = []
            for peer in peers:
                try:
                    directory = self._fetch(peer.rstrip("/"), name, digest)
                except PeerFailed as exc:
                    log.warning("fetching %s from %s failed: %s", name, peer, exc)
                    failures.append(f"{peer}: {exc}")
                    continue
                return self._register(name, directory, digest, peer)
        raise RequestError(
            f"could not fetch adapter {name!r} from any peer: " + "; ".join(failures),
            424,
            FAILED_DEPENDENCY,
        )

    def _register(self, name: str, directory: str, digest: str, peer: str) -> dict:
        try:
            adapter = self.engine.add_adapter(name, directory)
        except AdapterError as exc:  # intact bytes of a bad adapter: the registry's mistake
            shutil.rmtree(directory, ignore_errors=True)
            raise RequestError(f"fetched adapter {name!r} is not valid: {exc}") from None
        log.info("fetched adapter %s (sha256 %s) from %s into %s", name, digest, peer, directory)
        return {"lora_name": name, "rank": adapter.rank, "sha256": digest,
                "target_modules": adapter.target_modules, "fetched_from": peer}  # fmt: skip

    def _fetch(self, peer: str, name: str, digest: str) -> str:
        """Download into a fresh directory of the store; its path once the digest matched."""
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:100]
        final = os.path.join(self.store, f"{safe}-{digest[:16]}")
        if not is_within(os.path.realpath(final), self.store):  # cannot happen; stay sure
            raise PeerFailed("adapter directory would leave the store")
        if os.path.isdir(final) and _digest_or_none(final) == digest:
            return final  # fetched before (then unloaded): the same bytes
        sizes = self._file_list(peer, name)
        tmp = tempfile.mkdtemp(prefix=".partial-", dir=self.store)
        try:
            hashed = Digest()
            for file_name in FILES:
                hashed.begin_file(file_name, sizes[file_name])
                self._download(peer, name, file_name, sizes[file_name], tmp, hashed)
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

    def _get(self, url: str) -> requests.Response:
        try:
            answer = self.session.get(
                url,
                stream=True,
                timeout=(self.config.connect_timeout_s, self.config.read_timeout_s),
            )
        except requests.RequestException as exc:
            raise PeerFailed(f"unreachable ({type(exc).__name__})") from None
        if answer.status_code != 200:
            answer.close()
            raise PeerFailed(f"answered HTTP {answer.status_code}")
        return answer

    def _file_list(self, peer: str, name: str) -> dict[str, int]:
        answer = self._get(self._url(peer, name))
        try:
            raw = answer.raw.read(MAX_LIST_BYTES + 1, decode_content=True)
            body = json.loads(raw) if len(raw) <= MAX_LIST_BYTES else None
        except (ValueError, requests.RequestException, OSError):
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

    def _download(self, peer, name, file_name, size, directory, hashed: Digest) -> None:
        answer = self._get(self._url(peer, name, file_name))
        received = 0
        try:
            with open(os.path.join(directory, file_name), "xb") as out:
                for chunk in answer.iter_content(chunk_size=1 << 20):
                    received += len(chunk)
                    if received > size:
                        raise PeerFailed(f"{file_name}: more bytes than the {size} announced")
                    hashed.update(chunk)
                    out.write(chunk)
        except requests.RequestException as exc:
            raise PeerFailed(f"{file_name}: transfer broke ({type(exc).__name__})") from None
        finally:
            answer.close()
        if received != size:
            raise PeerFailed(f"{file_name}: {received} bytes of the {size} announced")


def _digest_or_none(directory: str) -> str | None:
    try:
        return adapter_digest(directory)
    except OSError:  # a file of an earlier copy went missing: fetch again
        return None
