"""The installed import names live under `toppings.`: unrelated top-level packages named
`server`, `scheduler` or `scripts` neither shadow ours nor are shadowed by them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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
    out = subprocess.run([sys.executable, "-c", "import toppings.server.engine"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
