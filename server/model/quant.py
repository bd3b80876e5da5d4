"""Weight-only int8 / int4 base projections on a CPU (`--quantization`), through the engine's
own GEMVs at 1-4 rows (csrc/gemv_int8.c) and torch's packed CPU kernels or a dequantized product
at more.

- int8: one symmetric scale per output channel, `W[o, i] ~ q[o, i] * scale[o]`, q in
  [-127, 127]; `torch.ops.aten._weight_int8pack_mm`.
- int4: groups of INT4_GROUP consecutive inputs per output channel, each with a scale and a
  zero, `W[o, i] ~ (q[o, i] - 8) * scale[o, g] + zero[o, g]` (g = i // INT4_GROUP, q in
  [0, 15]), the layout of `torch.ops.aten._weight_int4pack_mm_for_cpu` (gpt-fast's int4). From
  float weights: min/max of each group (asymmetric). GGUF's Q4_0 (`d * (q - 8)`) and Q4_1
  (`d * q + m`) blocks are groups of 32 of this form (zero 0, resp. m + 8 d), taken as they are.

torch's kernels take the activation in float32, bfloat16 or float16 and the scales in that same
dtype (a bfloat16 model rounds its scales to bfloat16: `dequantize(dtype)` gives the weight the
kernel multiplies by). The product accumulates in float32 and returns the activation's dtype.
The kernels suit a decode step's few rows only (`kernel_max_rows`): a prefill's rows multiply
by the weight dequantized a slice at a time, in the activation's dtype (torch's float GEMM, the
one a float model's prefill runs). LoRA deltas are added to the output by the caller, as for a
float projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from toppings.server.config import Quantization
from toppings.server.model.huge_pages import place
from toppings.server.model.linear import plain_copy_affordable
from toppings.server.model.quant_dequant import INT4_BLOCK_ROWS, dequantize_int4_pack
from toppings.server.model.quant_gemv import (
    GEMV_ROWS,
    INT4_GROUP,  # divides every hidden and head size served, and is GGUF's block of 32
    Int4Weight,
    int4_bf16_gemv,
    int4_bf16_gemv_layout,
    int4_bf16_gemv_works,
    int4_gemv,
    int4_gemv_layout,
    int4_gemv_works,
    int8_gemv,
    int8_gemv_works,
)

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
    if in_features % INT4_GROUP:
        raise QuantizationError(
            f"int4 needs a projection's inputs in groups of {INT4_GROUP}; "
            f"[{out_features}, {in_features}] has {in_features}"
        )


def kernel_max_rows(dtype: torch.dtype, scheme: Quantization) -> int:
    """The most rows a product runs through torch's packed kernel; more rows multiply by the
    weight dequantized to `dtype` (DEQUANT_ROWS channels at a time) through torch's GEMM.

    The kernels multiply row after row, each row streaming the whole weight, and only their
    bfloat16 path is vectorized: past a few dozen rows the dequantized weight and the float GEMM
    win (the crossovers measured on SmolLM2's projections: docs/benchmarks.md, "Quantized
    prefill").
    """
    if dtype == torch.bfloat16:
        return 32
    return 1 if scheme is Quantization.INT4 else 0


def gemv_rows(dtype: torch.dtype, scheme: Quantization, out_features: int, in_features: int) -> int:
    """The most rows a product of this weight runs through a native GEMV (quant_gemv.py):
    GEMV_ROWS where the scheme's GEMV for `dtype` runs here and takes the shape (16 | out; 16 | in
    for int8, 32 | in for int4); else 0. int8: float32 or bfloat16 activations; int4: float32
    (`int4_gemv`), bfloat16 where the CPU has AVX512_BF16 (`int4_bf16_gemv`; without it torch's
    bfloat16 int4 kernel ran one stream faster than `int4_gemv`). int4 keeps its GEMV copy beside
    torch's packed one (which the prefill unpacks): only where `plain_copy_affordable` allows it.
    The GEMVs against torch's paths, one stream (bench_single_stream, alternating rounds):
    docs/benchmarks.md, "Measurements behind the code".
    """
    if out_features % 16 or dtype not in (torch.float32, torch.bfloat16):
        return 0
    if scheme is Quantization.INT8:
        return GEMV_ROWS if in_features % 16 == 0 and int8_gemv_works(dtype) else 0
    if in_features % INT4_GROUP:
        return 0
    scale_bytes = 4 if dtype == torch.bfloat16 else 8  # per group: bf16 or float32 pairs
    copy_bytes = out_features * (in_features // 2 + scale_bytes * (in_features // INT4_GROUP))
    works = int4_bf16_gemv_works() if dtype == torch.bfloat16 else int4_gemv_works(dtype)
    return GEMV_ROWS if works and plain_copy_affordable(copy_bytes) else 0


DEQUANT_ROWS = 4096  # output channels dequantized at a time past kernel_max_rows: bounded memory


class QuantizedLinear:
    """y = x @ W.T (+ b) for a weight-only int8 or int4 W [out, in]; x [T, in] float32,
    bfloat16 or float16 (the `dtype` given) -> y [T, out] in that dtype.

    Up to `gemv_rows` rows (decode of 1-4 requests, float32 or bfloat16) go through the native
    int8 / int4 GEMV (quant_gemv.py); else up to `kernel_max_rows(dtype, scheme)` rows
    (bfloat16 decode) go through torch's packed kernel, which reads the quantized weight only;
    more rows (prefill, and float32 models) multiply by the weight dequantized to `dtype`,
    DEQUANT_ROWS output channels at a time, through torch's GEMM for `dtype`. All multiply by
    the same values (the scales as kept in `dtype`; a bfloat16 prefill by their products with
    q rounded to bfloat16, as a bfloat16 model of the dequantized weights holds them) and
    accumulate in float32.
    """

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
        scheme = Quantization.INT8 if isinstance(weight, Int8Weight) else Quantization.INT4
        self.max_kernel_rows = kernel_max_rows(dtype, scheme)
        if isinstance(weight, Int8Weight):
            self.scheme = Quantization.INT8
            self._q = place(weight.q.contiguous())  # [out, in] int8, in 2 MiB pages
            self._scales = weight.scales.to(dtype)  # [out]
            # the native GEMV's rows, and its scales: those in `dtype`, as float32
            self.gemv_rows = gemv_rows(dtype, self.scheme, self.out_features, self.in_features)
            self._gemv_scales = self._scales.float().contiguous()
            return
        _check_int4_shape(self.out_features, self.in_features)
        self.scheme = Quantization.INT4
        self.gemv_rows = gemv_rows(dtype, self.scheme, self.out_features, self.in_features)
        self._gemv_int4: tuple[torch.Tensor, ...] | None = None
        if self.gemv_rows and dtype == torch.bfloat16:
            self._gemv_int4 = tuple(map(place, int4_bf16_gemv_layout(weight)))
        elif self.gemv_rows:
            self._gemv_int4 = tuple(map(place, int4_gemv_layout(weight, dtype)))
        # Output rows padded to the pack's block of 64 (padding: q 8, scale 1, zero 0, i.e. 0),
        # so that the packed bytes have one known layout the prefill path unpacks.
        padded = -(-self.out_features // INT4_BLOCK_ROWS) * INT4_BLOCK_ROWS
        pad = padded - self.out_features
        q = F.pad(weight.q.to(torch.int32), (0, 0, 0, pad), value=8)
        scales = F.pad(weight.scales, (0, 0, 0, pad), value=1.0)
        zeros = F.pad(weight.zeros, (0, 0, 0, pad), value=0.0)
        # [padded, in / 2] uint8, two 4-bit values a byte, in the kernel's own order
        self._q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        # [in / 32, padded, 2]: each group's scale and zero, as the kernel reads them
        self._scales = torch.stack([scales, zeros], dim=-1).transpose(0, 1).to(dtype).contiguous()

    def gemv_tensors(self) -> tuple[torch.Tensor, ...]:
        """What the native GEMV reads (`gemv_rows` > 0): int8 (values [out, in], float32
        scales [out]); int4 `int4_gemv_layout`'s (packed values, scales, offsets), or with
        bfloat16 activations `int4_bf16_gemv_layout`'s (packed values, scale-zero pairs)."""
        if self.scheme is Quantization.INT8:
            return self._q, self._gemv_scales
        return self._gemv_int4

    @property
    def weight_bytes(self) -> int:
        """Bytes a decode step's product reads: the quantized values and their scales (and
        zeros)."""
        return self._q.numel() * self._q.element_size() + (
            self._scales.numel() * self._scales.element_size()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = None
        if x.shape[0] <= self.gemv_rows:
            if self.scheme is Quantization.INT8:
                y = int8_gemv(x, self._q, self._gemv_scales)
            elif self.dtype == torch.bfloat16:
                y = int4_bf16_gemv(x, *self._gemv_int4)
            else:
                y = int4_gemv(x, *self._gemv_int4)
        if y is not None:
            pass
        elif x.shape[0] > self.max_kernel_rows:
            y = self._dequantized_product(x)
        elif self.scheme is Quantization.INT8:
            y = torch.ops.aten._weight_int8pack_mm(x, self._q, self._scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self._q, INT4_GROUP, self._scales)
            if y.shape[1] != self.out_features:
                y = y[:, : self.out_features].contiguous()
        if self.bias is not None:
            y += self.bias
        return y

    def _dequantized_product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T with W dequantized to x's dtype a slice of output channels at a time."""
        if self.out_features <= DEQUANT_ROWS:
            return self._product_rows(x, 0, self.out_features)
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        for start in range(0, self.out_features, DEQUANT_ROWS):
            stop = min(start + DEQUANT_ROWS, self.out_features)
            y[:, start:stop] = self._product_rows(x, start, stop)
        return y

    def _product_rows(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """x @ W[start:stop].T in x's dtype: int4 through the native dequantizer where it runs
        (W.T in the pack's order, quant_dequant.py), else through `dequantize_rows`."""
        if self.scheme is Quantization.INT4:
            wt = dequantize_int4_pack(self._q, self._scales, self.in_features, start, stop, x.dtype)
            if wt is not None:
                return x @ wt
        return F.linear(x, self.dequantize_rows(start, stop).to(x.dtype))

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of W, [stop - start, in]: int8 in the model's dtype (q * scale, each
        product rounded once to it: what a float model holding the dequantized weight multiplies
        by), int4 in float32 as the kernel multiplies by it; start a multiple of DEQUANT_ROWS
        (of 64)."""
        if self.scheme is Quantization.INT8:
            q, scales = self._q[start:stop], self._scales[start:stop, None]
            if self.dtype == torch.float32:
                return q.float().mul_(scales)
            return torch.mul(q, scales)  # one pass (torch's fastest form for 16-bit dtypes)
        blocks = self._q.view(-1, self.in_features, INT4_BLOCK_ROWS // 2)  # [out/64, in, 32]
        first, last = start // INT4_BLOCK_ROWS, -(-stop // INT4_BLOCK_ROWS)
        packed = blocks[first:last]
        q = torch.cat([packed & 0x0F, packed >> 4], dim=-1)  # [n, in, 64]: rows 0-31, 32-63
        rows = q.transpose(1, 2).reshape(-1, self.in_features)  # [n * 64, in]
        rows = rows[: stop - start].float().view(stop - start, -1, INT4_GROUP).sub_(8)
        scales = self._scales[:, start:stop].float()  # [in / 32, rows, 2]
        rows.mul_(scales[..., 0].T[..., None]).add_(scales[..., 1].T[..., None])
        return rows.view(stop - start, self.in_features)
