"""Weight-only int8 / int4 base projections on a CPU (`--quantization`), through torch's packed
CPU kernels.

- int8: one symmetric scale per output channel, `W[o, i] ~ q[o, i] * scale[o]`, q in
  [-127, 127]; `torch.ops.aten._weight_int8pack_mm`.
- int4: groups of INT4_GROUP consecutive inputs per output channel, each with a scale and a
  zero, `W[o, i] ~ (q[o, i] - 8) * scale[o, g] + zero[o, g]` (g = i // INT4_GROUP, q in
  [0, 15]), the layout of `torch.ops.aten._weight_int4pack_mm_for_cpu` (gpt-fast's int4). From
  float weights: min/max of each group (asymmetric). GGUF's Q4_0 (`d * (q - 8)`) and Q4_1
  (`d * q + m`) blocks are groups of 32 of this form (zero 0, resp. m + 8 d), taken as they are.

Both kernels take the activation in float32, bfloat16 or float16 and the scales in that same
dtype (a bfloat16 model rounds its scales to bfloat16: `dequantize(dtype)` gives the weight the
kernel multiplies by). The product accumulates in float32 and returns the activation's dtype.
LoRA deltas are added to the output by the caller, as for a float projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toppings.server.config import Quantization

INT4_GROUP = 32  # divides every hidden and head size served, and is GGUF's block of 32
INT4_ROWS_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu packs output rows by 16
INT8_MAX = 127


class QuantizationError(ValueError):
    """A projection whose shape the chosen quantization cannot take (one line)."""


@dataclass
class Int8Weight:
    """q [out, in] int8, scales [out] float32: W ~ q * scales[:, None]."""

    q: torch.Tensor
    scales: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the kernel multiplies by in `dtype`'s model, as float32 [out, in]."""
        return self.q.float() * self.scales.to(dtype).float()[:, None]


@dataclass
class Int4Weight:
    """q [out, in] uint8 in [0, 15], scales and zeros [out, in / INT4_GROUP] float32:
    W ~ (q - 8) * scale + zero, per group of INT4_GROUP inputs."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the kernel multiplies by in `dtype`'s model, as float32 [out, in]."""
        out_features, in_features = self.q.shape
        groups = self.q.view(out_features, -1, INT4_GROUP).float() - 8  # [out, G, 32]
        scales, zeros = (t.to(dtype).float()[..., None] for t in (self.scales, self.zeros))
        return (groups * scales + zeros).view(out_features, in_features)


QuantizedWeight = Int8Weight | Int4Weight


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of a float weight [out, in] (computed in float32)."""
    w = weight.float()
    scales = w.abs().amax(dim=1) / INT8_MAX  # [out]
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row
    q = torch.round(w / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q, scales)


def quantize_int4(weight: torch.Tensor) -> Int4Weight:
    """Asymmetric int4 of a float weight [out, in] in groups of INT4_GROUP inputs: each group's
    minimum is q = 0 and its maximum q = 15 (computed in float32)."""
    out_features, in_features = weight.shape
    _check_int4_shape(out_features, in_features)
    groups = weight.float().view(out_features, -1, INT4_GROUP)  # [out, G, 32]
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [out, G]
    scales = (high - low) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group
    q = torch.round((groups - low[..., None]) / scales[..., None]).clamp_(0, 15)
    return Int4Weight(q.to(torch.uint8).view(out_features, in_features), scales, low + 8 * scales)


def quantize(weight: torch.Tensor | QuantizedWeight, scheme: Quantization) -> QuantizedWeight:
    """`weight` in `scheme`: a float tensor is quantized; a weight already in the scheme's form
    (a GGUF's Q4_0 / Q4_1 blocks as Int4Weight) is taken as it is; any other is dequantized and
    quantized again (a round trip through float32)."""
    if scheme is Quantization.INT8:
        if isinstance(weight, Int8Weight):
            return weight
        return quantize_int8(weight if isinstance(weight, torch.Tensor) else weight.dequantize())
    if scheme is Quantization.INT4:
        if isinstance(weight, Int4Weight):
            return weight
        return quantize_int4(weight if isinstance(weight, torch.Tensor) else weight.dequantize())
    raise ValueError(f"{scheme} is not a quantization of weights")


def concat(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights of one scheme stacked along their output channels (fused q/k/v, gate/up)."""
    first = weights[0]
    if isinstance(first, Int8Weight):
        return Int8Weight(torch.cat([w.q for w in weights]), torch.cat([w.scales for w in weights]))
    fields = ("q", "scales", "zeros")
    return Int4Weight(*(torch.cat([getattr(w, f) for w in weights]) for f in fields))


def _check_int4_shape(out_features: int, in_features: int) -> None:
    if in_features % INT4_GROUP or out_features % INT4_ROWS_MULTIPLE:
        raise QuantizationError(
            f"int4 needs a projection's inputs in groups of {INT4_GROUP} and its outputs in "
            f"multiples of {INT4_ROWS_MULTIPLE}; [{out_features}, {in_features}] is neither"
        )


class QuantizedLinear:
    """y = x @ W.T (+ b) for a weight-only int8 or int4 W [out, in]; x [T, in] float32,
    bfloat16 or float16 (the `dtype` given) -> y [T, out] in that dtype."""

    def __init__(
        self, weight: QuantizedWeight, dtype: torch.dtype, bias: torch.Tensor | None = None
    ):
        """weight: quantized on the CPU; its scales are kept in `dtype` (the kernels' rule);
        bias [out] in `dtype`, added to every row after the product."""
        self.out_features, self.in_features = weight.q.shape
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias {tuple(bias.shape)} does not fit a weight of {weight.q.shape}")
        self.bias = bias
        self.dtype = dtype
        self.group_size = 0
        if isinstance(weight, Int8Weight):
            self.scheme = Quantization.INT8
            self._q = weight.q.contiguous()  # [out, in] int8
            self._scales = weight.scales.to(dtype)  # [out]
        else:
            _check_int4_shape(self.out_features, self.in_features)
            self.scheme = Quantization.INT4
            self.group_size = INT4_GROUP
            # [out, in / 2] uint8, two 4-bit values a byte, in the kernel's own order
            self._q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                weight.q.to(torch.int32).contiguous(), 1
            )
            # [in / 32, out, 2]: each group's scale and zero, as the kernel reads them
            self._scales = torch.stack([weight.scales, weight.zeros], dim=-1).transpose(0, 1)
            self._scales = self._scales.to(dtype).contiguous()

    @property
    def weight_bytes(self) -> int:
        """Bytes a product reads: the quantized values and their scales (and zeros)."""
        return self._q.numel() * self._q.element_size() + (
            self._scales.numel() * self._scales.element_size()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if self.scheme is Quantization.INT8:
            y = torch.ops.aten._weight_int8pack_mm(x, self._q, self._scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self._q, self.group_size, self._scales
            )
        if self.bias is not None:
            y += self.bias
        return y
