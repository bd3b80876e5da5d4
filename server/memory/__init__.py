"""One owner of the node's device memory for KV and adapters (built by build.py): the layout,
the KV pool, the prefix tree per adapter, admission accounting, reclaim and its policies, the
host tier."""
