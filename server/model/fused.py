"""The elementwise ops of a Llama layer, one pass each where the native kernels are built.

Unfused, a layer's norms and RoPE are about fifteen torch ops; on a CPU each small one
costs more in dispatch and in waking torch's threads than in arithmetic (a decode step of
SmolLM2 at batch 64 spent a quarter of its time there). The native versions (`csrc/
elementwise.c`) do each in one pass, rounding where the torch ops round; the torch versions
below are the reference and the path everywhere else (tests/server/model/test_fused.py
compares them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toppings.server import native

NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the native kernels' is_bf16 flag, by dtype


def _lib(*tensors: torch.Tensor):
    """The native library when every tensor is a float32/bfloat16 CPU tensor of one dtype."""
    first = tensors[0]
    dtype = first.dtype
    if dtype not in NATIVE_DTYPES or first.device.type != "cpu":
        return None
    for t in tensors:
        if t.dtype != dtype:
            return None
    return native.library()


def _ptr(t: torch.Tensor) -> int:
    """A tensor's data address, as the kernels' pointer arguments take it (c_void_p)."""
    return t.data_ptr()


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """h += delta (in place, when given), then RMSNorm of h as transformers computes it.

    h, delta [T, H] (rows may be strided, columns contiguous); weight [H]. Returns [T, H].
    """
    lib = _lib(h, weight) if delta is None else _lib(h, delta, weight)
    strided = h.stride(-1) != 1 or (delta is not None and delta.stride(-1) != 1)
    if lib is None or strided or not weight.is_contiguous():
        if delta is not None:
            h += delta
        return rms_norm_torch(h, weight, eps)
    out = torch.empty(h.shape, dtype=h.dtype)
    lib.add_rms_norm(
        _ptr(h), None if delta is None else _ptr(delta), _ptr(weight), _ptr(out),
        h.shape[0], h.shape[1], h.stride(0), 0 if delta is None else delta.stride(0),
        out.stride(0), eps, NATIVE_DTYPES[h.dtype], torch.get_num_threads(),
    )  # fmt: skip
    return out


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 as transformers does, over the last dim.
    x [..., H] -> [..., H] in x's dtype; weight [H]."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # the same numbers in one torch op
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of each head, in place (Qwen3's q_norm / k_norm).

    x [T, heads, D] (rows may be strided: a view of the fused qkv projection); weight [D].
    Rounds as transformers' RMSNorm does (float32 inside, weight applied in x's dtype).
    """
    x.copy_(rms_norm_torch(x, weight, eps))
    return x


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in place. x [T, heads, D] (heads contiguous); cos, sin [T, D]."""
    lib = _lib(x, cos, sin)
    d = x.shape[-1]
    if (
        lib is None
        or x.stride(2) != 1
        or x.stride(1) != d
        or not (cos.is_contiguous() and sin.is_contiguous())
    ):
        x.copy_(rope_torch(x, cos, sin))
        return x
    lib.rope(_ptr(x), _ptr(cos), _ptr(sin), x.shape[0], x.shape[1], d, x.stride(0),
             NATIVE_DTYPES[x.dtype], torch.get_num_threads())  # fmt: skip
    return x


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [T, heads, D]; cos, sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up of the fused projection, one pass. gate_up [T, 2I] -> [T, I]."""
    lib = _lib(gate_up)
    if lib is not None and gate_up.stride(-1) == 1:
        num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(num_tokens, inter, dtype=gate_up.dtype)
        failed = lib.silu_mul(_ptr(gate_up), gate_up.stride(0), _ptr(out), num_tokens, inter,
                              NATIVE_DTYPES[gate_up.dtype], torch.get_num_threads())  # fmt: skip
        if not failed:
            return out
    return silu_mul_torch(gate_up)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """The same in two torch ops (the product in place)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
