"""The load check of an adapter's LoRA product against the compute dtype's range."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from toppings.gpu_lora.peft.adapter import LoraAdapter
from toppings.gpu_lora.peft.config import AdapterError
from toppings.gpu_lora.validate import check_finite_delta

H = 64


def adapter(scale: float = 2.0, a_max: float = 0.1, b_max: float = 0.1, rank: int = 8):
    """Rank-`rank` LoRA on layer 0 q_proj and layer 1 v_proj; layer 1's A and B peak at
    a_max, b_max, the rest is small and random."""
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for layer, module in ((0, "q_proj"), (1, "v_proj")):
        a = torch.randn(rank, H, generator=gen) * 0.01
        b = torch.randn(H, rank, generator=gen) * 0.01
        if layer == 1:
            a[0, 0], b[0, 0] = a_max, b_max
        weights[(layer, module)] = (a, b)
    num_bytes = sum(4 * (a.numel() + b.numel()) for a, b in weights.values())
    return LoraAdapter("x", "/x", rank, scale * rank, scale, ("q_proj", "v_proj"), weights,
                       num_bytes, None)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_trained_adapter_passes(dtype):
    check_finite_delta(adapter(scale=2.0, a_max=1.0, b_max=1.0, rank=64), dtype)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"scale": 1e308 / 8}, ["scaling", "overflows float32"]),
        ({"scale": float("inf")}, ["scaling"]),
        ({"a_max": 3e38, "b_max": 3e38}, ["layers.1", "v_proj", "LoRA product overflows"]),
        ({"scale": 1e36, "a_max": 1e5}, ["layers.1", "v_proj", "LoRA product overflows"]),
        ({"a_max": float("nan")}, ["layers.1", "v_proj", "NaN or inf"]),
    ],
    ids=["alpha 1e308", "alpha inf", "weights 3e38", "product", "nan"],
)
def test_an_overflowing_adapter_is_refused_naming_the_module(kwargs, words):
    with pytest.raises(AdapterError) as info:
        check_finite_delta(adapter(**kwargs), torch.float32)
    for word in words:
        assert word in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"scale": 1e36, "a_max": 1e5}, {"a_max": 3e38, "b_max": 3e38}, {"a_max": float("nan")}],
)
def test_the_bounds_kept_by_the_read_decide_as_the_weights_do(kwargs):
    """An adapter whose read kept its weights' maxima (`weight_bounds`) is judged on them, with
    the same verdict and words as on a pass over its weights."""
    plain = adapter(**kwargs)
    bounds = {
        pair: (a.abs().max().item(), b.abs().max().item()) for pair, (a, b) in plain.weights.items()
    }
    kept = dataclasses.replace(plain, weight_bounds=bounds)
    verdicts = []
    for each in (plain, kept):
        try:
            check_finite_delta(each, torch.float16)
            verdicts.append(None)
        except AdapterError as exc:
            verdicts.append(str(exc))
    assert verdicts[0] == verdicts[1]
    # the bounds are what is read: a wrong one decides
    lying = dataclasses.replace(plain, weight_bounds={p: (1e30, 1e30) for p in bounds})
    with pytest.raises(AdapterError, match="overflows"):
        check_finite_delta(lying, torch.float16)


def test_a_weight_beyond_float16_is_refused_there_only():
    big = adapter(scale=1e-3, a_max=1e5, b_max=1e-3)
    check_finite_delta(big, torch.float32)
    with pytest.raises(AdapterError, match="overflows float16"):
        check_finite_delta(big, torch.float16)
