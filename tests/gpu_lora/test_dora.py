"""DoRA's per-channel scale (gpu_lora/dora.py) against PEFT's own DoRA layer on one biased
projection: the base output plus the LoRA delta, scaled per row, equals PEFT's forward."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from toppings.gpu_lora.dora import apply_dora, dora_scales


class Block(torch.nn.Module):
    def __init__(self, h_in: int, h_out: int, bias: bool):
        super().__init__()
        self.q_proj = torch.nn.Linear(h_in, h_out, bias=bias)

    def forward(self, x):
        return self.q_proj(x)


class OneLinear:
    """`BaseProjections` of one layer holding one projection."""

    def __init__(self, linear: torch.nn.Linear):
        self.linear = linear

    def projection(self, layer: int, module: str):
        bias = self.linear.bias
        return self.linear.weight.detach(), None if bias is None else bias.detach()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rank", [1, 3])
def test_scaled_rows_equal_peft_dora_forward(bias: bool, rank: int):
    torch.manual_seed(rank)
    block = Block(24, 40, bias)
    config = LoraConfig(r=rank, lora_alpha=5, target_modules=["q_proj"], use_dora=True,
                        init_lora_weights=False)  # fmt: skip
    model = get_peft_model(block, config).eval()
    layer = model.base_model.model.q_proj
    with torch.no_grad():
        layer.lora_magnitude_vector["default"].weight.mul_(0.5 + torch.rand(40))
    a = layer.lora_A["default"].weight.detach()  # [R, in]
    b = layer.lora_B["default"].weight.detach()  # [out, R]
    m = layer.lora_magnitude_vector["default"].weight.detach()
    s = layer.scaling["default"]
    scales = dora_scales("x", s, {(0, "q_proj"): (a, b)}, {(0, "q_proj"): m},
                         OneLinear(layer.get_base_layer()), num_layers=1)  # fmt: skip
    g, offset = scales.modules["q_proj"]
    assert (offset is not None) == bias
    x = torch.randn(7, 24)
    with torch.no_grad():
        want = model(x)
        y = layer.get_base_layer()(x) + s * (x @ a.T) @ b.T  # base + delta, as the engine has it
    apply_dora(y, g[0], None if offset is None else offset[0])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(g, torch.ones_like(g))  # the scale is not the identity
