"""The request contract: what a request is, its state in the engine, its errors and the /stats
schema."""
