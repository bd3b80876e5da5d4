"""The product's import graph, as installed (`toppings.<package>.<room>.<module>`), every import
counted (function-level and TYPE_CHECKING ones too): no cycle between modules, rooms that import
only downwards, and no folder of more than twenty modules of its own (a room may hold smaller
rooms: a nested folder counts its own modules and belongs to its parent's layer)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "cpu_lora", "gpu_lora", "scheduler", "scripts")
MAX_MODULES_PER_ROOM = 20

# Inside server/, each room may import only the rooms listed before it. `config` is the settings
# every room reads (server/config/, settings.py, lora_modes.py: they import no room); `top` is
# what assembles a server (cli.py, cli_args.py, runtime.py).
SERVER_LAYERS = (
    "config",
    "process",
    "requests",
    "chat_template",
    "http",
    "native",
    "kv_events",
    "memory",
    "model",
    "adapters",
    "sampling",
    "sched",
    "engine",
    "resolver",
    "api",
    "top",
)
CONFIG_MODULES = {f"toppings.server.{m}" for m in ("config", "settings", "lora_modes")}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found["toppings." + ".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The product modules `name` imports (`from pkg import mod` counts as pkg.mod)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            subs = {f"{base}.{alias.name}" for alias in node.names} & MODULES.keys()
            out |= subs or {base}
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _room(name: str) -> str:
    """`toppings.server.sched.queueing` -> `server.sched`; a package's own modules -> `.top`."""
    if name in CONFIG_MODULES:
        return "server.config"
    parts = name.split(".")[1:]
    if len(parts) >= 2 and (REPO / parts[0] / parts[1]).is_dir():
        return f"{parts[0]}.{parts[1]}"
    return f"{parts[0]}.top"


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(GRAPH[name]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


def test_server_rooms_import_only_downwards():
    order = {f"server.{layer}": i for i, layer in enumerate(SERVER_LAYERS)}
    for name, deps in GRAPH.items():
        here = _room(name)
        for dep in deps:
            there = _room(dep)
            if here in order and there in order and here != there:
                assert order[there] < order[here], f"{name} (in {here}) imports {dep} ({there})"


def test_no_folder_holds_more_than_twenty_modules():
    sizes = Counter(
        path.parent.relative_to(REPO).as_posix()
        for path in MODULES.values()
        if path.name != "__init__.py"
    )
    crowded = {folder: n for folder, n in sizes.items() if n > MAX_MODULES_PER_ROOM}
    assert not crowded, crowded
