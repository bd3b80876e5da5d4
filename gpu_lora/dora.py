"""DoRA (weight-decomposed LoRA, PEFT's `use_dora=True`): the per-output-channel scale of each
adapted projection, computed once when the adapter is read, and its application to a step's rows.

PEFT (peft/tuners/lora/dora.py, `DoraLinearLayer`) keeps a magnitude vector m [H_out] per
adapted module and computes, with dropout off,

    weight_norm = ||W + s * B @ A||_2 over in_features (dim 1 of W [H_out, H_in]), per row
    g = m / weight_norm                                              # [H_out]
    result = base(x) + (g - 1) * (base(x) - bias) + g * s * lora(x)
           = g * (x @ W.T + s * x @ A.T @ B.T) + bias

so a projection's output with its LoRA delta already added, y = x @ W.T + bias + delta, becomes
g * y + (1 - g) * bias: one multiply and (where the base has a bias) one add per row, after the
delta is in y wherever it was computed (device kernels or host workers). `g` depends only on the
weights, so it is computed here once, from the base model's float weights (as PEFT's forward
computes it on the unmerged weight), and `(1 - g) * bias` with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from toppings.gpu_lora.peft.config import AdapterError, module_name


class BaseProjections(Protocol):
    """The base model's projection weights, as the checkpoint holds them."""

    def projection(self, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(W [H_out, H_in], bias [H_out] or None) of `module` in `layer`, any float dtype."""
        ...


@dataclass(frozen=True)
class DoraScales:
    """Per adapted module: the scale g [L, H_out] and the offset (1 - g) * bias [L, H_out]
    (None where the projection has no bias); layers the adapter leaves alone have g = 1."""

    modules: dict[str, tuple[torch.Tensor, torch.Tensor | None]]

    def to(self, device: torch.device | str, dtype: torch.dtype) -> DoraScales:
        """A copy on `device` at `dtype` (the dtype the model's projections compute in)."""
        return DoraScales(
            {
                m: (g.to(device, dtype), None if o is None else o.to(device, dtype))
                for m, (g, o) in self.modules.items()
            }
        )

    @property
    def num_bytes(self) -> int:
        return sum(g.nbytes + (0 if o is None else o.nbytes) for g, o in self.modules.values())


def dora_scales(
    name: str,
    scale: float,
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    magnitudes: dict[tuple[int, str], torch.Tensor],
    base: BaseProjections,
    num_layers: int,
) -> DoraScales:
    """The DoRA scales of an adapter (module docstring), float32.

    weights: (A [R, H_in], B [H_out, R]) per (layer, module); magnitudes: m [H_out] for the
    same pairs; scale: the adapter's lora_alpha / r (or / sqrt(r) with rsLoRA). Raises
    AdapterError when a scale is not finite (a zero column norm)."""
    per_module: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for module in _modules(magnitudes):
        g_rows, offset_rows, has_bias = [], [], False
        for layer in range(num_layers):
            w, bias = base.projection(layer, module)
            out_features = w.shape[0]
            m = magnitudes.get((layer, module))
            if m is None:  # a layer the adapter does not transform
                g = torch.ones(out_features)
            else:
                a, b = weights[(layer, module)]
                adapted = w.to(torch.float32) + scale * (b @ a)  # [H_out, H_in]
                g = m / torch.linalg.norm(adapted, dim=1)  # [H_out]
                if not torch.isfinite(g).all():
                    raise AdapterError(
                        f"adapter {name!r}, {module_name(layer, module)}: its DoRA scale "
                        f"m / ||W + s*B@A|| is not finite (a zero row norm)"
                    )
            g_rows.append(g)
            if bias is not None:
                has_bias = True
                offset_rows.append((1 - g) * bias.to(torch.float32))
            else:
                offset_rows.append(torch.zeros(out_features))
        offset = torch.stack(offset_rows) if has_bias else None
        per_module[module] = (torch.stack(g_rows), offset)  # [L, H_out] each
    return DoraScales(per_module)


def _modules(pairs: Iterable[tuple[int, str]]) -> list[str]:
    return sorted({module for _, module in pairs})


def apply_dora(y: torch.Tensor, g: torch.Tensor, offset: torch.Tensor | None) -> None:
    """y = g * y + offset, in place: y [T, H_out] (a projection's rows of one adapter, delta
    included), g and offset [H_out] of one layer, in y's dtype."""
    y.mul_(g)
    if offset is not None:
        y.add_(offset)
