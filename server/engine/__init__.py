"""The engine loop: continuous batching, adapter residency, sampling."""
