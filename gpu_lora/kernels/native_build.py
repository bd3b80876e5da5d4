"""Build plain C kernels once with the C compiler, cache the library, load it with ctypes.

Every native library of the project goes through `load`: the LoRA kernel beside this module
(`csrc/lora.c`, `gpu_lora.kernels.native`) and the engine's own kernels (`server.native`). The
sources are plain C with OpenMP (no torch headers, so a build takes about a second), compiled
with `-march=native` into `~/.cache/toppings/native/` (or `$TOPPINGS_CACHE_DIR/native`) under a
key of the sources, the headers, the compiler, the flags and this CPU's flags, so a changed
source or another machine gets its own build. OpenMP resolves to the runtime torch already
loaded (same soname), so every library and torch share one thread pool.

`INCLUDE_DIR` (this module's `csrc/`) is on every build's include path: its `common.h` holds
what all kernels share (bfloat16 conversions with torch's rounding, AVX-512 loads and stores,
the thread count for an amount of work), its `lora_api.h` the LoRA library's interface and the
`NativeStatus` every native function returns (`Status` here). Each library's functions are
declared in its one interface header and compared with the Python side by tests (`native_abi`).

Where no compiler is found, the build fails, or `TOPPINGS_NATIVE=0`, `load` returns None (logged)
and callers use their torch path. `TOPPINGS_NATIVE_CFLAGS` adds compiler flags (part of the key):
`-mno-avx512f` builds what an AVX2-only CPU runs, so that its paths are tested on any machine.
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

INCLUDE_DIR = Path(__file__).with_name("csrc")
COMMON_HEADERS = ("common.h", "lora_api.h")  # in INCLUDE_DIR: part of every build's key
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
    # Every exported function is declared in its library's interface header (lora_api.h,
    # native_api.h), which tests compare with the Python side: one defined without a declaration,
    # or called undeclared, is an error.
    "-Werror=missing-prototypes",
    "-Werror=implicit-function-declaration",
)


class Status(enum.IntEnum):
    """What every native function returns: csrc/lora_api.h's `NativeStatus`, member for member
    (tests/gpu_lora/test_native_abi.py compares the two)."""

    OK = 0
    DECLINED = 1  # the shapes, the build or the CPU do not suit: nothing written, use torch's path
    OUT_OF_RANGE = 2  # an index (LoRA run, KV slot, token id, position) outside its table
    NO_MEMORY = 3  # a scratch buffer could not be allocated
    DECLINED_MID_STEP = 4  # decode_layers: a kernel declined after the step wrote h


def cache_dir() -> Path:
    """Where built libraries are kept: `$TOPPINGS_CACHE_DIR/native` or ~/.cache/toppings/native."""
    root = os.environ.get("TOPPINGS_CACHE_DIR") or Path.home() / ".cache" / "toppings"
    return Path(root) / "native"


def _flags_line(cpuinfo: Path) -> str | None:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return None


def _cpu_flags() -> str:
    """What the build key names the CPU by: its flags line, else the platform's processor."""
    return _flags_line(Path("/proc/cpuinfo")) or platform.processor()


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is missing, e.g. not Linux)."""
    line = _flags_line(cpuinfo)
    return set(line.split(":", 1)[1].split()) if line else set()


def load(
    name: str,
    csrc: Path,
    sources: Sequence[str],
    headers: Sequence[str],
    signatures: Mapping[str, list],
    fallback: str,
) -> ctypes.CDLL | None:
    """The library `name` built from csrc/sources, or None where it cannot be built here.

    headers: the files of csrc the sources include (with INCLUDE_DIR's common headers, part of
    the build key); signatures: function -> ctypes argtypes, every function returning int (a
    `Status`), as the library's interface header declares them (a test compares); fallback:
    what runs instead, for the log line. Callers cache the result (one build and one log line
    per process).
    """
    if os.environ.get("TOPPINGS_NATIVE", "1") == "0":
        log.info("native CPU kernels (%s) disabled by TOPPINGS_NATIVE=0", name)
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: %s", fallback)
        return None
    files = [csrc / f for f in (*sources, *headers)] + [INCLUDE_DIR / f for f in COMMON_HEADERS]
    flags = (*FLAGS, *os.environ.get("TOPPINGS_NATIVE_CFLAGS", "").split())
    parts = [f.read_bytes() for f in files] + [compiler.encode(), " ".join(flags).encode()]
    key = hashlib.sha256(b"\0".join([*parts, _cpu_flags().encode()])).hexdigest()[:16]
    path = cache_dir() / f"{name}-{key}.so"
    if not path.is_file():
        try:
            _build(compiler, flags, [csrc / s for s in sources], path)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            log.warning("building the native kernels %s failed (%s): %s", name, detail, fallback)
            return None
    lib = ctypes.CDLL(str(path))
    for function, argtypes in signatures.items():
        fn = getattr(lib, function)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


def _build(compiler: str, flags: Sequence[str], sources: list[Path], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent servers never load a half-written file.
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        subprocess.run(
            [compiler, *flags, f"-I{INCLUDE_DIR}", *map(str, sources), "-o", str(out), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(out, path)
    log.info("built %s", path)
