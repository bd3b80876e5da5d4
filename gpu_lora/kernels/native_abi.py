"""A native library's interface header read as data, and compared with its Python side.

ctypes trusts Python's copy of each signature, struct and enum of the interface headers
(`csrc/lora_api.h`, `server/native/csrc/native_api.h`; every .c file includes its library's, so
the compiler holds each definition to it): a swapped argument or a moved field would be a wrong
answer or a crash. `read_header` parses a header, `compile_check` has the C compiler confirm that
reading and report each struct's layout, and `*_mismatches` list every way the Python side
disagrees (tests assert the lists are empty). The parser is strict: it takes the declarations
below and refuses anything else by name, so that a header cannot grow one it misreads.

    #ifndef / #define GUARD / #endif, #include <stdint.h>, #include "other_api.h"
    typedef struct { TYPE [*]name[, [*]name]... [ARRAY]; ... } Name;
    typedef enum { NAME [= INT], ... } Name;
    typedef RET name_fn(PARAMS);           a function type
    RET name(PARAMS);                       a function
    name_fn name;                           a function of that type

Python passes every pointer as an address (`c_void_p`), whatever it points to; scalars must be
the ctypes type of the C type (`int64_t` -> `c_int64`, `int` -> `c_int`, `float` -> `c_float`).
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SCALARS = {
    "int": ctypes.c_int, "int8_t": ctypes.c_int8, "int16_t": ctypes.c_int16,
    "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "uint8_t": ctypes.c_uint8,
    "uint16_t": ctypes.c_uint16, "uint32_t": ctypes.c_uint32, "uint64_t": ctypes.c_uint64,
    "char": ctypes.c_char, "float": ctypes.c_float, "double": ctypes.c_double,
    "size_t": ctypes.c_size_t, "void": None,
}  # fmt: skip
_TOKEN = re.compile(r"\s*(?:([A-Za-z_]\w*)|(-?\d+)|([{}()\[\];,*=]))")


class HeaderError(ValueError):
    """A declaration the parser does not take (it names the file and the statement)."""


@dataclass(frozen=True)
class CType:
    """A declared type: base name (`int64_t`, `LoraProj`, `lora_runs_fn`), pointer depth, array
    length (struct fields only), and its spelling for the compiler (`const float *`)."""

    base: str
    pointers: int = 0
    length: int | None = None
    spelling: str = ""


@dataclass(frozen=True)
class Function:
    name: str
    returns: CType
    params: tuple[tuple[str, CType], ...]

    def spelling(self) -> str:
        """The function's type as C writes it, for the compiler's check."""
        params = ", ".join(t.spelling for _, t in self.params) or "void"
        return f"{self.returns.spelling} ({params})"


@dataclass
class Header:
    """What a header (and the interface headers it includes) declares."""

    path: Path
    functions: dict[str, Function] = field(default_factory=dict)
    function_types: dict[str, Function] = field(default_factory=dict)
    structs: dict[str, tuple[tuple[str, CType], ...]] = field(default_factory=dict)
    enums: dict[str, dict[str, int]] = field(default_factory=dict)

    def constants(self) -> dict[str, int]:
        return {k: v for members in self.enums.values() for k, v in members.items()}


def read_header(path: Path, include_dirs: Sequence[Path] = ()) -> Header:
    """Parse `path` (and the quoted headers it includes, found beside it or in include_dirs)."""
    header = Header(path)
    _read_into(header, Path(path), [Path(path).parent, *map(Path, include_dirs)])
    return header


def _read_into(header: Header, path: Path, dirs: list[Path]) -> None:
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", path.read_text(), flags=re.S)
    body = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped.startswith("#"):
            body.append(line)
            continue
        words = stripped[1:].split()
        if words[:1] == ["include"] and words[1:] == ["<stdint.h>"]:
            continue
        if words[:1] == ["include"] and len(words) == 2 and re.fullmatch(r'"\w+\.h"', words[1]):
            found = [d / words[1][1:-1] for d in dirs if (d / words[1][1:-1]).is_file()]
            if not found:
                raise HeaderError(f"{path}: {words[1]} not found in {dirs}")
            _read_into(header, found[0], dirs)
        elif not (words[:1] in (["ifndef"], ["define"]) and len(words) == 2 or words == ["endif"]):
            raise HeaderError(f"{path}: preprocessor line not taken: {stripped}")
    tokens = _tokenize(" ".join(body), path)
    while tokens:
        end = _statement_end(tokens)
        _declaration(header, tokens[:end], path)
        tokens = tokens[end + 1 :]


def _tokenize(text: str, path: Path) -> list[str]:
    tokens, at = [], 0
    while at < len(text.rstrip()):
        match = _TOKEN.match(text, at)
        if match is None:
            raise HeaderError(f"{path}: cannot read {text[at : at + 40]!r}")
        tokens.append(match.group(match.lastindex))
        at = match.end()
    return tokens


def _statement_end(tokens: list[str]) -> int:
    depth = 0
    for i, tok in enumerate(tokens):
        depth += {"{": 1, "}": -1}.get(tok, 0)
        if tok == ";" and depth == 0:
            return i
    raise HeaderError(f"unterminated declaration: {' '.join(tokens)}")


def _declaration(header: Header, toks: list[str], path: Path) -> None:
    where = f"{path.name}: {' '.join(toks)}"
    if toks[:2] == ["typedef", "struct"] and toks[2] == "{" and toks[-2] == "}":
        header.structs[_ident(toks[-1], where)] = _fields(header, toks[3:-2], where)
    elif toks[:2] == ["typedef", "enum"] and toks[2] == "{" and toks[-2] == "}":
        header.enums[_ident(toks[-1], where)] = _enumerators(header, toks[3:-2], where)
    elif toks[:1] == ["typedef"] and "(" in toks:
        fn = _function(header, toks[1:], where)
        header.function_types[fn.name] = fn
    elif len(toks) == 2 and toks[0] in header.function_types:
        proto = header.function_types[toks[0]]
        header.functions[toks[1]] = Function(_ident(toks[1], where), proto.returns, proto.params)
    elif "(" in toks:
        fn = _function(header, toks, where)
        header.functions[fn.name] = fn
    else:
        raise HeaderError(f"declaration not taken: {where}")


def _ident(tok: str, where: str) -> str:
    if not re.fullmatch(r"[A-Za-z_]\w*", tok):
        raise HeaderError(f"expected a name, got {tok!r}: {where}")
    return tok


def _base(header: Header, toks: list[str], where: str) -> tuple[str, str, list[str]]:
    """(base type, its spelling with qualifiers, the tokens after it)."""
    quals = []
    while toks and toks[0] == "const":
        quals.append(toks.pop(0))
    if not toks:
        raise HeaderError(f"missing type: {where}")
    base = toks.pop(0)
    known = SCALARS.keys() | header.structs.keys() | header.enums.keys()
    if base not in known | header.function_types.keys():
        raise HeaderError(f"unknown type {base!r}: {where}")
    return base, " ".join([*quals, base]), toks


def _declarator(toks: list[str], where: str) -> tuple[int, str, list[str]]:
    """(pointer depth, name, the tokens after the name)."""
    stars = 0
    while toks and toks[0] == "*":
        stars, toks = stars + 1, toks[1:]
    if toks[:1] == ["const"]:
        raise HeaderError(f"const pointers are not taken: {where}")
    return stars, _ident(toks[0] if toks else "", where), toks[1:]


def _fields(header: Header, toks: list[str], where: str) -> tuple[tuple[str, CType], ...]:
    out = []
    while toks:
        end = toks.index(";") if ";" in toks else len(toks)
        stmt, toks = toks[:end], toks[end + 1 :]
        base, spelled, rest = _base(header, stmt, where)
        for part in _split(rest, ","):
            stars, name, after = _declarator(part, where)
            length = None
            if after:
                if len(after) != 3 or after[0] != "[" or after[2] != "]":
                    raise HeaderError(f"field {name} not taken: {where}")
                length = _value(header, after[1], where)
            spelling = spelled + (" " + "*" * stars if stars else "")
            out.append((name, CType(base, stars, length, spelling)))
    return tuple(out)


def _split(toks: list[str], sep: str) -> list[list[str]]:
    parts, depth, current = [], 0, []
    for tok in toks:
        depth += {"(": 1, ")": -1, "[": 1, "]": -1}.get(tok, 0)
        if tok == sep and depth == 0:
            parts.append(current)
            current = []
        else:
            current.append(tok)
    return [*parts, current] if current or parts else []


def _value(header: Header, tok: str, where: str) -> int:
    if re.fullmatch(r"-?\d+", tok):
        return int(tok)
    constants = header.constants()
    if tok not in constants:
        raise HeaderError(f"unknown constant {tok!r}: {where}")
    return constants[tok]


def _enumerators(header: Header, toks: list[str], where: str) -> dict[str, int]:
    members, nxt = {}, 0
    for part in _split(toks, ","):
        if not part:
            continue
        name = _ident(part[0], where)
        if len(part) == 3 and part[1] == "=":
            nxt = _value(header, part[2], where)
        elif len(part) != 1:
            raise HeaderError(f"enumerator {name} not taken: {where}")
        members[name], nxt = nxt, nxt + 1
    return members


def _function(header: Header, toks: list[str], where: str) -> Function:
    base, spelled, rest = _base(header, list(toks), where)
    stars, name, rest = _declarator(rest, where)
    if rest[:1] != ["("] or rest[-1:] != [")"]:
        raise HeaderError(f"function {name} not taken: {where}")
    returns = CType(base, stars, None, spelled + (" " + "*" * stars if stars else ""))
    params = []
    inner = rest[1:-1]
    for part in [] if inner == ["void"] else _split(inner, ","):
        pbase, pspelled, prest = _base(header, part, where)
        pstars, pname, after = _declarator(prest, where)
        if after:
            raise HeaderError(f"parameter {pname} of {name} not taken: {where}")
        spelling = pspelled + (" " + "*" * pstars if pstars else "")
        params.append((pname, CType(pbase, pstars, None, spelling)))
    return Function(name, returns, tuple(params))


def ctype_for(t: CType, header: Header):
    """The ctypes type the Python side must use for a parameter or a field of type t."""
    if t.pointers or t.base in header.function_types:
        inner = ctypes.c_void_p
    elif t.base in header.enums:
        inner = ctypes.c_int
    elif t.base in header.structs:
        inner = t.base  # compared by name: the struct itself is checked on its own
    else:
        inner = SCALARS[t.base]
    return inner if t.length is None else (inner, t.length)


@dataclass(frozen=True)
class Layout:
    """A struct as the C compiler lays it out: its size and each field's offset."""

    size: int
    offsets: dict[str, int]


