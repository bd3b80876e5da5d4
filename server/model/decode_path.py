"""A decode step's layers in four native calls each (`csrc/decode_layer.c`), LoRA between them.

At batch 1-4 a CPU decode step of SmolLM2 makes about ten native calls a layer (the norms, the
GEMVs, RoPE, the KV write, attention, silu), each costing some 6 us of Python around it (ctypes,
checks, a fresh tensor): ~2 ms of a 15 ms bfloat16 step (measured in process on the project's
2-core AMD EPYC, cProfile). `decode_layer.c` chains the same kernels in the same order on the
same buffers, so the numbers are bit for bit the per-op path's (tests/server/model/
test_decode_path.py), in four calls a layer:

    x, qkv   = norm_proj(h, residual)          then LoRA q, k, v on qkv (from x)
    attn, o  = attend_proj(qkv)                then LoRA o on o (from attn)
    x, gu    = norm_proj(h, o)                 then LoRA gate, up on gu (from x)
    act, res = act_proj(gu)                    then LoRA down on res (from act)

`DecodePath.build` returns None (the model keeps its per-op path) where any projection has no
native GEMV here, the family normalizes q and k per head (Qwen3), or the native library is off;
`act_proj` declines without AVX-512 (silu's kernel), and that part then runs per op.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from toppings.server import native
from toppings.server.config import Quantization
from toppings.server.model.fused import silu_mul
from toppings.server.model.linear import GEMV_MAX_ROWS, Linear, gemv_kernel
from toppings.server.model.quant import QuantizedLinear

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# decode_layer.c's GEMV_* kinds, by linear.py's kernel names
_KINDS = {"gemv_f32": 0, "gemv_bf16": 1, "gemv_f32_avx2": 2, "gemv_bf16_avx2": 3}
_INT8, _INT4 = 4, 5


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


def native_proj(proj: Linear | QuantizedLinear, dtype: torch.dtype) -> tuple[Proj, int] | None:
    """The C struct of a projection whose decode GEMV is native here, and the most rows it
    takes; None where its GEMV is not native (then the model keeps the per-op path)."""
    bias = proj.bias
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None
    bias_ptr = None if bias is None else bias.data_ptr()
    if isinstance(proj, Linear):
        plain, kernel = proj._plain, gemv_kernel(dtype)
        if plain is None or proj._gemv is None or kernel is None or plain.dtype != dtype:
            return None
        struct = Proj(_KINDS[kernel[0]], plain.data_ptr(), None, None, bias_ptr, *plain.shape)
        return struct, GEMV_MAX_ROWS
    if proj.gemv_rows == 0 or proj.dtype != dtype:
        return None
    out_features, in_features = proj.out_features, proj.in_features
    if proj.scheme is Quantization.INT8:
        scales = proj._gemv_scales.data_ptr()
        struct = Proj(_INT8, proj._q.data_ptr(), scales, None, bias_ptr, out_features, in_features)
        return struct, proj.gemv_rows
    packed, scales, offsets = proj._gemv_int4
    struct = Proj(_INT4, packed.data_ptr(), scales.data_ptr(), offsets.data_ptr(), bias_ptr,
                  out_features, in_features)  # fmt: skip
    return struct, proj.gemv_rows


@dataclass
class _LayerProjs:
    """A layer's projections: the addresses of their C structs (kept alive in `structs`)."""

    qkv: int
    o: int
    gate_up: int
    down: int
    structs: tuple[Proj, ...]


