"""One inference server: model, KV cache, engine and HTTP API."""
