"""The cost of the cluster scheduler's `/stats` poll with thousands of adapters registered, with
the adapter list asked every time and only when it changed (`GET /stats?adapters_since=V`,
server/engine/reports.py); writes bench/results/stats_poll.json.

One engine on a tiny random Llama with `--adapters` names registered, all of one random rank-8
adapter's weights (one host copy: the registration and the list cost what they cost for any
adapters). The poll is the scheduler's own: `Cluster.refresh` against the engine's Flask app
through its test client, so each poll is the server's /stats (the engine's report, its JSON)
and the scheduler's parse and routing state. Per way, `--polls` polls after 3 unmeasured ones;
rounds alternate the order of the two ways. Reported: the body's bytes and the median poll's
milliseconds (min-max over the rounds), and the ratio changed-only / every time, paired by round.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_single_stream import HelpFormatter, spread
from bench.common import alternating
from bench.envelope import describe_device, write_result

log = logging.getLogger("bench_stats_poll")
WAYS = ("every_time", "changed_only")


def build(work: Path, num_adapters: int):
    """A started tiny engine with `num_adapters` names of one adapter, and its app's client."""
    from toppings.scripts.make_adapters import make_random_adapter
    from toppings.scripts.make_tiny_llama import make_tiny_llama
    from toppings.server.api.app import create_app
    from toppings.server.config import EngineConfig
    from toppings.server.engine.engine import Engine
    from toppings.server.model.loader import load_checkpoint

    model = make_tiny_llama(work / "tiny")
    adapter = make_random_adapter(work / "a", model, rank=8, seed=0)
    engine = Engine(EngineConfig(dtype="float32", max_total_tokens=1024), load_checkpoint(model))
    for i in range(num_adapters):
        engine.register_adapter(engine.open_adapter(f"a{i}", str(adapter)))
    engine.start()
    return engine, create_app(engine).test_client()


def poll_ms(client, polls: int, changed_only: bool, root: Path) -> tuple[float, int]:
    """The median of `polls` timed `Cluster.refresh` calls (ms) and the last body's bytes."""
    from toppings.scheduler.cluster import Cluster
    from toppings.scheduler.registry import Registry

    sizes = []

    def fetch(url: str) -> dict:
        path = url.removeprefix("http://s")
        if not changed_only:
            path = path.split("?")[0]  # the scheduler before: the whole list every poll
        response = client.get(path)
        sizes.append(len(response.get_data()))
        return response.get_json()

    registry = Registry(root / f"reg-{changed_only}-{time.monotonic_ns()}.sqlite")
    cluster = Cluster(registry, fetch)
    try:
        cluster.add_server("http://s")
        times = []
        for i in range(polls + 3):
            start = time.perf_counter()
            cluster.refresh("http://s")
            if i >= 3:
                times.append(1000 * (time.perf_counter() - start))
        return statistics.median(times), sizes[-1]
    finally:
        cluster.stop()
        registry.close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add = parser.add_argument
    add("--adapters", type=int, default=5000, help="adapter names registered")
    add("--polls", type=int, default=30, help="timed polls per way and round")
    add("--rounds", type=int, default=3, help="rounds, the order of the ways alternating")
    add("--out", type=Path, default=Path("bench/results/stats_poll.json"), help="result file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("toppings").setLevel(logging.WARNING)  # a line per registration
    work = Path(tempfile.mkdtemp(prefix="stats_poll_"))
    started = time.perf_counter()
    engine, client = build(work, args.adapters)
    log.info("%d adapters registered in %.1f s", args.adapters, time.perf_counter() - started)
    rows: dict[str, list[tuple[float, int]]] = {way: [] for way in WAYS}
    try:
        for r, way in alternating(WAYS, args.rounds):
            rows[way].append(poll_ms(client, args.polls, way == "changed_only", work))
            log.info("round %d %s: %.2f ms a poll, %d bytes", r, way, *rows[way][-1])
    finally:
        engine.shutdown()
    metrics: dict = {
        way: {"poll_ms": spread([ms for ms, _ in rows[way]]), "body_bytes": rows[way][-1][1]}
        for way in WAYS
    }
    ratios = [c[0] / e[0] for c, e in zip(rows["changed_only"], rows["every_time"])]
    metrics["poll_ms_ratio_changed_only_vs_every_time"] = spread(ratios)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config["model"] = "tiny Llama (2 layers, 64 wide), one rank-8 adapter under every name"
    write_result(args.out, "stats_poll", "bench_stats_poll", device=describe_device(),
                 config=config, metrics=metrics, argv=argv)  # fmt: skip
    medians = [metrics[way]["poll_ms"]["median"] for way in WAYS]
    log.info("poll: every time %s ms, changed only %s ms, ratios %s", *medians, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