class DecodePath:
    """The native decode layers of one model: each layer's projections as C structs, built once
    (they point into the model's weights, which live as long as the model)."""

    def __init__(self, lib, layers: list[_LayerProjs], max_rows: int, dtype: torch.dtype):
        self._lib, self._layers, self.max_rows, self.dtype = lib, layers, max_rows, dtype
        self._is_bf16 = _DTYPES[dtype]

    @classmethod
    def build(cls, model) -> DecodePath | None:
        """The model's decode path, or None where it cannot run here (see the module doc)."""
        lib = native.library()
        dtype = model.dtype
        if lib is None or model.device.type != "cpu" or dtype not in _DTYPES:
            return None
        if model.config.has_qk_norm:
            return None
        layers, rows = [], GEMV_MAX_ROWS
        for layer in model.layers:
            made = [native_proj(p, dtype) for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(m is None for m in made):
                return None
            rows = min([rows] + [r for _, r in made])
            structs = tuple(struct for struct, _ in made)
            layers.append(_LayerProjs(*(ctypes.addressof(c) for c in structs), structs))
        return cls(lib, layers, rows, dtype) if rows > 0 else None

    def run(self, model, batch, kv, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Every layer of a decode step of T <= max_rows tokens on the residual stream h [T, H]
        (contiguous, added into in place); returns the last layer's output [T, H], which the
        caller adds into h. cos, sin [T, D]: the step's RoPE rows."""
        cfg, lib, lora = model.config, self._lib, batch.lora
        n, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        t, hidden, inter = h.shape[0], cfg.hidden_size, cfg.intermediate_size
        is_bf16, threads, eps = self._is_bf16, torch.get_num_threads(), cfg.rms_norm_eps
        dtype = h.dtype
        # Buffers of every layer: each is read before the next layer writes it again.
        x, qkv = torch.empty(t, hidden, dtype=dtype), torch.empty(t, (n + 2 * k) * d, dtype=dtype)
        attn, out = torch.empty(t, n * d, dtype=dtype), torch.empty(t, hidden, dtype=dtype)
        gate_up, act = torch.empty(t, 2 * inter, dtype=dtype), torch.empty(t, inter, dtype=dtype)
        residual = torch.empty(t, hidden, dtype=dtype)
        index, lengths = batch.kv_index.contiguous(), batch.kv_lengths.contiguous()
        slots, cos, sin = batch.slots.contiguous(), cos.contiguous(), sin.contiguous()
        hp, xp, qkvp, attnp, outp, gup, actp, resp = (
            b.data_ptr() for b in (h, x, qkv, attn, out, gate_up, act, residual)
        )
        rope_and_pool = (cos.data_ptr(), sin.data_ptr())
        rows = (slots.data_ptr(), index.data_ptr(), lengths.data_ptr(), index.shape[1])
        for idx, (layer, projs) in enumerate(zip(model.layers, self._layers, strict=True)):
            delta = None if idx == 0 else resp  # the previous layer's output, added into h
            _check(lib.norm_proj(hp, delta, layer.input_norm.data_ptr(), xp, projs.qkv, qkvp, t,
                                 hidden, hidden, eps, is_bf16, threads), "qkv")  # fmt: skip
            if lora is not None:
                q, key, val = qkv.split([n * d, k * d, k * d], dim=-1)
                lora.add(idx, x, (("q_proj", q), ("k_proj", key), ("v_proj", val)))
            kc, vc = kv.k[idx], kv.v[idx]  # [K, S, D]
            _check(lib.attend_proj(qkvp, *rope_and_pool, kc.data_ptr(), vc.data_ptr(), *rows,
                                   kc.shape[1], attnp, projs.o, outp, t, n, k, d, d**-0.5,
                                   is_bf16, threads), "attention")  # fmt: skip
            if lora is not None:
                lora.add(idx, attn, (("o_proj", out),))
            _check(lib.norm_proj(hp, outp, layer.post_norm.data_ptr(), xp, projs.gate_up, gup, t,
                                 hidden, hidden, eps, is_bf16, threads), "gate_up")  # fmt: skip
            if lora is not None:
                gate, up = gate_up.chunk(2, dim=-1)
                lora.add(idx, x, (("gate_proj", gate), ("up_proj", up)))
            activation = act
            if lib.act_proj(gup, actp, projs.down, resp, t, is_bf16, threads):
                activation = silu_mul(gate_up)  # no AVX-512 for silu here: per op
                residual.copy_(layer.down(activation))
            if lora is not None:
                lora.add(idx, activation, (("down_proj", residual),))
        return residual

    def fits(self, model, batch, kv) -> bool:
        """Whether this step can run here: a decode of at most max_rows tokens, in the model's
        dtype, over a contiguous pool of that dtype."""
        t = batch.input_ids.shape[0]
        return (
            not batch.is_prefill
            and 0 < t <= self.max_rows
            and batch.kv_index is not None
            and kv.k[0].dtype == self.dtype
            and kv.k[0].is_contiguous()
            and kv.v[0].is_contiguous()
        )


def _check(failed: int, what: str) -> None:
    if failed == 2:
        raise IndexError("a KV slot lies outside the pool")
    if failed == 3:
        raise MemoryError("decode attention could not allocate its score buffers")
    if failed:
        raise RuntimeError(f"the native decode path's {what} step failed ({failed})")
