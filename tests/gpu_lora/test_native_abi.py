"""The LoRA library's interface (csrc/lora_api.h) against its Python side (native.py's SIGNATURES
and LoraProj, native_build.Status), and the checker itself on deliberately broken copies: a
moved struct field or a changed argument type, on either side, must be reported."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from toppings.gpu_lora.kernels import native, native_abi, native_build
from toppings.gpu_lora.kernels.native_build import Status

HEADER = native_build.INCLUDE_DIR / "lora_api.h"
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(scope="module")
def header() -> native_abi.Header:
    return native_abi.read_header(HEADER)


@pytest.fixture(scope="module")
def layouts(header) -> dict[str, native_abi.Layout]:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    return native_abi.compile_check(header, [native_build.INCLUDE_DIR])


def status_members() -> dict[str, int]:
    return {f"NATIVE_{m.name}": m.value for m in Status}


def test_signatures_agree_with_the_header(header):
    assert native_abi.function_mismatches(header, native.SIGNATURES) == []


def test_structs_agree_with_the_compilers_layout(header, layouts):
    assert native_abi.struct_mismatches(header, native.LoraProj, layouts) == []


def test_status_enum_agrees(header):
    assert native_abi.enum_mismatches(header, "NativeStatus", status_members()) == []


@needs_cc
def test_the_library_exports_only_what_the_header_declares(header):
    if os.environ.get("TOPPINGS_NATIVE") == "0":
        pytest.skip("native kernels disabled")
    lib = native.library()
    assert lib is not None, "the LoRA kernels did not build: see the log for the compiler"
    exported = native_abi.exported_functions(Path(lib._name))
    if exported is None:
        pytest.skip("no nm")
    assert "lora_runs" in exported
    assert exported <= header.functions.keys()


def test_a_swapped_python_argument_is_reported(header):
    swapped = list(native.SIGNATURES["lora_runs"])
    swapped[0], swapped[1] = swapped[1], swapped[0]  # x (a pointer) and ld_x (int64_t)
    problems = native_abi.function_mismatches(header, {"lora_runs": swapped})
    assert len(problems) == 2 and all("argument" in p for p in problems), problems
    missing = native_abi.function_mismatches(header, {"lora_runs": swapped[:-1]})
    assert any("parameters" in p for p in missing), missing


def test_a_moved_python_field_is_reported(header, layouts):
    fields = list(native.LoraProj._fields_)
    fields.insert(5, fields.pop(3))  # ranks after ld_y

    class LoraProj(ctypes.Structure):
        _fields_ = fields

    problems = native_abi.struct_mismatches(header, LoraProj, layouts)
    assert problems and "fields" in problems[0], problems


def test_a_status_renumbered_in_python_is_reported(header):
    members = status_members() | {"NATIVE_NO_MEMORY": 5}
    assert native_abi.enum_mismatches(header, "NativeStatus", members) != []


@needs_cc
def test_a_header_changed_under_python_is_reported(tmp_path):
    """The C side moved: a struct field after another (same names, other offsets) and a
    parameter's type widened; the checker reads the copy and reports both."""
    text = HEADER.read_text()
    moved = text.replace(
        "    const int32_t *ranks; /* [num_runs] */\n    int64_t ld_y, H_out, pool_rows;",
        "    int64_t ld_y;\n    const int32_t *ranks;\n    int64_t H_out, pool_rows;",
    ).replace("int64_t num_runs,\n                         int is_bf16,", "int64_t num_runs,\n"
              "                         int64_t is_bf16,")  # fmt: skip
    assert moved.count("int64_t ld_y;") == 1 and "int64_t is_bf16," in moved
    (tmp_path / "lora_api.h").write_text(moved)
    broken = native_abi.read_header(tmp_path / "lora_api.h")
    layouts = native_abi.compile_check(broken, [])
    fields = native_abi.struct_mismatches(broken, native.LoraProj, layouts)
    assert fields and "fields" in fields[0], fields
    args = native_abi.function_mismatches(broken, native.SIGNATURES)
    assert len(args) == 1 and "lora_runs: argument 10 (int64_t is_bf16)" in args[0], args


def test_a_declaration_the_parser_does_not_take_is_refused(tmp_path):
    (tmp_path / "bad.h").write_text("struct Loose { int a; };\n")
    with pytest.raises(native_abi.HeaderError, match="not taken"):
        native_abi.read_header(tmp_path / "bad.h")
    (tmp_path / "macro.h").write_text("#define WIDTH 16\n")
    with pytest.raises(native_abi.HeaderError, match="preprocessor"):
        native_abi.read_header(tmp_path / "macro.h")


@needs_cc
def test_a_definition_that_disagrees_with_the_header_does_not_build(tmp_path):
    """The C side of the boundary: every .c file includes its header, so a definition whose
    types differ from the declaration, or an exported function declared nowhere, is a build
    error with the build's flags."""
    flags = [*native_build.FLAGS, f"-I{native_build.INCLUDE_DIR}", "-fsyntax-only"]
    flags.remove("-shared")
    cases = {
        "conflicting": '#include "lora_api.h"\nint lora_runs(const void *x, int ld_x, int64_t H_in,'
        " int64_t num_tokens, const LoraProj *proj, int64_t num_proj, const int32_t *starts,"
        " const int32_t *offsets, const float *scales, int64_t num_runs, int is_bf16,"
        " int num_threads) { return 0; }\n",
        "undeclared": '#include "lora_api.h"\nint lora_other(int n) { return n; }\n',
    }
    for name, source in cases.items():
        path = tmp_path / f"{name}.c"
        path.write_text(source)
        built = subprocess.run(["cc", *flags, str(path)], capture_output=True, text=True)
        assert built.returncode != 0, name
    fine = tmp_path / "fine.c"
    fine.write_text('#include "lora_api.h"\nstatic int helper(int n) { return n; }\n'
                    "int lora_runs(const void *x, int64_t ld_x, int64_t H_in, int64_t num_tokens,"
                    " const LoraProj *proj, int64_t num_proj, const int32_t *starts,"
                    " const int32_t *offsets, const float *scales, int64_t num_runs, int is_bf16,"
                    " int num_threads) { return helper(0); }\n")  # fmt: skip
    assert subprocess.run(["cc", *flags, str(fine)], capture_output=True).returncode == 0


def test_every_source_includes_the_header():
    sources = sorted(native_build.INCLUDE_DIR.glob("*.c"))
    assert sorted(p.name for p in sources) == sorted(native.SOURCES)
    assert all('#include "lora_api.h"' in p.read_text() for p in sources)
