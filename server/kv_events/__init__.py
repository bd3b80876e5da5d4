"""KV cache events in vLLM's schema: what the prefix cache stores and removes, published for
routers that score servers by the blocks they hold (llm-d's precise prefix-cache scorer,
Dynamo's KV router). See docs/production.md, "KV cache events"."""
