"""SQLite registry of base models, adapters, servers, which server hosts which adapter, and
LoRAServe's routing table (which server serves which adapter, with what probability).

The schema is the top-level `registry.sqlite.sql`, versioned with PRAGMA user_version; an older
file is migrated in place (MIGRATIONS: v1 -> v2 adds the adapters' SHA-256 and the routes). The
database runs in WAL mode, so readers never block the writer and see only committed
transactions; every change that touches several rows (a server and its adapters) is one
transaction. Each thread gets its own connection; the file is the whole state, so a restarted
scheduler picks up where it stopped.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
# version -> the statements that take a file at that version to the next one
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        "ALTER TABLE adapters ADD COLUMN sha256 TEXT CHECK (sha256 IS NULL"
        " OR (length(sha256) = 64 AND sha256 NOT GLOB '*[^0-9a-f]*'))",
        "CREATE TABLE routes (adapter_name TEXT NOT NULL REFERENCES adapters(name)"
        " ON DELETE CASCADE, server_url TEXT NOT NULL REFERENCES servers(url) ON DELETE CASCADE,"
        " probability REAL NOT NULL CHECK (probability > 0 AND probability <= 1),"
        " step INTEGER NOT NULL, PRIMARY KEY (adapter_name, server_url))",
        "CREATE INDEX routes_by_server ON routes(server_url)",
    ),
}
SHA256_HEX = frozenset("0123456789abcdef")
SCHEMA_PATH = Path(__file__).resolve().parent.parent / "registry.sqlite.sql"
ADAPTER_STATES = ("active", "disabled")


class RegistryError(ValueError):
    """A change the registry refuses (unknown server, conflicting adapter, bad field)."""


@dataclass(frozen=True)
class AdapterRecord:
    name: str
    base_model: str
    rank: int
    alpha: float | None = None
    target_modules: tuple[str, ...] = ()
    path: str | None = None
    num_bytes: int | None = None
    state: str = "active"
    sha256: str | None = None  # hex digest of the PEFT files (server/api/admin/peer_fetch.py)

    def __post_init__(self) -> None:
        if not self.name or not self.base_model:
            raise RegistryError("an adapter needs a name and a base model")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank <= 0:
            raise RegistryError(f"adapter {self.name}: rank must be a positive integer")
        if self.num_bytes is not None and (
            not isinstance(self.num_bytes, int) or self.num_bytes < 0
        ):
            raise RegistryError(f"adapter {self.name}: bytes must be a non-negative integer")
        if not all(isinstance(m, str) for m in self.target_modules):
            raise RegistryError(f"adapter {self.name}: target_modules must be names")
        if self.state not in ADAPTER_STATES:
            raise RegistryError(f"adapter {self.name}: state must be one of {ADAPTER_STATES}")
        if self.sha256 is not None and (
            not isinstance(self.sha256, str)
            or len(self.sha256) != 64
            or not set(self.sha256) <= SHA256_HEX
        ):
            raise RegistryError(f"adapter {self.name}: sha256 must be 64 lowercase hex digits")


@dataclass(frozen=True)
class ServerRecord:
    url: str
    base_model: str
    kernel: str
    device: str
    healthy: bool = True
    last_seen: float = 0.0


def _schema_statements() -> list[str]:
    """The schema file split into statements (executescript would commit mid-transaction)."""
    statements, current = [], ""
    for line in SCHEMA_PATH.read_text().splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            statements.append(current.strip())
            current = ""
    return [s for s in statements if s]


class Registry:
    """Thread-safe access to one registry file."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._migrate()

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            # Autocommit mode: transactions are the explicit BEGIN/COMMIT of read() and write().
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA foreign_keys = ON")
            conn.execute("PRAGMA busy_timeout = 5000")
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def close(self) -> None:
        with self._lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()
        self._local = threading.local()

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; IMMEDIATE takes the write lock up front (no upgrade deadlock)."""
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction: every statement inside sees the same committed snapshot."""
        conn = self._conn()
        conn.execute("BEGIN")
        try:
            yield conn
        finally:
            conn.execute("COMMIT")

    def _migrate(self) -> None:
        conn = self._conn()
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise RuntimeError(f"{self.path}: could not switch to WAL (journal_mode={mode})")
        with self.write() as tx:
            version = tx.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"{self.path}: schema v{version} is newer than v{SCHEMA_VERSION}"
                )
            if version == 0:
                for statement in _schema_statements():
                    tx.execute(statement)
                tx.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                log.info("created registry schema v%d in %s", SCHEMA_VERSION, self.path)
                return
            while version < SCHEMA_VERSION:
                for statement in MIGRATIONS[version]:
                    tx.execute(statement)
                version += 1
                tx.execute(f"PRAGMA user_version = {version}")
                log.info("migrated registry %s to schema v%d", self.path, version)

    # --- adapters -----------------------------------------------------------------------------

    def put_adapter(self, adapter: AdapterRecord) -> None:
        with self.write() as tx:
            _put_adapter(tx, adapter, time.time())

    def get_adapter(self, name: str) -> AdapterRecord | None:
        with self.read() as tx:
            row = tx.execute("SELECT * FROM adapters WHERE name = ?", (name,)).fetchone()
        return None if row is None else _adapter(row)

    def list_adapters(self, base_model: str | None = None) -> list[AdapterRecord]:
        query, args = "SELECT * FROM adapters", ()
        if base_model is not None:
            query, args = query + " WHERE base_model = ?", (base_model,)
        with self.read() as tx:
            return [_adapter(row) for row in tx.execute(query + " ORDER BY name", args)]

    def set_adapter_state(self, name: str, state: str) -> None:
        if state not in ADAPTER_STATES:
            raise RegistryError(f"state must be one of {ADAPTER_STATES}")
        with self.write() as tx:
            cur = tx.execute(
                "UPDATE adapters SET state = ?, updated_at = ? WHERE name = ?",
                (state, time.time(), name),
            )
            if cur.rowcount == 0:
                raise RegistryError(f"unknown adapter {name!r}")

    def remove_adapter(self, name: str) -> bool:
        """Forget an adapter, its hosting and its routes (False: there was none)."""
        with self.write() as tx:
            return tx.execute("DELETE FROM adapters WHERE name = ?", (name,)).rowcount > 0

    def base_models(self) -> list[str]:
        with self.read() as tx:
            return [r[0] for r in tx.execute("SELECT name FROM base_models ORDER BY name")]

    # --- LoRAServe's routing table -------------------------------------------------------------

    def put_routes(self, rows: Iterable[tuple[str, str, float]], step: int) -> None:
        """Replace the routing table by `rows` (adapter, server url, probability), one
        transaction; raises RegistryError for an unknown adapter or server."""
        with self.write() as tx:
            tx.execute("DELETE FROM routes")
            try:
                tx.executemany(
                    "INSERT INTO routes (adapter_name, server_url, probability, step)"
                    " VALUES (?, ?, ?, ?)",
                    ((a, s, float(p), step) for a, s, p in rows),
                )
            except sqlite3.IntegrityError as exc:
                raise RegistryError(f"routing table refused: {exc}") from exc

    def routes(self) -> dict[str, dict[str, float]]:
        """adapter -> {server url: probability}."""
        table: dict[str, dict[str, float]] = {}
        with self.read() as tx:
            for adapter, url, p in tx.execute(
                "SELECT adapter_name, server_url, probability FROM routes"
                " ORDER BY adapter_name, server_url"
            ):
                table.setdefault(adapter, {})[url] = p
        return table

    def routes_step(self) -> int | None:
        """The placement step that wrote the routing table, or None when it is empty."""
        with self.read() as tx:
            return tx.execute("SELECT MAX(step) FROM routes").fetchone()[0]

    # --- servers ------------------------------------------------------------------------------

    def put_server(self, server: ServerRecord, adapters: Iterable[AdapterRecord]) -> None:
        """Record a server and exactly the adapters it hosts, in one transaction; a name it
        hosted before and no longer does, hosted nowhere else and known only from servers'
        reports (no path), is forgotten."""
        now = time.time()
        with self.write() as tx:
            _ensure_base_model(tx, server.base_model, now)
            tx.execute(
                "INSERT INTO servers (url, base_model, kernel, device, healthy, last_seen,"
                " added_at) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(url) DO UPDATE SET"
                " base_model = excluded.base_model, kernel = excluded.kernel,"
                " device = excluded.device, healthy = excluded.healthy,"
                " last_seen = excluded.last_seen",
                (server.url, server.base_model, server.kernel, server.device,
                 int(server.healthy), server.last_seen or now, now),
            )  # fmt: skip
            hosted = "SELECT adapter_name FROM server_adapters WHERE server_url = ?"
            before = {row[0] for row in tx.execute(hosted, (server.url,))}
            tx.execute("DELETE FROM server_adapters WHERE server_url = ?", (server.url,))
            for adapter in adapters:
                _put_adapter(tx, adapter, now, fill_only=True)
                tx.execute(
                    "INSERT INTO server_adapters (server_url, adapter_name) VALUES (?, ?)",
                    (server.url, adapter.name),
                )
            # A name it no longer reports, that no server hosts and only servers' reports made
            # (no path to place it by): forgotten, or a resolver's evicted names pile up
            gone = before - {a.name for a in adapters}
            tx.executemany(
                "DELETE FROM adapters WHERE name = ? AND path IS NULL AND state = 'active' AND"
                " NOT EXISTS (SELECT 1 FROM server_adapters WHERE adapter_name = adapters.name)",
                [(name,) for name in gone],
            )

    def add_hosting(self, url: str, adapter_name: str) -> None:
        with self.write() as tx:
            try:
                tx.execute(
                    "INSERT OR IGNORE INTO server_adapters (server_url, adapter_name)"
                    " VALUES (?, ?)",
                    (url, adapter_name),
                )
            except sqlite3.IntegrityError as exc:
                raise RegistryError(f"unknown server {url!r} or adapter {adapter_name!r}") from exc

    def remove_server(self, url: str) -> bool:
        with self.write() as tx:
            return tx.execute("DELETE FROM servers WHERE url = ?", (url,)).rowcount > 0

    def set_health(self, url: str, healthy: bool, last_seen: float | None = None) -> None:
        with self.write() as tx:
            if last_seen is None:
                tx.execute("UPDATE servers SET healthy = ? WHERE url = ?", (int(healthy), url))
            else:
                tx.execute(
                    "UPDATE servers SET healthy = ?, last_seen = ? WHERE url = ?",
                    (int(healthy), last_seen, url),
                )

    def list_servers(self) -> list[ServerRecord]:
        """Servers in the order they were first added (first-fit's fixed order)."""
        with self.read() as tx:
            rows = tx.execute("SELECT * FROM servers ORDER BY added_at, url").fetchall()
        return [
            ServerRecord(r["url"], r["base_model"], r["kernel"], r["device"], bool(r["healthy"]),
                         r["last_seen"])
            for r in rows
        ]  # fmt: skip

    def hosting(self) -> dict[str, set[str]]:
        """url -> names of the active adapters it hosts."""
        with self.read() as tx:
            rows = tx.execute(
                "SELECT s.url, a.name FROM servers s LEFT JOIN server_adapters sa"
                " ON sa.server_url = s.url LEFT JOIN adapters a ON a.name = sa.adapter_name"
                " AND a.state = 'active'"
            ).fetchall()
        result: dict[str, set[str]] = {}
        for url, name in rows:
            result.setdefault(url, set())
            if name is not None:
                result[url].add(name)
        return result


