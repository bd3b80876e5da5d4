"""A decode step's layers in one native call (`csrc/decode_layer.c`), its LoRA included.

At batch 1-4 a CPU decode step of SmolLM2 makes about ten native calls a layer (the norms, the
GEMVs, RoPE, the KV write, attention, silu), each paying Python around it (ctypes, checks, a fresh
tensor), and an adapter targeting all seven projections adds four LoRA calls a layer: a sizeable
share of a small model's step (measured with cProfile and bench/probe_step_glue.py:
docs/benchmarks.md, "Measurements behind the code"). `decode_layer.c` chains the same kernels in
the same order on the same buffers, so the numbers are bit for bit the per-op path's
(tests/server/model/test_decode_path.py). A layer:

    x, qkv   = norm_proj(h, residual)          then LoRA q, k, v on qkv (from x)
    attn, o  = attend_proj(qkv)                then LoRA o on o (from attn)
    x, gu    = norm_proj(h, o)                 then LoRA gate, up on gu (from x)
    act, res = act_proj(gu)                    then LoRA down on res (from act)

`decode_layers` runs every layer so, the LoRA kernel (`gpu_lora.kernels.native.lora_runs`)
called from C on the step's runs (`LoraBatch.native_runs`: the pool's rows, and the host copy
of an adapter still loading or served on the host, `LoraHost`); where each request computes one
token and lm_head's GEMV is native too, the same call also gathers the embedding and RoPE rows
and ends with the final norm, lm_head and the logits' widening to float32 and scan (finite rows,
argmax: `run_to_logits`): their Python around a step runs cold after the weights' stream
(bench/profile_cold_ops.py, bench/probe_step_glue.py; what it saves: docs/benchmarks.md). Where
the step's LoRA needs Python (DoRA, a trace, an adapter on the CPU workers) or there is no vector
silu (neither AVX-512 nor AVX2 + FMA), the layers run as four calls each from here instead,
LoRA between them, `act_proj` then per op where it declines.
`DecodePath.build` returns None (the model keeps its per-op path) where any projection has no
native GEMV here, the family normalizes q and k per head (Qwen3), or the native library is off.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from toppings.gpu_lora.kernels.native_build import Status
from toppings.server import native
from toppings.server.model.decode_structs import (
    LORA_SLOTS,
    DecodeLayer,
    DecodeStep,
    LoraHost,
    LoraStep,
    LoraTable,
    Proj,
    native_proj,
)
from toppings.server.model.fused import NATIVE_DTYPES, silu_mul
from toppings.server.model.linear import GEMV_MAX_ROWS

if TYPE_CHECKING:
    from toppings.gpu_lora.kernels.native import RunsLayout


class Scanned(NamedTuple):
    """Each row of a step's logits: whether it is finite, and its argmax (-1 where not
    finite), as `scan_logits` gives them."""

    finite: list[bool]
    argmax: list[int]


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
        intermediate_size: int, head: Proj | None = None,
    ):  # fmt: skip
        """head: lm_head's C struct where its GEMV is native here (`run_to_logits`), else None."""
        self._lib, self._layers, self.max_rows, self.dtype = lib, layers, max_rows, dtype
        self._head = head
        # whether run_to_logits runs a step whole (bench/pair_steps.py pairs steps without it)
        self.whole_step = head is not None
        # whether that call also widens and scans the logits (pair_steps pairs steps without)
        self.scan_in_step = True
        self._is_bf16 = NATIVE_DTYPES[dtype]
        # decode_layers runs here: its silu takes the model's intermediate size in this build
        self._one_call = bool(lib.silu_mul_takes(intermediate_size))
        self._pool_layers: tuple[tuple[int, int], ctypes.Array] | None = None  # (pool, layers)
        self._last_lora: tuple[int, LoraStep] | None = None  # _lora_step's last, by version
        self._scratch: dict[int, tuple[torch.Tensor, ...]] = {}  # _buffers', by token count
        self._ends: dict[int, tuple[torch.Tensor, ...]] = {}  # run_to_logits' buffers, by count

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
        head = native_proj(model.lm_head, dtype)
        takes_embed = model.embed.dtype == dtype and model.embed.is_contiguous()
        head = head[0] if head is not None and head[1] >= rows and takes_embed else None
        return cls(lib, layers, rows, dtype, model.config.intermediate_size, head)

    def run_to_logits(self, model, batch, kv) -> tuple[torch.Tensor, Scanned | None] | None:
        """A whole decode step of one token a request (fits, no logit_rows) in one native call:
        the embedding and RoPE rows, every layer, the final norm and lm_head, as `forward` would
        call them, then the logits widened to float32 and scanned as `scan_logits` scans them
        (server/sampling/logits_scan.py); returns the logits [B, V] float32, a fresh tensor, and
        each row's finiteness and argmax (None where `scan_in_step` is off: the caller scans).
        None, having done nothing, where lm_head's GEMV is not native here (or the embedding is
        not a contiguous table of the model's dtype), the layers do not run in one call or the
        step's LoRA needs Python."""
        cfg, lora, t = model.config, batch.lora, batch.input_ids.shape[0]
        if not self.whole_step or not self._one_call or len(batch.seg_starts) - 1 != t:
            return None
        lora_step = None if lora is None else self._lora_step(lora, model)
        if lora is not None and lora_step is None:
            return None
        h, residual, normed, cos, sin, *head = self._end_buffers(t, cfg)
        scan = self.scan_in_step
        out = torch.empty(t, self._head.out, dtype=torch.float32 if scan else self.dtype)
        logits = head[0] if scan and head else out  # lm_head's output
        finite, best = (ctypes.c_bool * t)(), (ctypes.c_int64 * t)()
        step, alive = self._step(cfg, batch, kv, h, cos, sin, residual)
        ids, positions = batch.input_ids.contiguous(), batch.positions.contiguous()
        step.embed, step.ids = model.embed.data_ptr(), ids.data_ptr()
        step.cos_table, step.sin_table = model.cos.data_ptr(), model.sin.data_ptr()
        step.positions, step.final_norm = positions.data_ptr(), model.norm.data_ptr()
        step.lm_head = ctypes.addressof(self._head)
        step.normed, step.logits = normed.data_ptr(), logits.data_ptr()
        step.embed_rows, step.table_rows = model.embed.shape[0], model.cos.shape[0]
        if scan:
            step.logits_f32, step.finite = out.data_ptr(), ctypes.addressof(finite)
            step.argmax = ctypes.addressof(best)
        _check(self._decode_layers(step, model, kv, lora_step), "step")
        if not scan:
            return out.float(), None
        return out, Scanned(list(finite), list(best))

    def run(self, model, batch, kv, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Every layer of a decode step of T <= max_rows tokens on the residual stream h [T, H]
        (contiguous, added into in place); returns the last layer's output [T, H], which the
        caller adds into h. cos, sin [T, D]: the step's RoPE rows."""
        cfg, lora, t = model.config, batch.lora, h.shape[0]
        # the output (residual) is the caller's, new each step
        residual = torch.empty(t, cfg.hidden_size, dtype=h.dtype)
        step, alive = self._step(cfg, batch, kv, h, cos, sin, residual)
        if self._one_call:
            lora_step = None if lora is None else self._lora_step(lora, model)
            if lora is None or lora_step is not None:
                # it declines only where silu_mul_takes says: not here
                _check(self._decode_layers(step, model, kv, lora_step), "step")
                return residual
        self._layer_by_layer(model, lora, kv, step, (*self._buffers(t, cfg), residual))
        return residual

    def _decode_layers(self, step: DecodeStep, model, kv, lora_step: LoraStep | None) -> int:
        """decode_layers on the step, this model's layers over kv's pool and the step's LoRA
        (None: no adapter); its return code (`_check`)."""
        return self._lib.decode_layers(
            ctypes.byref(step), self._layers_of(model, kv), len(self._layers),
            None if lora_step is None else ctypes.byref(lora_step), self._is_bf16,
            torch.get_num_threads(),
        )  # fmt: skip

    def _step(self, cfg, batch, kv, h, cos, sin, residual) -> tuple[DecodeStep, tuple]:
        """The step's C struct over h, cos, sin, residual and the layers' buffers (the ends
        left to the caller), and the tensors it points into: kept alive by the caller until the
        native call returns."""
        n, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # Buffers of every layer, each read before the next layer writes it again, kept for the
        # next step of t tokens.
        x, qkv, attn, out, gate_up, act = self._buffers(h.shape[0], cfg)
        index, lengths = batch.kv_index.contiguous(), batch.kv_lengths.contiguous()
        slots, cos, sin = batch.slots.contiguous(), cos.contiguous(), sin.contiguous()
        buffers = (h, x, qkv, attn, out, gate_up, act, residual, cos, sin, slots, index, lengths)
        step = DecodeStep(
            *(b.data_ptr() for b in buffers), index.shape[1], kv.k.shape[2], h.shape[0],
            cfg.hidden_size, n, k, d, cfg.intermediate_size, cfg.rms_norm_eps, d**-0.5,
        )  # fmt: skip
        return step, buffers

    def _end_buffers(self, t: int, cfg) -> tuple[torch.Tensor, ...]:
        """run_to_logits' h, residual, normed [t, H] and cos, sin [t, D] of the model's dtype,
        and where that is bf16 lm_head's output [t, V] before it is widened: made once per token
        count (nothing in them outlives the step)."""
        made = self._ends.get(t)
        if made is None:
            widths = (cfg.hidden_size,) * 3 + (cfg.head_dim,) * 2
            widths += (self._head.out,) if self._is_bf16 else ()
            made = self._ends[t] = tuple(torch.empty(t, w, dtype=self.dtype) for w in widths)
        return made

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

    def _lora_step(self, lora, model) -> LoraStep | None:
        """The step's LoRA for decode_layers, or None where it must run from Python (no native
        runs, or tables that are not this model's shapes). The struct of a LoRA batch that
        serves several steps (its `version`: the same one while the decode batch's rows and
        the adapter pool stay as they were, server/adapters/step.py) is made once."""
        version = lora.version
        if version is not None and self._last_lora is not None and self._last_lora[0] == version:
            return self._last_lora[1]  # the batch run again
        runs: RunsLayout | None = lora.native_runs()
        if runs is None or runs.dtype != self.dtype or runs.num_layers != len(self._layers):
            return None
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
            step.tables[LORA_SLOTS[module]] = LoraTable(
                m.a0, m.b0, m.a_step, m.b_step, m.ranks, m.rows
            )
        if (host := runs.host) is not None:  # runs served from the host, LORA_SLOTS' order
            if any(shapes.get(module) != shape for module, shape in host.shapes.items()):
                return None
            step.host = LoraHost(ctypes.addressof(host.procs), host.per_slot, host.starts,
                                 host.offsets, host.scales, host.num_runs)  # fmt: skip
        self._last_lora = (version, step) if version is not None else None
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
            and kv.k.dtype == self.dtype
            and kv.k.is_contiguous()  # every layer's too, without a view a step of each
            and kv.v.is_contiguous()
        )


def _check(failed: int, what: str) -> None:
    if failed == Status.OUT_OF_RANGE:
        raise IndexError("a KV slot, a LoRA run, a token id or a position lies outside its table")
    if failed == Status.NO_MEMORY:
        raise MemoryError(f"the native decode path's {what} step could not allocate its buffers")
    if failed:
        raise RuntimeError(f"the native decode path's {what} step failed ({failed})")
