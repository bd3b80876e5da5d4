"""The C structs and enums of a native decode step (`server/native/csrc/native_api.h`), field for
field and member for member (tests/server/native/test_native_abi.py compares them with the header
and with the C compiler's layout), and `native_proj`, which makes a projection's: what
`decode_path.DecodePath` hands the native library each step.
"""

from __future__ import annotations

import ctypes
import enum

import torch

from toppings.server.config import Quantization
from toppings.server.model.linear import Linear
from toppings.server.model.quant import QuantizedLinear


class GemvKind(enum.IntEnum):
    """The GEMV that runs a projection (native_api.h's GemvKind: GEMV_F32 ...)."""

    F32 = 0
    BF16 = 1
    F32_AVX2 = 2
    BF16_AVX2 = 3
    INT8 = 4
    INT4 = 5
    INT4_BF16 = 6
    BF16_TILES = 7


# the GEMV copies' kinds (plain or tiled), by linear.py's kernel names
GEMV_KINDS = {
    "gemv_f32": GemvKind.F32, "gemv_bf16": GemvKind.BF16, "gemv_f32_avx2": GemvKind.F32_AVX2,
    "gemv_bf16_avx2": GemvKind.BF16_AVX2, "gemv_bf16_tiles": GemvKind.BF16_TILES,
}  # fmt: skip


class Proj(ctypes.Structure):
    """One projection of a decode step: native_api.h's `Proj`, field for field."""

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
    """One projection's adapter tables of a step (native_api.h's, field for field)."""

    _fields_ = [
        ("A0", ctypes.c_void_p),
        ("B0", ctypes.c_void_p),
        ("a_step", ctypes.c_int64),
        ("b_step", ctypes.c_int64),
        ("ranks", ctypes.c_void_p),
        ("pool_rows", ctypes.c_int64),
    ]


# native_api.h's LoraSlot (LORA_Q ...: the module's name without `_proj`), by module
LORA_SLOTS = {
    m: i for i, m in enumerate(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                "down_proj"))
}  # fmt: skip


class LoraHost(ctypes.Structure):
    """The step's runs served from the host (native_api.h's, field for field): the projections
    [layers, slots, per_slot] of gpu_lora's `HostTable`, and its runs."""

    _fields_ = [
        ("procs", ctypes.c_void_p),
        ("per_slot", ctypes.c_int64),
        ("starts", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("num_runs", ctypes.c_int64),
    ]


class LoraStep(ctypes.Structure):
    """The step's adapter runs and tables (native_api.h's, field for field)."""

    _fields_ = [
        ("run", ctypes.c_void_p),
        ("shrink", ctypes.c_void_p),
        ("expand", ctypes.c_void_p),
        ("starts", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("num_runs", ctypes.c_int64),
        ("tables", LoraTable * len(LORA_SLOTS)),
        ("host", LoraHost),  # procs None: no runs on the host
    ]


class DecodeLayer(ctypes.Structure):
    """One layer's weights and KV pool layer (native_api.h's, field for field)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "post_norm", "qkv", "o", "gate_up", "down", "kc", "vc"
    )]  # fmt: skip


class DecodeStep(ctypes.Structure):
    """A step's tokens, buffers and shapes (native_api.h's, field for field)."""

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
        copy, kernel = proj.gemv_weight, proj.native_gemv
        if copy is None or copy.dtype != dtype:
            return None
        struct = Proj(GEMV_KINDS[kernel.name], copy.data_ptr(), None, None, bias_ptr, *copy.shape)
        return struct, proj.gemv_rows
    if proj.gemv_rows == 0 or proj.dtype != dtype:
        return None
    shape = (proj.out_features, proj.in_features)
    if proj.scheme is Quantization.INT8:
        values, scales = (t.data_ptr() for t in proj.gemv_tensors())
        return Proj(GemvKind.INT8, values, scales, None, bias_ptr, *shape), proj.gemv_rows
    if dtype == torch.bfloat16:  # the bf16 int4 GEMV: packed values, scale-zero pairs
        packed, pairs = (t.data_ptr() for t in proj.gemv_tensors())
        return Proj(GemvKind.INT4_BF16, packed, pairs, None, bias_ptr, *shape), proj.gemv_rows
    packed, scales, offsets = (t.data_ptr() for t in proj.gemv_tensors())
    return Proj(GemvKind.INT4, packed, scales, offsets, bias_ptr, *shape), proj.gemv_rows
