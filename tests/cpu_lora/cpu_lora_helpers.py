"""Helpers of the cpu_lora tests: a tiny model, random adapters, the float32 reference."""

from __future__ import annotations

import torch

from tests.helpers import adapter_id, tiny_model_config
from toppings.gpu_lora.kernels.reference import mbgmv_prefill
from toppings.gpu_lora.peft.adapter import LoraAdapter
from toppings.server.model.config import ModelConfig

QKV = ("q_proj", "k_proj", "v_proj")


def tiny_config() -> ModelConfig:
    """H 128, q 128, k/v 64, MLP 256, 3 layers."""
    return tiny_model_config()


def make_adapter(
    name: str, rank: int, modules: tuple[str, ...], layers=None, seed: int = 0
) -> LoraAdapter:
    """A random LoRA (small weights, like a trained one) on `modules` of `layers` (default all)."""
    cfg = tiny_config()
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in layers if layers is not None else range(cfg.num_layers):
        for module in modules:
            h_in, h_out = cfg.projection_shape(module)
            a = torch.randn(rank, h_in, generator=gen) / h_in**0.5  # [R, H_in]
            b = torch.randn(h_out, rank, generator=gen) / rank**0.5  # [H_out, R]
            weights[(layer, module)] = (a, b)
    num_bytes = sum(4 * (a.numel() + b.numel()) for a, b in weights.values())
    return LoraAdapter(
        name=name,
        path="",
        rank=rank,
        alpha=2.0 * rank,
        scale=2.0,
        target_modules=modules,
        weights=weights,
        num_bytes=num_bytes,
        base_model=None,
        id=adapter_id(name),
    )


def reference(adapters, layer, x, segments, modules):
    """float32 oracle: gpu_lora's mbgmv_prefill over a column pool of the segments' adapters."""
    by_id = {a.id: a for a in adapters}
    cuts, covered = [], 0
    for adapter, start, end in sorted(segments, key=lambda s: s[1]):
        if start > covered:
            cuts.append((None, covered, start))
        cuts.append((adapter, start, end))
        covered = end
    cuts.append((None, covered, x.shape[0]))
    cfg, outs = tiny_config(), {}
    for module in modules:
        h_in, h_out = cfg.projection_shape(module)
        cols_a, cols_b, rows, off = [torch.zeros(0, h_in)], [torch.zeros(0, h_out)], [], 0
        for adapter, _, _ in cuts:
            ad = by_id.get(adapter)
            if ad is None or (layer, module) not in ad.weights:
                rows.append((0, 0, 0.0))  # rank 0: no adapter, rows stay zero
                continue
            a, b = ad.weights[(layer, module)]
            cols_a.append(a)
            cols_b.append(b.T)
            rows.append((off, ad.rank, ad.scale))
            off += ad.rank
        y = torch.zeros(x.shape[0], h_out)
        starts = torch.tensor([c[1] for c in cuts] + [x.shape[0]])
        offsets, ranks, scales = (torch.tensor(col) for col in zip(*rows))
        lora_a, lora_b = torch.cat(cols_a), torch.cat(cols_b)
        mbgmv_prefill(y, x.float(), lora_a, lora_b, starts, offsets, ranks, scales.float())
        outs[module] = y
    return outs
