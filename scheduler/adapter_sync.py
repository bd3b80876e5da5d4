"""Bring the servers' adapters in line with LoRAServe's routing table (the distributed pool).

After a placement step, each server of an adapter's row that does not hold the adapter yet is
asked to fetch it from the healthy servers that do:
    POST SERVER/v1/load_lora_adapter {"lora_name", "sha256", "peers": [holders]}
(server/api/admin/peer_fetch.py), with the SHA-256 the registry records for the adapter; an adapter
without a recorded digest is not moved (register it with `/admin/adapters {"sha256"}`), so no
server ever takes bytes nobody vouched for. Once a server confirmed, the registry records it as
a host at once (its next /stats says so too). Then a server that holds an adapter outside its
rows drops it (`/v1/unload_lora_adapter`), but only when a healthy server of the adapter's row
holds it and at least MIN_COPIES live copies stay: an adapter that was ever fetched survives
the death of any one server; a 409 (in use) is left for the next step. Requests go out 8 at a
time; the step's outcome is returned and logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import requests

from toppings.scheduler.registry import Registry, RegistryError
from toppings.scheduler.server_session import ServerSession

log = logging.getLogger(__name__)

TIMEOUT_S = (3.0, 300.0)  # connect, then the whole fetch on the server's side
MIN_COPIES = 2


class AdapterSync:
    def __init__(
        self,
        registry: Registry,
        hosting: Callable[[], Mapping[str, frozenset[str]]],
        session: ServerSession,
    ):
        """hosting: healthy server url -> adapters it holds (the cluster's last /stats), the
        servers this asks; session: the calls to them, with the servers' key."""
        self.registry = registry
        self.hosting = hosting
        self.session = session
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="adapter-sync")

    def sync(self, assignment: Mapping[str, Mapping[str, float]]) -> dict[str, int]:
        held = {url: set(names) for url, names in self.hosting().items()}
        fetches, drops = [], []
        for adapter, row in assignment.items():
            holders = sorted(u for u, names in held.items() if adapter in names)
            missing = [u for u in sorted(row) if u in held and adapter not in held[u]]
            if missing and holders:
                record = self.registry.get_adapter(adapter)
                if record is None or record.sha256 is None:
                    log.warning("adapter %s has no SHA-256 in the registry: not moved", adapter)
                else:
                    fetches += [(u, adapter, record.sha256, holders) for u in missing]
            spare = len(holders) - MIN_COPIES
            if spare > 0 and any(u in row for u in holders):
                drops += [(u, adapter) for u in holders if u not in row][:spare]
        fetched = sum(self._pool.map(lambda job: self._fetch(*job), fetches))
        dropped = sum(self._pool.map(lambda job: self._drop(*job), drops))
        outcome = {"fetched": fetched, "fetch_failed": len(fetches) - fetched,
                   "dropped": dropped, "drop_failed": len(drops) - dropped}  # fmt: skip
        if fetches or drops:
            log.info("adapter sync: %s", outcome)
        return outcome

    def _fetch(self, url: str, adapter: str, digest: str, peers: list[str]) -> bool:
        body = {"lora_name": adapter, "sha256": digest, "peers": peers}
        try:
            answer = self.session.post(url + "/v1/load_lora_adapter", json=body, timeout=TIMEOUT_S)
        except requests.RequestException as exc:
            log.warning("%s could not be asked to fetch %s: %s", url, adapter, exc)
            return False
        if answer.status_code == 409:  # loaded meanwhile
            return True
        if answer.status_code != 200:
            log.warning("%s did not fetch %s: %s %s", url, adapter, answer.status_code,
                        answer.text[:500])  # fmt: skip
            return False
        try:
            self.registry.add_hosting(url, adapter)
        except RegistryError as exc:  # removed meanwhile
            log.warning("fetched %s on %s but cannot record it: %s", adapter, url, exc)
        return True

    def _drop(self, url: str, adapter: str) -> bool:
        try:
            answer = self.session.post(url + "/v1/unload_lora_adapter",
                                       json={"lora_name": adapter}, timeout=TIMEOUT_S)  # fmt: skip
        except requests.RequestException:
            return False
        return answer.status_code == 200

    def close(self) -> None:
        self._pool.shutdown(wait=False)
