"""Adapters found on first use: `--lora-resolver` sources and the load-on-miss table."""
