"""Refuse an adapter whose LoRA delta cannot be finite in the dtype the model computes in.

A LoRA delta is `scale * (x @ A.T) @ B.T`; with weights or a `lora_alpha` large enough the
product overflows to inf (then NaN through the softmax) although every stored number is finite,
and every generation with the adapter fails. The check here is cheap (one max per tensor) and
lenient enough for any trained adapter in float16 (and no pass over the weights at all where the
read kept their maxima, `LoraAdapter.weight_bounds`): it bounds the delta of an input of unit
l1 norm,

    |delta_j| <= scale * sum_r |B_jr| |A_r . x| <= scale * R * max|A| * max|B|   (|x|_1 <= 1),

and refuses the adapter when that bound, or `scale`, or a weight, exceeds the dtype's largest
finite value. An adapter passing it can still overflow on large activations; the engine fails
such a request alone at run time (server/engine/model_runner.py).
"""

from __future__ import annotations

import math

import torch

from toppings.gpu_lora.peft.adapter import LoraAdapter, abs_max
from toppings.gpu_lora.peft.config import AdapterError, module_name


def check_finite_delta(adapter: LoraAdapter, dtype: torch.dtype) -> None:
    """Raise AdapterError naming the first module whose LoRA product is not finite at `dtype`.

    adapter.weights: (A [R, in_features], B [out_features, R]) per (layer, module), float32 or
    bfloat16.
    """
    limit = torch.finfo(dtype).max
    where = f"adapter {adapter.name!r}"
    if not math.isfinite(adapter.scale) or abs(adapter.scale) > limit:
        raise AdapterError(
            f"{where}: its scaling lora_alpha/r = {adapter.scale:g} overflows {_name(dtype)} "
            f"(largest finite value {limit:g})"
        )
    for (layer, module), (a, b) in adapter.weights.items():
        known = adapter.weight_bounds.get((layer, module))
        max_a, max_b = known if known is not None else (abs_max(a), abs_max(b))
        what = f"{where}, {module_name(layer, module)}"
        if not (math.isfinite(max_a) and math.isfinite(max_b)):
            raise AdapterError(f"{what}: lora_A or lora_B holds NaN or inf")
        if max(max_a, max_b) > limit:
            raise AdapterError(
                f"{what}: a weight of magnitude {max(max_a, max_b):g} overflows {_name(dtype)}"
            )
        bound = abs(adapter.scale) * adapter.rank * max_a * max_b  # float64: inf past 1e308
        if not bound <= limit:
            raise AdapterError(
                f"{what}: the LoRA product overflows {_name(dtype)}: scaling {adapter.scale:g} "
                f"x r {adapter.rank} x max|A| {max_a:g} x max|B| {max_b:g} = {bound:g}, above "
                f"the largest finite value {limit:g}"
            )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
