-- LoRA registry of the cluster scheduler (schema version 2).
-- Applied by scheduler/registry.py inside one transaction when PRAGMA user_version is 0 (a v1
-- file is migrated by the statements in scheduler/registry.py, MIGRATIONS); the
-- connection sets journal_mode=WAL and foreign_keys=ON (both are per-database/per-connection
-- settings, so they live in the code, not here). Times are Unix seconds.

CREATE TABLE base_models (
    name        TEXT PRIMARY KEY,
    path        TEXT,                      -- checkpoint directory or .gguf, when known
    created_at  REAL NOT NULL
);

CREATE TABLE adapters (
    name            TEXT PRIMARY KEY,      -- the OpenAI "model" a client asks for
    base_model      TEXT NOT NULL REFERENCES base_models(name) ON DELETE RESTRICT,
    rank            INTEGER NOT NULL CHECK (rank > 0),
    alpha           REAL,                  -- lora_alpha; NULL when the server did not say
    target_modules  TEXT NOT NULL DEFAULT '[]',  -- JSON list, e.g. ["q_proj","k_proj","v_proj"]
    path            TEXT,                  -- PEFT directory, when known
    num_bytes       INTEGER CHECK (num_bytes IS NULL OR num_bytes >= 0),
    state           TEXT NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'disabled')),
    updated_at      REAL NOT NULL,
    -- SHA-256 of the PEFT files (server/peer_fetch.py, adapter_digest), hex; a server that
    -- fetches the adapter from a peer refuses files that do not hash to it
    sha256          TEXT CHECK (sha256 IS NULL
                                OR (length(sha256) = 64 AND sha256 NOT GLOB '*[^0-9a-f]*'))
);

CREATE TABLE servers (
    url         TEXT PRIMARY KEY,          -- e.g. http://10.0.0.5:8100
    base_model  TEXT NOT NULL REFERENCES base_models(name) ON DELETE RESTRICT,
    kernel      TEXT NOT NULL CHECK (kernel IN ('bgmv', 'mbgmv')),
    device      TEXT NOT NULL,
    healthy     INTEGER NOT NULL DEFAULT 1 CHECK (healthy IN (0, 1)),
    last_seen   REAL NOT NULL,
    added_at    REAL NOT NULL              -- fixes the server order first-fit walks
);

-- Which server hosts which adapter (in its node's host memory, ready to load).
CREATE TABLE server_adapters (
    server_url    TEXT NOT NULL REFERENCES servers(url) ON DELETE CASCADE,
    adapter_name  TEXT NOT NULL REFERENCES adapters(name) ON DELETE CASCADE,
    PRIMARY KEY (server_url, adapter_name)
);

-- LoRAServe's routing table (--policy loraserve): a request for adapter_name goes to
-- server_url with probability; the probabilities of an adapter sum to 1. Rewritten whole by each
-- placement step (step counts them).
CREATE TABLE routes (
    adapter_name  TEXT NOT NULL REFERENCES adapters(name) ON DELETE CASCADE,
    server_url    TEXT NOT NULL REFERENCES servers(url) ON DELETE CASCADE,
    probability   REAL NOT NULL CHECK (probability > 0 AND probability <= 1),
    step          INTEGER NOT NULL,
    PRIMARY KEY (adapter_name, server_url)
);

CREATE INDEX server_adapters_by_adapter ON server_adapters(adapter_name);
CREATE INDEX routes_by_server ON routes(server_url);
CREATE INDEX adapters_by_base_model ON adapters(base_model);
