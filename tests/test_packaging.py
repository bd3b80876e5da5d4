"""The installed import names live under `toppings.`: unrelated top-level packages named
`server`, `scheduler` or `scripts` neither shadow ours nor are shadowed by them."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STAND_INS = ("server", "scheduler", "scripts", "cpu_lora", "gpu_lora")
COMMANDS = ("toppings-serve", "toppings-scheduler", "toppings-loadgen", "toppings-demo",
            "toppings-launch")  # fmt: skip

IMPORT_ALL = """
import importlib, pkgutil, sys
names = []
for package in ("server", "cpu_lora", "gpu_lora", "scheduler", "scripts"):
    top = importlib.import_module("toppings." + package)
    for info in pkgutil.walk_packages(top.__path__, top.__name__ + "."):
        importlib.import_module(info.name)
        names.append(info.name)
for stand_in in %r:
    assert sys.modules[stand_in].STAND_IN, stand_in
print(len(names))
"""


@pytest.fixture(scope="module")
def stand_in_env(tmp_path_factory):
    """An environment whose sys.path starts with stand-in packages named like our folders,
    run from a directory outside the repository."""
    root = tmp_path_factory.mktemp("stand_ins")
    for name in STAND_INS:
        (root / name).mkdir()
        (root / name / "__init__.py").write_text("STAND_IN = True\n")
    env = dict(os.environ, PYTHONPATH=str(root), TRITON_INTERPRET="1")
    return root, env


def test_every_module_imports_beside_stand_ins(stand_in_env):
    root, env = stand_in_env
    code = f"import {', '.join(STAND_INS)}\n" + IMPORT_ALL % (STAND_INS,)
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) > 40  # every module of the five packages was walked


@pytest.mark.parametrize("command", COMMANDS)
def test_console_command_help_beside_stand_ins(stand_in_env, command):
    root, env = stand_in_env
    exe = os.path.join(os.path.dirname(sys.executable), command)
    out = subprocess.run([exe, "--help"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


def test_generic_names_are_not_installed(tmp_path):
    for name in STAND_INS:
        out = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode != 0 and "ModuleNotFoundError" in out.stderr, name
    out = subprocess.run([sys.executable, "-c", "import toppings.server.engine.engine"],
                         cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr


def _imports(path) -> set[str]:
    """Every module a source file imports, absolute names."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", ["gpu_lora", "cpu_lora"])
def test_adapter_side_never_imports_the_server(package):
    for path in (REPO / package).rglob("*.py"):
        bad = {n for n in _imports(path) if n.startswith("toppings.server")}
        assert not bad, f"{path.relative_to(REPO)} imports {bad}"


def test_every_package_folder_is_installed():
    # A folder missing from pyproject's list works in an editable install and is absent from a
    # wheel (server/http was, until issue 67's session).
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    for name, folder in setuptools["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / folder).parts
            assert ".".join((name, *parts)) in listed, init.parent
