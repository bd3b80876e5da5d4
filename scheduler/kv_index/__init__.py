"""Which server holds which KV block: an index fed by the servers' KV cache events (vLLM's
schema, docs/production.md "KV cache events"). Built only from the published protocol: the
wire format, and the block hash (server/kv_events/block_hash.py, one of the HTTP contract's
modules, which import nothing of toppings, so that server and router hash alike by
construction). The routing policy that scores
servers by it comes later (issue 65)."""
