"""The product's modules stay readable: none over 400 lines, no function over 80 (STYLE.md: one
concept per module, split by concept; a function that long holds more than one step)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "cpu_lora", "gpu_lora", "scheduler", "scripts")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def test_no_module_over_400_lines():
    long = {str(p.relative_to(REPO)): n for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}  # fmt: skip
    assert not long, long


def test_no_function_over_80_lines():
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.name}"] = lines
    assert not long, long
