"""One owner of the node's device memory for KV and adapters (built by build.py): the layout,
the KV pool, the prefix tree per adapter, admission accounting, reclaim (in the order of the
node's one eviction table, gpu_lora/eviction.py), the host tier."""