def compile_check(header: Header, include_dirs: Sequence[Path]) -> dict[str, Layout]:
    """Have the C compiler confirm this reading of the header (each function's type, each
    field's type, each enumerator's value, as static assertions) and report every struct's
    layout. Raises HeaderError with the compiler's message where it disagrees."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise HeaderError("no C compiler")
    lines = ["#include <stddef.h>", "#include <stdio.h>", f'#include "{header.path.name}"']
    same = '_Static_assert(__builtin_types_compatible_p({}, {}), "{}");'
    for fn in header.functions.values():
        lines.append(same.format(f"__typeof__({fn.name})", fn.spelling(), fn.name))
    for name, fields in header.structs.items():
        for fname, t in fields:
            spelled = t.spelling + (f"[{t.length}]" if t.length is not None else "")
            got = f"__typeof__((({name} *)0)->{fname})"
            lines.append(same.format(got, spelled, f"{name}.{fname}"))
    for members in header.enums.values():
        lines += [f'_Static_assert({k} == {v}, "{k}");' for k, v in members.items()]
    lines.append("int main(void) {")
    for name, fields in header.structs.items():
        lines.append(f'    printf("{name} %zu\\n", sizeof({name}));')
        lines += [f'    printf("{name}.{f} %zu\\n", offsetof({name}, {f}));' for f, _ in fields]
    lines.append("    return 0;\n}")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "probe.c", Path(tmp) / "probe"
        src.write_text("\n".join(lines) + "\n")
        dirs = [f"-I{d}" for d in (header.path.parent, *include_dirs)]
        built = subprocess.run([compiler, "-std=c11", *dirs, str(src), "-o", str(exe)],
                               capture_output=True, text=True, timeout=120)  # fmt: skip
        if built.returncode:
            raise HeaderError(f"the compiler reads {header.path.name} otherwise:\n{built.stderr}")
        out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    layouts: dict[str, Layout] = {}
    for line in out.splitlines():
        key, value = line.split()
        struct, _, fname = key.partition(".")
        if not fname:
            layouts[struct] = Layout(int(value), {})
        else:
            layouts[struct].offsets[fname] = int(value)
    return layouts


def function_mismatches(
    header: Header, signatures: Mapping[str, Sequence], restype=ctypes.c_int
) -> list[str]:
    """Each way the Python argtypes of `signatures` (all returning restype) differ from the
    header's declarations: a function missing, a count or an argument type, the return type."""
    problems = []
    for name, argtypes in signatures.items():
        fn = header.functions.get(name)
        if fn is None:
            problems.append(f"{name}: not declared in {header.path.name}")
            continue
        if ctype_for(fn.returns, header) is not restype:
            problems.append(f"{name}: returns {fn.returns.spelling}, Python expects {restype}")
        if len(argtypes) != len(fn.params):
            problems.append(f"{name}: {len(fn.params)} parameters in C, {len(argtypes)} in Python")
        for i, ((pname, t), py) in enumerate(zip(fn.params, argtypes)):
            want = ctype_for(t, header)
            if py is not want:
                problems.append(
                    f"{name}: argument {i} ({t.spelling} {pname}) is {_name(want)} in C, "
                    f"{_name(py)} in Python"
                )
    return problems


