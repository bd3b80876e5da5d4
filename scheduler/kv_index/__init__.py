"""Which server holds which KV block: an index fed by the servers' KV cache events (vLLM's
schema, docs/production.md "KV cache events"), and what prefix routing reads of it. Built only
from the published protocol: the wire format, the `/stats` field that names each server's
endpoints (`kv_events`), and the block hash (server/kv_events/block_hash.py, one of the HTTP
contract's modules, which import nothing of toppings, so that server and router hash alike by
construction).

    index.py       which server holds which block hash, fed batch by batch in sequence order
    subscriber.py  one server's events over ZMQ into the index (replays fill gaps)
    prefix_key.py  a request's block hashes, as the server will announce them
    feeds.py       a subscriber per server that announces events, and each server's freshness:
                   the longest prefix it holds of a request, or unknown when its index is stale
"""
