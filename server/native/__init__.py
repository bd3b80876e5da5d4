"""The engine's own CPU kernels (`csrc/*.c`): built once with the C compiler, cached.

torch has no op for decode attention over a token-level KV pool without first gathering every
request's keys and values into a dense copy; `attention.c` reads them in place, in decode and
in the prefill of short segments; `attention_tiles.c` attends longer prompt segments (a whole
prompt, or a chunk after a long past) in blocks, reading the past once per tile of queries.
`elementwise.c` holds RMSNorm with the residual add, in-place RoPE, silu * up (`fused.py`) and
the KV write (`kv_cache.py`), `linear.c` the bf16 and float32 GEMVs (AVX-512), `gemv_int8.c`
the int8 GEMV of `--quantization int8` and the AVX2 + FMA float32 / bf16 GEMVs for CPUs without
AVX-512, `gemv_int4_bf16.c` the int4 GEMV for bf16 activations (AVX512_BF16), each one call
where torch needs many small ops; `decode_layer.c` chains them (and the LoRA kernel) into one
call a step for decode steps of a few requests (`server/model/decode_path.py`); `logits.c`
checks a step's logits and finds its greedy tokens in one pass (`server/sampling/logits_scan.py`)
and takes the logprobs asked for in two (`server/sampling/logits.py`);
`dequant_int4.c` unpacks torch's int4 pack for a prompt's GEMM (`server/model/quant_dequant.py`).
Every function, struct and enum Python reaches is declared in `csrc/native_api.h`, which every
source includes; `SIGNATURES` below, the structs of `server/model/decode_structs.py` and the
enums' tables are compared with it by tests/server/native/test_engine_abi.py. What the sources
share (`common.h`) sits on the include path of every native build
(`gpu_lora.kernels.native_build`, which also builds, caches and loads this library, keyed by its
sources); the LoRA kernel is a library of its own (`gpu_lora.kernels.native`, declared in its
`lora_api.h`, which native_api.h includes). Waking the other
OpenMP thread costs tens of microseconds here, so small ops (a decode step's norms, RoPE, KV
write) run on one (`threads_for` in `common.h`).

Where no compiler is found, the build fails, or `TOPPINGS_NATIVE=0`, `library()` returns None
and callers use their torch path (the same results: tests/server/model/test_attention.py and
test_fused.py check one against the other).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from toppings.gpu_lora.kernels import native_build

CSRC = Path(__file__).with_name("csrc")
SOURCES = (
    "attention.c", "attention_tiles.c", "elementwise.c", "linear.c", "gemv_tiles.c", "gemv_int8.c",
    "gemv_int4_bf16.c", "decode_proj.c", "decode_layer.c", "logits.c", "dequant_int4.c",
)  # fmt: skip
# what the sources include besides common.h: part of the key
HEADERS = ("attention_bf16.h", "native_api.h")

_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_ATTENTION = [_P] * 6 + [_I] * 4 + [_I64] * 3 + [ctypes.c_float, _I]
SIGNATURES = {  # as native_api.h declares them; each returns an int, a native_build.Status
    "decode_attention_f32": _ATTENTION,
    "decode_attention_bf16": _ATTENTION,
    "attention_rows": [_P] * 7 + [_I] * 4 + [_I64] * 2 + [ctypes.c_float, _I, _I],
    "attention_tiles": [_P] * 6 + [_I] * 4 + [_I64] * 2 + [ctypes.c_float, _I, _I],
    "add_rms_norm": [_P] * 4 + [_I64] * 5 + [ctypes.c_float, _I, _I],
    "rope": [_P] * 3 + [_I64] * 4 + [_I, _I],
    "silu_mul": [_P, _I64, _P, _I64, _I64, _I, _I],
    "silu_mul_takes": [_I64],
    "kv_write": [_P, _P, _I64, _P, _P, _P] + [_I64] * 5 + [_I],
    "gemv_bf16": [_P, _I64, _P, _I64, _I64, _P, _I64, _I64, _I],
    "gemv_f32": [_P, _I64, _P, _I64, _I64, _P, _I64, _I64, _I],
    "gemv_bf16_tiles": [_P, _I64, _P, _I64, _I64, _P, _I64, _I64, _I],
    "pack_bf16_tiles": [_P, _I64, _I64, _P],
    "gemv_f32_avx2": [_P, _I64, _P, _I64, _I64, _P, _I64, _I64, _I],
    "gemv_bf16_avx2": [_P, _I64, _P, _I64, _I64, _P, _I64, _I64, _I],
    "gemv_int8": [_P, _I64, _I, _P, _P, _I64, _I64, _P, _I64, _I64, _I, _I],
    "gemv_int4": [_P, _I64, _I, _P, _P, _P, _I64, _I64, _P, _I64, _I64, _I, _I],
    "gemv_int4_bf16": [_P, _I64, _P, _P, _I64, _I64, _P, _I64, _I64, _I],
    "dequant_int4_pack": [_P, _P, _I, _I64, _I64, _I64, _I64, _P, _I, _I64, _I],
    # decode_layer.c: the Proj arguments are struct addresses (model/decode_path.py)
    "norm_proj": [_P] * 6 + [_I64] * 3 + [ctypes.c_float, _I, _I],
    "attend_proj": [_P] * 8 + [_I64] * 2 + [_P] * 3 + [_I64] * 4 + [ctypes.c_float, _I, _I],
    "act_proj": [_P] * 4 + [_I64, _I, _I],
    "decode_layers": [_P, _P, _I64, _P, _I, _I],
    "logits_scan": [_P, _I64, _I64, _I64, _P, _P, _I],
    "logits_logprobs": [_P, _I64, _I64, _I64, _P, _I, _P, _P, _P, _P, _I],
}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built here (logged once)."""
    return native_build.load(
        "cpu_kernels", CSRC, SOURCES, HEADERS, SIGNATURES,
        fallback="decode attention uses the slower torch path",
    )  # fmt: skip


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


@functools.cache
def keep_freed_memory() -> bool:
    """Let glibc reuse freed memory for large tensors instead of returning it to the OS.

    By default glibc serves every allocation over its mmap threshold (128 KiB to 32 MiB) with a
    fresh mmap, so each step's large activations fault in and zero their pages again (a large
    elementwise op ran about twice as fast with these settings: docs/benchmarks.md, "Measurements
    behind the code"). The cost is that the process keeps its peak heap. Process-wide; a no-op
    (False) where the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    except (OSError, AttributeError):
        return False
    return bool(ok)
