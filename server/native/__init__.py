"""The engine's own CPU kernels (`csrc/*.c`): built once with the C compiler, cached.

torch has no op for decode attention over a token-level KV pool without first gathering every
request's keys and values into a dense copy; `attention.c` reads them in place, in decode and
in the prefill of short prompts. `elementwise.c` holds RMSNorm with the residual add, in-place
RoPE, silu * up (`fused.py`) and the KV write (`kv_cache.py`), `lora.c` MBGMV over adapter
runs (`native_lora.py`), each one call where torch needs many small ops; `common.h` what they
share. The library is plain C with OpenMP (no torch headers, so it builds in about a second),
compiled with `-march=native` into `~/.cache/toppings/native/` (or
`$TOPPINGS_CACHE_DIR/native`) under a key of the sources, the compiler and this CPU's flags,
and loaded with ctypes. OpenMP resolves to the runtime torch already loaded (same soname), so
both share one thread pool; waking the other thread costs tens of microseconds here, so small
ops (a decode step's norms, RoPE, KV write) run on one (`threads_for` in `common.h`).

Where no compiler is found, the build fails, or `TOPPINGS_NATIVE=0`, `library()` returns None
and callers use their torch path (the same results: tests/server/model/test_attention.py,
test_fused.py and test_native_lora.py check one against the other).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("attention.c", "elementwise.c", "linear.c", "lora.c")
HEADERS = ("common.h", "attention_bf16.h")  # what the sources include: part of the build key
FLAGS = (
    "-O3",
    "-ffp-contract=off",  # round each product as torch's unfused ops do
    "-march=native",
    "-fno-math-errno",
    "-mprefer-vector-width=512",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c11",
)


_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_ATTENTION = [_P] * 6 + [_I] * 4 + [_I64] * 3 + [ctypes.c_float, _I]
SIGNATURES = {  # every function returns int: 0, or nonzero when it failed
    "decode_attention_f32": _ATTENTION,
    "decode_attention_bf16": _ATTENTION,
    "attention_rows": [_P] * 7 + [_I] * 4 + [_I64] * 2 + [ctypes.c_float, _I, _I],
    "add_rms_norm": [_P] * 4 + [_I64] * 5 + [ctypes.c_float, _I, _I],
    "rope": [_P] * 3 + [_I64] * 4 + [_I, _I],
    "silu_mul": [_P, _I64, _P, _I64, _I64, _I, _I],
    "kv_write": [_P, _P, _I64, _P, _P, _P] + [_I64] * 5 + [_I],
    "gemv_bf16": [_P, _I64, _P, _I64, _I64, _P, _I64, _I64, _I],
    "lora_runs": [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _I64, _I, _I],
}


def cache_dir() -> Path:
    root = os.environ.get("TOPPINGS_CACHE_DIR") or Path.home() / ".cache" / "toppings"
    return Path(root) / "native"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built here (logged once)."""
    if os.environ.get("TOPPINGS_NATIVE", "1") == "0":
        log.info("native CPU kernels disabled by TOPPINGS_NATIVE=0")
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: decode attention uses the slower torch path")
        return None
    sources = [(CSRC / name).read_bytes() for name in (*SOURCES, *HEADERS)]
    key = hashlib.sha256(
        b"\0".join([*sources, compiler.encode(), " ".join(FLAGS).encode(), _cpu_flags().encode()])
    ).hexdigest()[:16]
    path = cache_dir() / f"cpu_kernels-{key}.so"
    if not path.is_file():
        try:
            _build(compiler, path)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            log.warning("building the native kernels failed (%s): using the torch path", detail)
            return None
    lib = ctypes.CDLL(str(path))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


def _build(compiler: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent servers never load a half-written file.
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        subprocess.run(
            [compiler, *FLAGS, *(str(CSRC / name) for name in SOURCES), "-o", str(out), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(out, path)
    log.info("built %s", path)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


@functools.cache
def keep_freed_memory() -> bool:
    """Let glibc reuse freed memory for large tensors instead of returning it to the OS.

    By default glibc serves every allocation over its mmap threshold (128 KiB to 32 MiB) with a
    fresh mmap, so each step's large activations fault in and zero their pages again: measured
    here, `F.silu(gate) * up` on [8192, 1536] float32 took 37 ms with the default and 17 ms with
    these settings, on the engine's own thread. The cost is that the process keeps its peak
    heap. Process-wide; a no-op (False) where the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    except (OSError, AttributeError):
        return False
    return bool(ok)
