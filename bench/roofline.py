"""What a workload must cost at the least on this machine: FLOPs, bytes, and their measured rates.

A decode step of B requests must run every linear layer over B rows (FLOPs) and must read every
weight once, each request's KV cache and each used adapter's A and B (bytes). Its roofline time
is the larger of FLOPs / the peak GEMM rate of the model's own projections (measured at many
rows: at B rows a GEMM is itself bound by reading its weights, which the bytes count) and
bytes / the measured read bandwidth; a step that takes that long is at the roofline (fraction 1).
On a CPU with a 1B model and B = 64 the FLOPs usually bound the step; at B = 1 the bytes do.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from toppings.server.model.config import ModelConfig

BANDWIDTH_BYTES = 512 << 20  # the probe buffer: far above any CPU's last-level cache


def layer_params(cfg: ModelConfig) -> int:
    """Weights of one decoder layer's linear projections (biases and norms not counted)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    return h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 3 * h * i


def linear_flops(cfg: ModelConfig, prompt_len: int, new_tokens: int, num_requests: int):
    """(prefill, decode) FLOPs of the workload's linear layers (attention scores not counted).

    Prefill runs the layers over every prompt token and lm_head over the last one; each later
    token runs both once (the last sampled token is never fed back).
    """
    layers = 2 * layer_params(cfg) * cfg.num_layers
    head = 2 * cfg.hidden_size * cfg.vocab_size
    prefill = num_requests * (prompt_len * layers + head)
    decode = num_requests * (new_tokens - 1) * (layers + head)
    return prefill, decode


def decode_step_bytes(
    cfg: ModelConfig,
    itemsize: int,
    batch: int,
    context: float,
    adapter_ranks: Sequence[int],
    targets: Sequence[str],
) -> dict[str, float]:
    """Bytes one decode step of `batch` requests must read, by kind, with `itemsize`-byte elements.

    weights: every layer's projections and norms, the final norm and the [vocab, H] lm_head
    (a tied lm_head is the embedding; the embedding lookup itself reads only `batch` rows;
    biases, a few KiB where a family has them, are not counted).
    kv: K and V of `context` positions per request in every layer. adapters: A [R, in] and
    B [out, R] of each adapter in `adapter_ranks` on each target projection of every layer.
    """
    h = cfg.hidden_size
    per_layer = layer_params(cfg) + 2 * h
    weights = cfg.num_layers * per_layer + h + cfg.vocab_size * h + batch * h
    kv = batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
    lora = cfg.num_layers * sum(
        rank * sum(cfg.projection_shape(t)) for rank in adapter_ranks for t in targets
    )
    return {"weights": weights * itemsize, "kv": kv * itemsize, "adapters": lora * itemsize}


def bandwidth_probe(nbytes: int = BANDWIDTH_BYTES) -> torch.Tensor:
    """The float32 tensor of `nbytes` bytes that read_rate_gbps reads."""
    return torch.ones(nbytes // 4, dtype=torch.float32)


def read_rate_gbps(x: torch.Tensor, repeats: int) -> float:
    """Best read rate (GB/s) of `torch.sum` over the float32 tensor x, `repeats` times, with the
    current torch thread count (what the engine's kernels get)."""
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return best


def memory_bandwidth_gbs(rounds: int = 5) -> float:
    """Read bandwidth in GB/s: `read_rate_gbps` of a fresh 512 MiB float32 buffer."""
    x = bandwidth_probe()
    x.sum()  # warm-up: pages faulted in
    return read_rate_gbps(x, rounds)


def gemm_gflops(model, num_tokens: int, rounds: int = 5) -> float:
    """GFLOP/s of the model's own projections (layer 0 and lm_head) at num_tokens rows."""
    layer = model.layers[0]
    linears = [layer.qkv, layer.o, layer.gate_up, layer.down, model.lm_head]
    xs = [torch.randn(num_tokens, lin.in_features, dtype=model.dtype) for lin in linears]
    flops = sum(2 * num_tokens * lin.in_features * lin.out_features for lin in linears)
    for lin, x in zip(linears, xs):
        lin(x)  # warm-up
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for lin, x in zip(linears, xs):
            lin(x)
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e9
