"""Command-line drivers: per-node launcher, load generator, model and adapter makers, benchmarks."""
