"""SQLite registry: WAL, foreign keys, atomic multi-row changes, persistence across reopen."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from toppings.scheduler.registry import (
    SCHEMA_VERSION,
    AdapterRecord,
    Registry,
    RegistryError,
    ServerRecord,
)

URL = "http://127.0.0.1:8100"


def adapter(name: str, rank: int = 16, **kw) -> AdapterRecord:
    return AdapterRecord(name=name, base_model="llama", rank=rank, **kw)


@pytest.fixture
def registry(tmp_path):
    reg = Registry(tmp_path / "reg.sqlite")
    yield reg
    reg.close()


def test_wal_foreign_keys_and_version(registry):
    conn = registry._conn()
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    # An adapter of an unknown server, or hosting on an unknown server, is refused.
    with pytest.raises(sqlite3.IntegrityError), registry.write() as tx:
        tx.execute("INSERT INTO server_adapters VALUES ('http://nowhere', 'x')")
    registry.put_adapter(adapter("x"))
    with pytest.raises(RegistryError):
        registry.add_hosting("http://nowhere", "x")
    with pytest.raises(sqlite3.IntegrityError), registry.write() as tx:
        tx.execute("DELETE FROM base_models WHERE name = 'llama'")


def test_server_with_adapters_and_cascade(registry):
    registry.put_adapter(adapter("sql", 64, alpha=128.0, path="/a/sql", num_bytes=1000,
                                 target_modules=("q_proj", "v_proj")))  # fmt: skip
    server = ServerRecord(URL, "llama", "bgmv", "cuda")
    # A server reports only name and rank: what the registry knew stays.
    registry.put_server(server, [adapter("sql", 64), adapter("chat", 8)])
    sql = registry.get_adapter("sql")
    assert (sql.alpha, sql.path, sql.num_bytes) == (128.0, "/a/sql", 1000)
    assert sql.target_modules == ("q_proj", "v_proj")
    assert registry.hosting() == {URL: {"sql", "chat"}}
    registry.set_adapter_state("chat", "disabled")
    assert registry.hosting() == {URL: {"sql"}}
    # Re-registering replaces the hosted set exactly.
    registry.put_server(server, [adapter("chat", 8)])
    assert registry.hosting() == {URL: set()}
    registry.set_adapter_state("chat", "active")
    assert registry.hosting() == {URL: {"chat"}}
    with pytest.raises(RegistryError, match="belongs to"):
        registry.put_server(server, [AdapterRecord("chat", "mistral", 8)])
    assert registry.hosting() == {URL: {"chat"}}  # the failed change rolled back whole
    assert registry.remove_server(URL)
    assert registry.hosting() == {}
    with registry.read() as tx:
        assert tx.execute("SELECT COUNT(*) FROM server_adapters").fetchone()[0] == 0
    assert {a.name for a in registry.list_adapters()} == {"sql", "chat"}


def test_a_name_no_server_reports_any_more_is_forgotten_unless_it_has_a_path(registry):
    # a resolver's names come and go: the records made from reports alone go with the last
    # server that hosted them; a record with a path (placeable) or disabled stays
    other = "http://127.0.0.1:8101"
    registry.put_adapter(adapter("placed", 8, path="/a/placed"))
    reports = [adapter(n, 8) for n in ("r1", "r2", "shared", "off", "placed")]
    registry.put_server(ServerRecord(URL, "llama", "bgmv", "cpu"), reports)
    registry.put_server(ServerRecord(other, "llama", "bgmv", "cpu"), [adapter("shared", 8)])
    registry.set_adapter_state("off", "disabled")
    registry.put_server(ServerRecord(URL, "llama", "bgmv", "cpu"), [adapter("r1", 8)])
    names = {a.name for a in registry.list_adapters()}
    assert names == {"r1", "shared", "off", "placed"}  # r2 forgotten
    registry.put_server(ServerRecord(other, "llama", "bgmv", "cpu"), [])
    assert {a.name for a in registry.list_adapters()} == {"r1", "off", "placed"}


def test_concurrent_reader_never_sees_half_a_change(registry):
    """A reader running while a server and its adapters are written sees all or nothing."""
    in_write, release = threading.Event(), threading.Event()
    seen: list[tuple[int, int]] = []

    def writer():
        with registry.write() as tx:
            tx.execute("INSERT INTO base_models VALUES ('llama', NULL, 0)")
            tx.execute("INSERT INTO servers VALUES (?, 'llama', 'mbgmv', 'cpu', 1, 0, 0)", (URL,))
            for name in ("a", "b", "c"):
                tx.execute(
                    "INSERT INTO adapters (name, base_model, rank, updated_at)"
                    " VALUES (?, 'llama', 8, 0)",
                    (name,),
                )
                tx.execute("INSERT INTO server_adapters VALUES (?, ?)", (URL, name))
            in_write.set()
            release.wait(5)

    def count() -> tuple[int, int]:
        with registry.read() as tx:
            servers = tx.execute("SELECT COUNT(*) FROM servers").fetchone()[0]
            hosted = tx.execute("SELECT COUNT(*) FROM server_adapters").fetchone()[0]
        return servers, hosted

    thread = threading.Thread(target=writer)
    thread.start()
    assert in_write.wait(5)
    reader = threading.Thread(target=lambda: seen.append(count()))
    reader.start()
    reader.join(5)  # WAL: the reader does not wait for the writer
    assert not reader.is_alive()
    release.set()
    thread.join(5)
    seen.append(count())
    assert seen == [(0, 0), (1, 3)]


def test_survives_reopen(tmp_path):
    path = tmp_path / "reg.sqlite"
    first = Registry(path)
    first.put_server(ServerRecord(URL, "llama", "bgmv", "cuda"), [adapter("sql", 32)])
    first.put_server(ServerRecord("http://b:1", "llama", "mbgmv", "cpu"), [])
    first.set_health(URL, False, 123.0)
    first.close()
    second = Registry(path)
    servers = second.list_servers()
    assert [s.url for s in servers] == [URL, "http://b:1"]
    assert servers[0].healthy is False and servers[0].last_seen == 123.0
    assert second.get_adapter("sql").rank == 32
    assert second.hosting()[URL] == {"sql"}
    assert second.base_models() == ["llama"]
    second.close()


def test_refuses_newer_schema(tmp_path):
    path = tmp_path / "reg.sqlite"
    Registry(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(RuntimeError, match="newer"):
        Registry(path)


def test_adapter_validation():
    with pytest.raises(RegistryError):
        adapter("x", 0)
    with pytest.raises(RegistryError):
        adapter("x", state="gone")
