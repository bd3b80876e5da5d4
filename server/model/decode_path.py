"""A decode step's layers in one native call (`csrc/decode_layer.c`), its LoRA included.

At batch 1-4 a CPU decode step of SmolLM2 makes about ten native calls a layer (the norms, the
GEMVs, RoPE, the KV write, attention, silu), each costing some 6 us of Python around it (ctypes,
checks, a fresh tensor): ~2 ms of a 15 ms bfloat16 step (measured in process on the project's
2-core AMD EPYC, cProfile), and an adapter targeting all seven projections adds four LoRA calls
a layer at 20-26 us each. `decode_layer.c` chains the same kernels in the same order on the same
buffers, so the numbers are bit for bit the per-op path's (tests/server/model/
test_decode_path.py). A layer:

    x, qkv   = norm_proj(h, residual)          then LoRA q, k, v on qkv (from x)
    attn, o  = attend_proj(qkv)                then LoRA o on o (from attn)
    x, gu    = norm_proj(h, o)                 then LoRA gate, up on gu (from x)
    act, res = act_proj(gu)                    then LoRA down on res (from act)

`decode_layers` runs every layer so, the LoRA kernel (`gpu_lora.kernels.native.lora_runs`)
called from C on the step's runs (`LoraBatch.native_runs`). Where the step's LoRA needs Python
(an adapter still loading, DoRA, a trace) or there is no vector silu (neither AVX-512 nor AVX2 +
FMA), the layers run as four calls each from here instead, LoRA between them, `act_proj` then
per op where it declines.
`DecodePath.build` returns None (the model keeps its per-op path) where any projection has no
native GEMV here, the family normalizes q and k per head (Qwen3), or the native library is off.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from toppings.server import native
from toppings.server.config import Quantization
from toppings.server.model.fused import NATIVE_DTYPES, silu_mul
from toppings.server.model.linear import GEMV_MAX_ROWS, Linear, gemv_kernel
from toppings.server.model.quant import QuantizedLinear

if TYPE_CHECKING:
    from toppings.gpu_lora.kernels.native import RunsLayout

# decode_layer.c's GEMV_* kinds, by linear.py's kernel names
_KINDS = {"gemv_f32": 0, "gemv_bf16": 1, "gemv_f32_avx2": 2, "gemv_bf16_avx2": 3}
_INT8, _INT4, _INT4_BF16 = 4, 5, 6


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
_LORA_SLOTS = {
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
        ("tables", LoraTable * len(_LORA_SLOTS)),
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
        struct = Proj(_KINDS[kernel[0]], plain.data_ptr(), None, None, bias_ptr, *plain.shape)
        return struct, GEMV_MAX_ROWS
    if proj.gemv_rows == 0 or proj.dtype != dtype:
        return None
    shape = (proj.out_features, proj.in_features)
    if proj.scheme is Quantization.INT8:
        values, scales = (t.data_ptr() for t in proj.gemv_tensors())
        return Proj(_INT8, values, scales, None, bias_ptr, *shape), proj.gemv_rows
    if dtype == torch.bfloat16:  # the bf16 int4 GEMV: packed values, scale-zero pairs
        packed, pairs = (t.data_ptr() for t in proj.gemv_tensors())
        return Proj(_INT4_BF16, packed, pairs, None, bias_ptr, *shape), proj.gemv_rows
    packed, scales, offsets = (t.data_ptr() for t in proj.gemv_tensors())
    return Proj(_INT4, packed, scales, offsets, bias_ptr, *shape), proj.gemv_rows


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

    def __init__(
        self, lib, layers: list[_LayerProjs], max_rows: int, dtype: torch.dtype,
        intermediate_size: int,
    ):  # fmt: skip
        self._lib, self._layers, self.max_rows, self.dtype = lib, layers, max_rows, dtype
        self._is_bf16 = NATIVE_DTYPES[dtype]
        # decode_layers runs here: its silu takes the model's intermediate size in this build
        self._one_call = bool(lib.silu_mul_takes(intermediate_size))
        self._pool_layers: tuple[tuple[int, int], ctypes.Array] | None = None  # (pool, layers)
        self._last_lora: tuple[RunsLayout, LoraStep] | None = None  # _lora_step's last
        self._scratch: dict[int, tuple[torch.Tensor, ...]] = {}  # _buffers', by token count

    @classmethod
    def build(cls, model) -> DecodePath | None:
        """The model's decode path, or None where it cannot run here (see the module doc)."""
        lib = native.library()
        dtype = model.dtype
        if lib is None or model.device.type != "cpu" or dtype not in NATIVE_DTYPES:
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
        if rows == 0:
            return None
        return cls(lib, layers, rows, dtype, model.config.intermediate_size)

    def run(self, model, batch, kv, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Every layer of a decode step of T <= max_rows tokens on the residual stream h [T, H]
        (contiguous, added into in place); returns the last layer's output [T, H], which the
        caller adds into h. cos, sin [T, D]: the step's RoPE rows."""
        cfg, lora = model.config, batch.lora
        n, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        t, hidden, inter = h.shape[0], cfg.hidden_size, cfg.intermediate_size
        # Buffers of every layer, each read before the next layer writes it again, kept for the
        # next step of t tokens; the output (residual) is the caller's, new each step.
        x, qkv, attn, out, gate_up, act = self._buffers(t, cfg)
        residual = torch.empty(t, hidden, dtype=h.dtype)
        index, lengths = batch.kv_index.contiguous(), batch.kv_lengths.contiguous()
        slots, cos, sin = batch.slots.contiguous(), cos.contiguous(), sin.contiguous()
        buffers = (h, x, qkv, attn, out, gate_up, act, residual, cos, sin, slots, index, lengths)
        step = DecodeStep(
            *(b.data_ptr() for b in buffers), index.shape[1], kv.k.shape[2], t, hidden, n, k, d,
            inter, cfg.rms_norm_eps, d**-0.5,
        )  # fmt: skip
        if self._one_call:
            lora_step = None if lora is None else self._lora_step(lora.native_runs(), model)
            if lora is None or lora_step is not None:
                failed = self._lib.decode_layers(
                    ctypes.byref(step), self._layers_of(model, kv), len(self._layers),
                    None if lora_step is None else ctypes.byref(lora_step), self._is_bf16,
                    torch.get_num_threads(),
                )  # fmt: skip
                _check(failed, "step")  # it declines only where silu_mul_takes says: not here
                return residual
        self._layer_by_layer(model, lora, kv, step, (x, qkv, attn, out, gate_up, act, residual))
        return residual

    def _buffers(self, t: int, cfg) -> tuple[torch.Tensor, ...]:
        """x [t, H], qkv [t, (N + 2K) D], attn [t, N D], out [t, H], gate_up [t, 2I], act
        [t, I] of the model's dtype: made once per token count."""
        made = self._scratch.get(t)
        if made is None:
            n, k, d, hidden = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
            widths = (hidden, (n + 2 * k) * d, n * d, hidden, 2 * cfg.intermediate_size,
                      cfg.intermediate_size)  # fmt: skip
            made = self._scratch[t] = tuple(torch.empty(t, w, dtype=self.dtype) for w in widths)
        return made

    def _layers_of(self, model, kv) -> ctypes.Array:
        """The layers' C structs over this KV pool (built again when the pool is another)."""
        pool = (kv.k.data_ptr(), kv.v.data_ptr())
        if self._pool_layers is None or self._pool_layers[0] != pool:
            k_step = kv.k.stride(0) * kv.k.element_size()
            v_step = kv.v.stride(0) * kv.v.element_size()
            layers = (DecodeLayer * len(self._layers))(*(
                DecodeLayer(layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), projs.qkv,
                            projs.o, projs.gate_up, projs.down, pool[0] + idx * k_step,
                            pool[1] + idx * v_step)
                for idx, (layer, projs) in enumerate(zip(model.layers, self._layers))
            ))  # fmt: skip
            self._pool_layers = (pool, layers)
        return self._pool_layers[1]

    def _lora_step(self, runs: RunsLayout | None, model) -> LoraStep | None:
        """The step's LoRA for decode_layers, or None where it must run from Python (no native
        runs, or tables that are not this model's shapes)."""
        if runs is None or runs.dtype != self.dtype or runs.num_layers != len(self._layers):
            return None
        if self._last_lora is not None and self._last_lora[0] is runs:  # a batch run again
            return self._last_lora[1]
        cfg = model.config
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
                  "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
                  "down_proj": (inter, hidden)}  # fmt: skip
        step = LoraStep(
            runs.function, runs.shrink_part or None, runs.expand_part or None, runs.starts,
            runs.offsets, runs.scales, runs.num_runs,
        )  # fmt: skip
        for module, m in runs.modules.items():
            if shapes.get(module) != (m.h_in, m.h_out):
                return None
            step.tables[_LORA_SLOTS[module]] = LoraTable(
                m.a0, m.b0, m.a_step, m.b_step, m.ranks, m.rows
            )
        self._last_lora = (runs, step)  # runs kept: `is` above compares the live object
        return step

    def _layer_by_layer(self, model, lora, kv, step: DecodeStep, buffers: tuple) -> None:
        """decode_layers' work as four native calls a layer, the LoRA added between them by
        `lora.add` (see the module doc), on the step's buffers (x, qkv, attn, out, gate_up, act,
        residual: the tensors of step's pointers)."""
        x, qkv, attn, out, gate_up, act, residual = buffers
        lib, n, k, d, t, hidden = self._lib, step.N, step.K, step.D, step.T, step.H
        is_bf16, threads = self._is_bf16, torch.get_num_threads()
        hp, xp, qkvp, attnp, outp, gup, actp, resp = (
            step.h, step.x, step.qkv, step.attn, step.out, step.gate_up, step.act, step.residual
        )  # fmt: skip
        rope_and_pool = (step.cos, step.sin)
        rows = (step.slots, step.index, step.lengths, step.L)
        for idx, (layer, projs) in enumerate(zip(model.layers, self._layers, strict=True)):
            delta = None if idx == 0 else resp  # the previous layer's output, added into h
            _check(lib.norm_proj(hp, delta, layer.input_norm.data_ptr(), xp, projs.qkv, qkvp, t,
                                 hidden, hidden, step.eps, is_bf16, threads), "qkv")  # fmt: skip
            if lora is not None:
                q, key, val = qkv.split([n * d, k * d, k * d], dim=-1)
                lora.add(idx, x, (("q_proj", q), ("k_proj", key), ("v_proj", val)))
            kc, vc = kv.k[idx], kv.v[idx]  # [K, S, D]
            _check(lib.attend_proj(qkvp, *rope_and_pool, kc.data_ptr(), vc.data_ptr(), *rows,
                                   step.S, attnp, projs.o, outp, t, n, k, d, step.scale,
                                   is_bf16, threads), "attention")  # fmt: skip
            if lora is not None:
                lora.add(idx, attn, (("o_proj", out),))
            norm = layer.post_norm.data_ptr()
            _check(lib.norm_proj(hp, outp, norm, xp, projs.gate_up, gup, t, hidden, hidden,
                                 step.eps, is_bf16, threads), "gate_up")  # fmt: skip
            if lora is not None:
                gate, up = gate_up.chunk(2, dim=-1)
                lora.add(idx, x, (("gate_proj", gate), ("up_proj", up)))
            activation = act
            if lib.act_proj(gup, actp, projs.down, resp, t, is_bf16, threads):
                activation = silu_mul(gate_up)  # no vector silu here: per op
                residual.copy_(layer.down(activation))
            if lora is not None:
                lora.add(idx, activation, (("down_proj", residual),))

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
