"""Where a cold adapter's resolution goes: each stage, timed on the real engine.

The adapters of bench_adapter_scale (`--adapter-dir`, ranks 8-64 on q, k, v, o of SmolLM2), on
an engine configured as that bench's servers (bfloat16, on-demand, static memory layout, a room
of 8 mean adapters), one adapter at a time, nothing else running in the process. Per adapter,
in the order a resolution runs them (server/resolver):

- `paths`: the path checks of the load (`AdapterPaths.resolve`: realpath under the root)
- `open`: `Engine.open_adapter`, the read: the safetensors header and rank and room checks, the
  file read and parse, the shape and finiteness checks, the LoRA-product overflow check
- `digest`: `ContentKey`, what registration dedupes by (the sha256 of the weights only where
  its probe matches a held copy's)
- `register`: `Engine.register_adapter` with that digest (host memory, the name table)
- `copy`: the copy into the device room (`AdapterCache.acquire` until its load is done)
- `remove`: `Engine.remove_adapter`

and then, on the same files (now in the page cache), `open` taken apart: `read` (the file's
bytes), `parse` (safetensors), `load_peft` (read, parse, checks, and the copies at the dtype the
engine holds adapters at) and `finite_delta` (`check_finite_delta`). `--cold` first drops each
adapter's files from the page cache (posix_fadvise DONTNEED, those files only) so that `open`
reads from the disk.

Last, whole resolutions through the server's resolver (`ResolvedAdapters` with the load
endpoint's registrar, room for one resolved adapter, so that each evicts the one before), each
name in turn: `resolve_read` without a host tier (the evicted adapter's memory is freed, and the
next read reuses it), then with the default host tier `resolve_read_tier_filling` (the files
read while the tier keeps every evicted adapter: the read's memory is new, and its first touch
costs page faults until the tier is full) and, each name again, `resolve_kept` (from the tier).

    python -m bench.profile_resolution --num 64 [--cold] --out bench/results/resolution_profile.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry
from safetensors.torch import load

from bench.bench_adapter_scale import RANKS, adapter_names
from bench.common import adapter_bytes
from bench.envelope import describe_device, write_result
from toppings.gpu_lora.host_memory import ContentKey
from toppings.gpu_lora.peft.adapter import load_peft_adapter
from toppings.gpu_lora.peft.config import WEIGHTS_FILE
from toppings.gpu_lora.validate import check_finite_delta
from toppings.server.api.admin.lifecycle import AdapterAdmin, AdapterPaths
from toppings.server.api.options import ApiOptions
from toppings.server.config import EngineConfig
from toppings.server.model.loader import resolve_model_dir
from toppings.server.resolver.metrics import ResolverMetrics
from toppings.server.resolver.resolved import ResolvedAdapters
from toppings.server.resolver.sources import DirSource
from toppings.server.runtime import build_engine

STAGES = ("paths", "open", "digest", "register", "copy", "remove")
PARTS = ("read", "parse", "load_peft", "finite_delta")
RESOLUTIONS = ("resolve_read", "resolve_read_tier_filling", "resolve_kept")
EVERY = STAGES + PARTS + RESOLUTIONS


def drop_from_page_cache(directory: Path) -> None:
    for name in os.listdir(directory):
        fd = os.open(directory / name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def summary(values: list[float]) -> dict:
    return {"median_ms": statistics.median(values), "mean_ms": statistics.mean(values),
            "max_ms": max(values)}  # fmt: skip


def profile(engine, root: Path, names: list[str], cold: bool) -> dict[str, dict[str, list]]:
    """Per rank, per stage: the times in ms."""
    paths = AdapterPaths([root])
    room = engine.lora.cache
    times: dict[str, dict[str, list]] = {}
    for name in names:
        if cold:
            drop_from_page_cache(root / name)
        clock = [time.perf_counter()]
        real = paths.resolve(name)
        clock.append(time.perf_counter())
        adapter = engine.open_adapter(name, real)
        clock.append(time.perf_counter())
        digest = ContentKey(adapter)
        clock.append(time.perf_counter())
        ref = engine.register_adapter(adapter, digest)
        clock.append(time.perf_counter())
        entry = room.acquire(engine.lora.host.lookup(ref))
        entry.ticket.wait()
        clock.append(time.perf_counter())
        room.release(ref.weights_id)
        engine.remove_adapter(name)
        clock.append(time.perf_counter())
        rank = times.setdefault(str(adapter.rank), {k: [] for k in EVERY})
        for stage, (t0, t1) in zip(STAGES, zip(clock, clock[1:]), strict=True):
            rank[stage].append(1000 * (t1 - t0))
        # `open` taken apart, on the files just read
        t0 = time.perf_counter()
        data = (root / name / WEIGHTS_FILE).read_bytes()
        t1 = time.perf_counter()
        load(data)
        t2 = time.perf_counter()
        loaded = load_peft_adapter(
            real, engine.model_config, name=name, dtype=engine.lora.host.weights_dtype
        )
        t3 = time.perf_counter()
        check_finite_delta(loaded, engine.model.dtype)
        t4 = time.perf_counter()
        for part, ms in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            rank[part].append(1000 * ms)
    for kind in RESOLUTIONS:
        if kind != "resolve_kept":
            host_bytes = ApiOptions().lora_resolver_host_bytes if "tier" in kind else 0
            resolver = ResolvedAdapters(engine, DirSource(str(root)),
                                        AdapterAdmin(engine, AdapterPaths([root])),
                                        ResolverMetrics(CollectorRegistry(), "toppings:"),
                                        max_adapters=1, max_loading=1,
                                        host_bytes=host_bytes)  # fmt: skip
        for name in names:
            if cold and kind != "resolve_kept":
                drop_from_page_cache(root / name)
            t0 = time.perf_counter()
            with resolver.lease() as resolve:
                ref = resolve(name)
            times[str(ref.rank)][kind].append(1000 * (time.perf_counter() - t0))
        if kind == "resolve_read":
            engine.remove_adapter(names[-1])  # the next resolver starts from nothing
    hits = resolver.metrics.host_hits._value.get()
    if hits != len(names):
        raise SystemExit(f"{hits:g} of the {len(names)} second resolutions came from the host "
                         "tier: it holds fewer adapters than --num")  # fmt: skip
    return times


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num", type=int, default=64, help="adapters profiled (ranks in turn)")
    p.add_argument("--first", type=int, default=512, help="index of the first adapter")
    p.add_argument("--cold", action="store_true", help="drop each adapter from the page cache")
    p.add_argument(
        "--adapter-dir",
        type=Path,
        default=Path.home() / ".cache/toppings/bench_adapters/smollm2-qkvo-1024",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/resolution_profile.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # a reader thread's torch (server.resolver.preparer)
    model_dir = str(resolve_model_dir(args.model))
    all_names = list(adapter_names(1024))
    names = all_names[args.first : args.first + args.num]
    mean = sum(
        adapter_bytes(args.adapter_dir / next(n for n in all_names if n.endswith(f"-r{r}")),
                      model_dir, torch.bfloat16)
        for r in RANKS
    ) / len(RANKS)  # fmt: skip
    config = EngineConfig(dtype="bfloat16", lora_mode="on-demand", memory_layout="static",
                          adapter_cache_bytes=int(8 * mean), max_total_tokens=16384)  # fmt: skip
    engine = build_engine(model_dir, config, {})
    load_start = os.getloadavg()
    try:
        times = profile(engine, args.adapter_dir, names, args.cold)
    finally:
        engine.shutdown()
    every = {k: [v for rank in times.values() for v in rank[k]] for k in EVERY}
    metrics = {
        "all": {k: summary(v) for k, v in every.items()},
        "per_rank": {r: {k: summary(v) for k, v in t.items()} for r, t in sorted(times.items())},
        "resolution_mean_ms": sum(statistics.mean(every[k]) for k in STAGES[:4]),
    }
    result = write_result(args.out, "resolution_profile", "profile_resolution",
                          device=describe_device(), argv=argv,
                          config={"num": args.num, "first": args.first, "cold": args.cold,
                                  "adapter_dir": str(args.adapter_dir), "torch_threads": 1,
                                  "load_average_at_start_and_end": [load_start,
                                                                    os.getloadavg()]},
                          metrics=metrics)  # fmt: skip
    for k in EVERY:
        m = metrics["all"][k]
        print(f"{k:13s} median {m['median_ms']:6.1f} ms  mean {m['mean_ms']:6.1f}")
    return result


if __name__ == "__main__":
    main()