def _ensure_base_model(tx: sqlite3.Connection, name: str, now: float) -> None:
    tx.execute("INSERT OR IGNORE INTO base_models (name, created_at) VALUES (?, ?)", (name, now))


def _put_adapter(
    tx: sqlite3.Connection, adapter: AdapterRecord, now: float, fill_only: bool = False
) -> None:
    """Insert or update; fill_only keeps known alpha/path/bytes/sha256/modules/state that a server's
    report (which carries only name and rank) would otherwise blank."""
    row = tx.execute("SELECT base_model FROM adapters WHERE name = ?", (adapter.name,)).fetchone()
    if row is not None and row[0] != adapter.base_model:
        raise RegistryError(
            f"adapter {adapter.name!r} belongs to {row[0]!r}, not {adapter.base_model!r}"
        )
    _ensure_base_model(tx, adapter.base_model, now)
    modules = json.dumps(list(adapter.target_modules))
    keep = "COALESCE(excluded.{0}, adapters.{0})" if fill_only else "excluded.{0}"
    tx.execute(
        "INSERT INTO adapters (name, base_model, rank, alpha, target_modules, path, num_bytes,"
        " state, updated_at, sha256) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(name)"
        f" DO UPDATE SET rank = excluded.rank, alpha = {keep.format('alpha')},"
        f" path = {keep.format('path')}, num_bytes = {keep.format('num_bytes')},"
        f" sha256 = {keep.format('sha256')},"
        " target_modules = CASE WHEN excluded.target_modules = '[]' AND ? THEN"
        " adapters.target_modules ELSE excluded.target_modules END,"
        f" state = {'adapters.state' if fill_only else 'excluded.state'},"
        " updated_at = excluded.updated_at",
        (adapter.name, adapter.base_model, adapter.rank, adapter.alpha, modules, adapter.path,
         adapter.num_bytes, adapter.state, now, adapter.sha256, int(fill_only)),
    )  # fmt: skip


def _adapter(row: sqlite3.Row) -> AdapterRecord:
    return AdapterRecord(
        name=row["name"],
        base_model=row["base_model"],
        rank=row["rank"],
        alpha=row["alpha"],
        target_modules=tuple(json.loads(row["target_modules"])),
        path=row["path"],
        num_bytes=row["num_bytes"],
        state=row["state"],
        sha256=row["sha256"],
    )
