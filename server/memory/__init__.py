"""One memory for KV and adapters: the pool, the prefix tree per adapter, eviction policies,
the host tier."""
