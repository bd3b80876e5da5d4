"""Benchmark and profiling drivers, run from the repository root as `python -m bench.NAME`.

Not installed with the package: each driver imports the product as `toppings.…` and writes
bench/results/NAME.json through bench.envelope.
"""
