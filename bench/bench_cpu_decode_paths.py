"""CPU decode paths of the LoRA step side by side, per kernel and dtype.

- runs: requests ordered by adapter, `LoraBatch` calls the torch segment kernel once per run of
  one adapter's tokens (built once per step, as the engine does): the engine's BGMV path.
- native_runs: the same with the native MBGMV kernel, one call per projection over every run:
  the engine's MBGMV kernel where the native kernels are built (`gpu_lora/kernels/native.py`).
- unsorted: the decode kernel on tokens in arrival order (it sorts them into runs per call:
  a gather and a scatter per projection).
- dense: the masked dense product the engine used before (every token times the rows of every
  adapter of the batch, other adapters' columns zeroed), kept here as the baseline.
- host_native / host_matmuls (MBGMV rows): the same step with every request served from the
  host (cpu-assisted, no device room), from the adapters' host copies as a load holds them: the
  native call over them (`HostLora.add`, gpu_lora/host_runs.py) against the torch matmul pair
  per segment and projection it replaced (`HostLora.run`, then added).

Shapes: SmolLM2's q/k/v (H 576, kv 192) over 30 layers, B requests over A adapters of ranks
8/16/32/64, one thread. Rounds alternate the order of the paths; medians are reported.

    python -m bench.bench_cpu_decode_paths [--batch 64] [--adapters 16] [--rounds 9]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

from bench.envelope import describe_device, write_result
from toppings.gpu_lora.adapter_pool import AdapterPool
from toppings.gpu_lora.host_lora import HostLora, add_deltas
from toppings.gpu_lora.kernels import BACKENDS, LoraKernel, native
from toppings.gpu_lora.kernels import cpu as cpu_kernels
from toppings.gpu_lora.lora_batch import LoraBatch
from toppings.gpu_lora.peft.adapter import LoraAdapter
from toppings.server.model.config import ModelConfig

QKV = ("q_proj", "k_proj", "v_proj")
LAYERS = 30  # SmolLM2's; one pool layer is reused for each


def smollm2_shapes() -> ModelConfig:
    return ModelConfig(
        name="smollm2-shapes", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=1e4, max_position_embeddings=2048, tie_word_embeddings=True,
        eos_token_ids=(0,),
    )  # fmt: skip


def random_adapter(config: ModelConfig, name: str, rank: int, seed: int) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for module in QKV:
        h_in, h_out = config.projection_shape(module)
        weights[(0, module)] = (torch.randn(rank, h_in, generator=gen) / h_in**0.5,
                                torch.randn(h_out, rank, generator=gen) / rank**0.5)  # fmt: skip
    num_bytes = sum((a.numel() + b.numel()) * 4 for a, b in weights.values())
    return LoraAdapter(name, "/random", rank, 2.0 * rank, 2.0, QKV, weights, num_bytes, None)


def held_as_loaded(adapter: LoraAdapter, dtype: torch.dtype) -> LoraAdapter:
    """The adapter's host copy as `load_peft_adapter` holds it: at `dtype`, each B over a
    contiguous B^T."""
    weights = {key: (a.to(dtype).contiguous(), b.T.to(dtype).contiguous().T)
               for key, (a, b) in adapter.weights.items()}  # fmt: skip
    return dataclasses.replace(adapter, weights=weights)


def dense_delta(pool: AdapterPool, batch: list, padded: bool):
    """The masked dense baseline: per module, the rows of every adapter of the batch and a
    [B, R_tot] mask holding each token's scale on its own adapter's columns."""
    distinct = sorted(set(batch), key=lambda a: a.offset)
    max_rank = max(a.rank for a in distinct)
    rows, cols, width = [], {}, 0
    for a in distinct:
        span = min(max_rank, pool.rows["q_proj"].capacity - a.offset) if padded else a.rank
        cols[a.name] = width
        rows.append(torch.arange(a.offset, a.offset + span))
        width += span
    index = torch.cat(rows)
    mask = torch.zeros(len(batch), width, dtype=pool.dtype)  # [B, R_tot]
    for i, a in enumerate(batch):
        mask[i, cols[a.name] : cols[a.name] + a.rank] = a.scale

    def add(module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        a = pool.lora_a[module][0][index]  # [R_tot, H_in]
        b = pool.lora_b[module][0][index]  # [R_tot, H_out]
        y += ((x @ a.T) * mask) @ b

    return add


def time_paths(kernel: str, dtype: torch.dtype, args) -> dict[str, float]:
    """Median seconds of one decode step's q/k/v LoRA over LAYERS layers, per path."""
    config = smollm2_shapes()
    pool = AdapterPool(config, dtype, "cpu")
    ranks = [(8, 16, 32, 64)[i % 4] for i in range(args.adapters)]
    adapters = [random_adapter(config, f"a{i}", r, i) for i, r in enumerate(ranks)]
    for a in adapters:
        pool.add(a)
    rng = random.Random(0)
    batch = [pool.resident[adapters[rng.randrange(len(adapters))].id] for _ in range(args.batch)]
    x = torch.randn(args.batch, config.hidden_size, dtype=dtype)
    offsets = torch.tensor([a.offset for a in batch], dtype=torch.int32)
    ranks_t = torch.tensor([a.rank for a in batch], dtype=torch.int32)
    scales = torch.tensor([a.scale for a in batch], dtype=torch.float32)
    decode_fn = getattr(cpu_kernels, f"{kernel}_decode")
    kernels = BACKENDS["cpu"](LoraKernel(kernel), dtype)  # the torch kernels
    outs = {m: torch.zeros(args.batch, config.projection_shape(m)[1], dtype=dtype) for m in QKV}

    def runs() -> None:
        lora = LoraBatch(pool, kernels, sorted(batch, key=lambda a: a.name),
                         list(range(args.batch + 1)), is_prefill=False)  # fmt: skip
        for _ in range(LAYERS):
            lora.add(0, x, tuple(outs.items()))

    native_kernels = dataclasses.replace(kernels, segment_decode=native.mbgmv_runs)

    def native_runs() -> None:
        lora = LoraBatch(pool, native_kernels, sorted(batch, key=lambda a: a.name),
                         list(range(args.batch + 1)), is_prefill=False)  # fmt: skip
        for _ in range(LAYERS):
            lora.add(0, x, tuple(outs.items()))

    def unsorted() -> None:
        for _ in range(LAYERS):
            for m in QKV:
                decode_fn(outs[m], x, pool.lora_a[m][0], pool.lora_b[m][0], offsets, ranks_t,
                          scales, max(ranks))  # fmt: skip

    def dense() -> None:
        add = dense_delta(pool, batch, padded=kernel == "bgmv")
        for _ in range(LAYERS):
            for m in QKV:
                add(m, x, outs[m])

    host = HostLora({a.id: held_as_loaded(a, dtype) for a in adapters})
    segments = []  # (adapter id, start, end) per run of one adapter's tokens, as LoraBatch's
    for i, a in enumerate(sorted(batch, key=lambda a: a.name)):
        if segments and segments[-1][0] == a.id:
            segments[-1] = (a.id, segments[-1][1], i + 1)
        else:
            segments.append((a.id, i, i + 1))

    def host_native() -> None:
        for _ in range(LAYERS):
            host.add(0, x, segments, tuple(outs.items()))

    def host_matmuls() -> None:
        for _ in range(LAYERS):
            add_deltas(host, 0, x, segments, tuple(outs.items()))

    paths = [("runs", runs), ("unsorted", unsorted), ("dense", dense)]
    if kernel == "mbgmv":
        paths.append(("host_matmuls", host_matmuls))
    if kernel == "mbgmv" and native.available(dtype):
        paths += [("native_runs", native_runs), ("host_native", host_native)]
    times: dict[str, list[float]] = {name: [] for name, _ in paths}
    for _, fn in paths:
        fn()  # warm-up
    for r in range(args.rounds):
        for name, fn in paths if r % 2 == 0 else paths[::-1]:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench/results/cpu_decode_paths.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    metrics = {}
    for kernel in ("mbgmv", "bgmv"):
        for dtype in (torch.bfloat16, torch.float32):
            t = time_paths(kernel, dtype, args)
            key = f"{kernel}_{str(dtype).removeprefix('torch.')}"
            metrics[key] = {f"{name}_ms": round(v * 1e3, 2) for name, v in t.items()}
            metrics[key]["dense_vs_runs"] = round(t["dense"] / t["runs"], 3)
            if "host_native" in t:  # a host-served step against the same step from the pool
                metrics[key]["host_native_vs_native_runs"] = round(
                    t["host_native"] / t["native_runs"], 3
                )
                metrics[key]["host_native_vs_host_matmuls"] = round(
                    t["host_native"] / t["host_matmuls"], 3
                )
            print(key, metrics[key])
    config = {"batch": args.batch, "adapters": args.adapters, "ranks": [8, 16, 32, 64],
              "layers": LAYERS, "modules": list(QKV), "rounds": args.rounds,
              "threads": args.threads, "shapes": "SmolLM2-135M q/k/v"}  # fmt: skip
    write_result(args.out, "cpu_decode_paths", "bench_cpu_decode_paths", device=describe_device(),
                 config=config, metrics=metrics, argv=argv)  # fmt: skip


if __name__ == "__main__":
    main()
