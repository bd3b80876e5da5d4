"""The engine library's interface (server/native/csrc/native_api.h) against its Python side:
every function Python calls (server/native SIGNATURES), every ctypes struct of the decode step
(decode_structs.py) with the C compiler's layout, and the enums whose values Python writes
(NativeStatus, GemvKind, LoraSlot, GemvIsa). tests/gpu_lora/test_native_abi.py shows the checker
failing on broken copies."""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

import pytest

from toppings.gpu_lora.kernels import native as lora_native
from toppings.gpu_lora.kernels import native_abi, native_build
from toppings.gpu_lora.kernels.native_build import Status
from toppings.gpu_lora.targets import LORA_TARGETS
from toppings.server import native
from toppings.server.model import decode_structs, quant_gemv

HEADER = native.CSRC / "native_api.h"


@pytest.fixture(scope="module")
def header() -> native_abi.Header:
    return native_abi.read_header(HEADER, [native_build.INCLUDE_DIR])


@pytest.fixture(scope="module")
def layouts(header) -> dict[str, native_abi.Layout]:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    return native_abi.compile_check(header, [native_build.INCLUDE_DIR])


def test_signatures_agree_with_the_header(header):
    assert native_abi.function_mismatches(header, native.SIGNATURES) == []


def ctypes_structs() -> list[type[ctypes.Structure]]:
    """Every ctypes struct the Python side hands this library (named as its C struct)."""
    found = [lora_native.LoraProj]  # decode_proj.c builds these from LoraStep's tables
    for value in vars(decode_structs).values():
        if isinstance(value, type) and issubclass(value, ctypes.Structure):
            found.append(value)
    return found


def test_structs_agree_with_the_compilers_layout(header, layouts):
    structs = ctypes_structs()
    assert {s.__name__ for s in structs} >= {"Proj", "LoraTable", "LoraStep", "DecodeStep"}
    problems = [p for s in structs for p in native_abi.struct_mismatches(header, s, layouts)]
    assert problems == []


def test_enums_agree(header):
    # gpu_lora builds a step's host runs (HostTable) in LORA_TARGETS' order, read as the slots'
    assert tuple(decode_structs.LORA_SLOTS) == LORA_TARGETS
    slots = {f"LORA_{m.removesuffix('_proj').upper()}": i for m, i in
             decode_structs.LORA_SLOTS.items()}  # fmt: skip
    expected = {
        "NativeStatus": {f"NATIVE_{m.name}": m.value for m in Status},
        "GemvKind": {f"GEMV_{m.name}": m.value for m in decode_structs.GemvKind},
        "LoraSlot": slots | {"LORA_MODULES": len(slots)},
        "GemvIsa": {f"ISA_{k.upper()}": v for k, v in quant_gemv.GEMV_ISA.items()},
    }
    problems = [p for e, py in expected.items() for p in native_abi.enum_mismatches(header, e, py)]
    assert problems == []
    kinds = {kernel: decode_structs.GemvKind[kernel.removeprefix("gemv_").upper()]
             for kernel in decode_structs.GEMV_KINDS}  # fmt: skip
    assert kinds == decode_structs.GEMV_KINDS


def test_the_library_exports_only_what_the_header_declares(header):
    """Built with the project's flags (a definition that disagrees with its declaration fails
    the build, and so this test, where a compiler is found), it exports nothing undeclared."""
    if shutil.which("cc") is None or os.environ.get("TOPPINGS_NATIVE") == "0":
        pytest.skip("no native build here")
    lib = native.library()
    assert lib is not None, "the engine's kernels did not build: see the log for the compiler"
    exported = native_abi.exported_functions(Path(lib._name))
    if exported is None:
        pytest.skip("no nm")
    assert set(native.SIGNATURES) <= exported
    assert exported <= header.functions.keys()


def test_every_source_includes_the_header():
    """What holds each C definition to its declaration: every source of the library includes
    native_api.h (and every source on disk is built)."""
    sources = sorted(p.name for p in native.CSRC.glob("*.c"))
    assert sources == sorted(native.SOURCES)
    missing = [s for s in sources if '#include "native_api.h"' not in (native.CSRC / s).read_text()]
    assert missing == []
