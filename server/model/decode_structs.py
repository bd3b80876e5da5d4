"""The C structs of a native decode step (`csrc/decode_layer.c`, `csrc/decode_proj.h`), field
for field, and `native_proj`, which makes a projection's: what `decode_path.DecodePath` hands the
native library each step.
"""

from __future__ import annotations

import ctypes

import torch

from toppings.server.config import Quantization
from toppings.server.model.linear import GEMV_MAX_ROWS, Linear, gemv_kernel
from toppings.server.model.quant import QuantizedLinear

# decode_layer.c's GEMV_* kinds, by linear.py's kernel names
GEMV_KINDS = {"gemv_f32": 0, "gemv_bf16": 1, "gemv_f32_avx2": 2, "gemv_bf16_avx2": 3}
GEMV_INT8, GEMV_INT4, GEMV_INT4_BF16 = 4, 5, 6


class Proj(ctypes.Structure):
    """One projection of a decode_layer.c call: its C struct, field for field."""

    _fields_ = [
        ("kind", ctypes.c_int64),
        ("w", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("offset", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("out", ctypes.c_int64),
        ("in_", ctypes.c_int64),
    ]


class LoraTable(ctypes.Structure):
    """One projection's adapter tables of a step (decode_layer.c's struct, field for field)."""

    _fields_ = [
        ("a0", ctypes.c_void_p),
        ("b0", ctypes.c_void_p),
        ("a_step", ctypes.c_int64),
        ("b_step", ctypes.c_int64),
        ("ranks", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
    ]


# decode_layer.c's LORA_* slots, by module
LORA_SLOTS = {
    m: i for i, m in enumerate(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                "down_proj"))
}  # fmt: skip


class LoraStep(ctypes.Structure):
    """The step's adapter runs and tables (decode_layer.c's struct, field for field)."""

    _fields_ = [
        ("run", ctypes.c_void_p),
        ("shrink", ctypes.c_void_p),
        ("expand", ctypes.c_void_p),
        ("starts", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("num_runs", ctypes.c_int64),
        ("tables", LoraTable * len(LORA_SLOTS)),
    ]


class DecodeLayer(ctypes.Structure):
    """One layer's weights and KV pool layer (decode_layer.c's struct, field for field)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "post_norm", "qkv", "o", "gate_up", "down", "kc", "vc"
    )]  # fmt: skip


class DecodeStep(ctypes.Structure):
    """A step's tokens, buffers and shapes (decode_layer.c's struct, field for field)."""

    _fields_ = [
        *((name, ctypes.c_void_p) for name in (
            "h", "x", "qkv", "attn", "out", "gate_up", "act", "residual", "cos", "sin", "slots",
            "index", "lengths",
        )),
        *((name, ctypes.c_int64) for name in ("L", "S", "T", "H", "N", "K", "D", "I")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in (
            "embed", "cos_table", "sin_table", "final_norm", "ids", "positions", "lm_head",
            "normed", "logits",
        )),
        ("embed_rows", ctypes.c_int64),
        ("table_rows", ctypes.c_int64),
        *((name, ctypes.c_void_p) for name in ("logits_f32", "finite", "argmax")),
    ]  # fmt: skip


def native_proj(proj: Linear | QuantizedLinear, dtype: torch.dtype) -> tuple[Proj, int] | None:
    """The C struct of a projection whose decode GEMV is native here, and the most rows it
    takes; None where its GEMV is not native (then the model keeps the per-op path)."""
    bias = proj.bias
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None
    bias_ptr = None if bias is None else bias.data_ptr()
    if isinstance(proj, Linear):
        plain, kernel = proj.gemv_weight, gemv_kernel(dtype)
        if plain is None or kernel is None or plain.dtype != dtype:
            return None
        struct = Proj(GEMV_KINDS[kernel[0]], plain.data_ptr(), None, None, bias_ptr, *plain.shape)
        return struct, GEMV_MAX_ROWS
    if proj.gemv_rows == 0 or proj.dtype != dtype:
        return None
    shape = (proj.out_features, proj.in_features)
    if proj.scheme is Quantization.INT8:
        values, scales = (t.data_ptr() for t in proj.gemv_tensors())
        return Proj(GEMV_INT8, values, scales, None, bias_ptr, *shape), proj.gemv_rows
    if dtype == torch.bfloat16:  # the bf16 int4 GEMV: packed values, scale-zero pairs
        packed, pairs = (t.data_ptr() for t in proj.gemv_tensors())
        return Proj(GEMV_INT4_BF16, packed, pairs, None, bias_ptr, *shape), proj.gemv_rows
    packed, scales, offsets = (t.data_ptr() for t in proj.gemv_tensors())
    return Proj(GEMV_INT4, packed, scales, offsets, bias_ptr, *shape), proj.gemv_rows
