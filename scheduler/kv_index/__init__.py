"""Which server holds which KV block: an index fed by the servers' KV cache events (vLLM's
schema, docs/production.md "KV cache events"). Built only from the published protocol (the
wire format and the block hash), never from the server's code. The routing policy that scores
servers by it comes later (issue 65)."""