def struct_mismatches(
    header: Header, cls: type[ctypes.Structure], layouts: Mapping[str, Layout]
) -> list[str]:
    """Each way the ctypes struct `cls` differs from the header's struct of the same name:
    field names (a trailing `_` allowed for a Python keyword), order, types, offsets, size."""
    name = cls.__name__
    if name not in header.structs:
        return [f"{name}: no struct of that name in {header.path.name}"]
    c_fields, py_fields = header.structs[name], cls._fields_
    problems = []
    c_names = [f for f, _ in c_fields]
    py_names = [f[0].rstrip("_") for f in py_fields]
    if c_names != py_names:
        return [f"{name}: fields {c_names} in C, {py_names} in Python"]
    for (fname, t), (pyname, py) in zip(c_fields, py_fields):
        if not _same(py, ctype_for(t, header)):
            problems.append(f"{name}.{fname}: {t.spelling} in C, {_name(py)} in Python")
        offset, c_offset = getattr(cls, pyname).offset, layouts[name].offsets[fname]
        if offset != c_offset:
            problems.append(f"{name}.{fname}: offset {c_offset} in C, {offset} in Python")
    if ctypes.sizeof(cls) != layouts[name].size:
        problems.append(f"{name}: {layouts[name].size} bytes in C, {ctypes.sizeof(cls)} in Python")
    return problems


def enum_mismatches(header: Header, enum: str, python: Mapping[str, int]) -> list[str]:
    """Each way `python` (C enumerator name -> value) differs from the header's enum `enum`."""
    members = header.enums.get(enum)
    if members is None:
        return [f"{enum}: no enum of that name in {header.path.name}"]
    if dict(python) != members:
        return [f"{enum}: {members} in C, {dict(python)} in Python"]
    return []


def exported_functions(library: Path) -> set[str] | None:
    """The functions a built library exports (`nm -D`), or None where nm is not installed."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    out = subprocess.run([nm, "-D", "--defined-only", str(library)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return {line.split()[2] for line in out.splitlines() if line.split()[1:2] == ["T"]}


def _same(py, want) -> bool:
    """Whether the ctypes type py is `ctype_for`'s want (a struct by name, an array by both)."""
    if isinstance(want, tuple):
        length = getattr(py, "_length_", None)
        return length == want[1] and _same(getattr(py, "_type_", None), want[0])
    return getattr(py, "__name__", None) == want if isinstance(want, str) else py is want


def _name(t) -> str:
    return t if isinstance(t, str) else getattr(t, "__name__", repr(t))
