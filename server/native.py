"""The engine's own CPU kernels (`csrc/cpu_kernels.c`): built once with the C compiler, cached.

torch has no op for decode attention over a token-level KV pool without first gathering every
request's keys and values into a dense copy; `cpu_kernels.c` reads them in place. The library is
plain C with OpenMP (no torch headers, so it builds in about a second), compiled with
`-march=native` into `~/.cache/toppings/native/` (or `$TOPPINGS_CACHE_DIR/native`) under a key
of the source, the compiler and this CPU's flags, and loaded with ctypes. OpenMP resolves to the
runtime torch already loaded (same soname), so both share one thread pool.

Where no compiler is found, the build fails, or `TOPPINGS_NATIVE=0`, `library()` returns None
and callers use their torch path (the same results; `tests/server/test_attention.py` checks
one against the other).
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

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-mprefer-vector-width=512",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c11",
)


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
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, compiler.encode(), " ".join(FLAGS).encode(), _cpu_flags().encode()])
    ).hexdigest()[:16]
    path = cache_dir() / f"cpu_kernels-{key}.so"
    if not path.is_file():
        try:
            _build(compiler, path)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            log.warning("building %s failed (%s): using the torch path", SOURCE.name, detail)
            return None
    lib = ctypes.CDLL(str(path))
    for name in ("decode_attention_f32", "decode_attention_bf16"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = (
            [ctypes.c_void_p] * 6
            + [ctypes.c_int] * 4
            + [ctypes.c_int64] * 2
            + [
                ctypes.c_float,
                ctypes.c_int,
            ]
        )
    return lib


def _build(compiler: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent servers never load a half-written file.
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(out), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(out, path)
    log.info("built %s", path)
