"""Registry v2: LoRAServe's routing table, the adapters' SHA-256, and the migration from v1."""

from __future__ import annotations

import sqlite3

import pytest

from toppings.scheduler.registry import (
    SCHEMA_VERSION,
    AdapterRecord,
    Registry,
    RegistryError,
    ServerRecord,
)

URLS = ("http://127.0.0.1:8100", "http://127.0.0.1:8101")
DIGEST = "ab" * 32

# Schema v1 as it shipped (registry.sqlite.sql before LoRAServe), with one row in each table.
V1 = """
CREATE TABLE base_models (name TEXT PRIMARY KEY, path TEXT, created_at REAL NOT NULL);
CREATE TABLE adapters (
    name TEXT PRIMARY KEY,
    base_model TEXT NOT NULL REFERENCES base_models(name) ON DELETE RESTRICT,
    rank INTEGER NOT NULL CHECK (rank > 0), alpha REAL,
    target_modules TEXT NOT NULL DEFAULT '[]', path TEXT,
    num_bytes INTEGER CHECK (num_bytes IS NULL OR num_bytes >= 0),
    state TEXT NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'disabled')),
    updated_at REAL NOT NULL);
CREATE TABLE servers (
    url TEXT PRIMARY KEY,
    base_model TEXT NOT NULL REFERENCES base_models(name) ON DELETE RESTRICT,
    kernel TEXT NOT NULL CHECK (kernel IN ('bgmv', 'mbgmv')), device TEXT NOT NULL,
    healthy INTEGER NOT NULL DEFAULT 1 CHECK (healthy IN (0, 1)),
    last_seen REAL NOT NULL, added_at REAL NOT NULL);
CREATE TABLE server_adapters (
    server_url TEXT NOT NULL REFERENCES servers(url) ON DELETE CASCADE,
    adapter_name TEXT NOT NULL REFERENCES adapters(name) ON DELETE CASCADE,
    PRIMARY KEY (server_url, adapter_name));
CREATE INDEX server_adapters_by_adapter ON server_adapters(adapter_name);
CREATE INDEX adapters_by_base_model ON adapters(base_model);
INSERT INTO base_models VALUES ('llama', NULL, 1.0);
INSERT INTO adapters VALUES ('old', 'llama', 8, 16.0, '["q_proj"]', '/a/old', 10, 'active', 1.0);
INSERT INTO servers VALUES ('http://127.0.0.1:8100', 'llama', 'bgmv', 'cpu', 1, 1.0, 1.0);
INSERT INTO server_adapters VALUES ('http://127.0.0.1:8100', 'old');
PRAGMA user_version = 1;
"""


@pytest.fixture
def registry(tmp_path):
    reg = Registry(tmp_path / "reg.sqlite")
    for url in URLS:
        reg.put_server(ServerRecord(url, "llama", "bgmv", "cpu"), [])
    for name in ("a", "b"):
        reg.put_adapter(AdapterRecord(name, "llama", 16))
    yield reg
    reg.close()


def test_routes_replace_whole_and_cascade_with_their_server(registry):
    assert registry.routes() == {} and registry.routes_step() is None
    registry.put_routes([("a", URLS[0], 0.25), ("a", URLS[1], 0.75), ("b", URLS[1], 1.0)], 1)
    assert registry.routes() == {"a": {URLS[0]: 0.25, URLS[1]: 0.75}, "b": {URLS[1]: 1.0}}
    registry.put_routes([("b", URLS[0], 1.0)], 2)
    assert registry.routes() == {"b": {URLS[0]: 1.0}} and registry.routes_step() == 2
    registry.remove_server(URLS[0])
    assert registry.routes() == {}


def test_bad_routes_are_refused_and_the_old_table_stays(registry):
    registry.put_routes([("a", URLS[0], 1.0)], 1)
    for rows in ([("nope", URLS[0], 1.0)], [("a", "http://nowhere", 1.0)], [("a", URLS[0], 0.0)]):
        with pytest.raises((RegistryError, sqlite3.IntegrityError)):
            registry.put_routes(rows, 2)
    assert registry.routes() == {"a": {URLS[0]: 1.0}}


def test_sha256_is_kept_and_checked(registry):
    registry.put_adapter(AdapterRecord("c", "llama", 8, sha256=DIGEST))
    # A server's report (name and rank only) keeps the digest.
    registry.put_server(ServerRecord(URLS[0], "llama", "bgmv", "cpu"),
                        [AdapterRecord("c", "llama", 8)])  # fmt: skip
    assert registry.get_adapter("c").sha256 == DIGEST
    for bad in ("AB" * 32, "ab" * 31, "zz" * 32, 7):
        with pytest.raises(RegistryError):
            AdapterRecord("d", "llama", 8, sha256=bad)


def test_a_v1_file_is_migrated_in_place(tmp_path):
    path = tmp_path / "v1.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(V1)
    conn.close()
    reg = Registry(path)
    try:
        conn = reg._conn()
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
        old = reg.get_adapter("old")
        assert (old.rank, old.path, old.sha256) == (8, "/a/old", None)
        assert reg.hosting() == {URLS[0]: {"old"}}
        reg.put_adapter(AdapterRecord("old", "llama", 8, path="/a/old", sha256=DIGEST))
        reg.put_routes([("old", URLS[0], 1.0)], 1)
        assert reg.routes() == {"old": {URLS[0]: 1.0}}
    finally:
        reg.close()
    again = Registry(path)  # reopening a migrated file changes nothing
    try:
        assert again.get_adapter("old").sha256 == DIGEST
    finally:
        again.close()
