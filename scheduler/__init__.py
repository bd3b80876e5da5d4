"""Cluster scheduler: SQLite registry, Eq. 2 perf models, policies, Flask proxy, simulator."""
