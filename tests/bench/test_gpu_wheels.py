"""bench/gpu_wheels.txt carries what the device image lacks: every third-party module that the
tree imports at module level (what collecting the tests there needs) comes from the image or a
listed wheel, and so does every need of a listed wheel (they install with --no-deps there)."""

from __future__ import annotations

import ast
import sys
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
# Of the device image's packages (../.library/device/KINDS.md, read 2026-11-17), those the tree
# or the carried wheels need.
IMAGE = {
    canonicalize_name(n)
    for n in """torch transformers triton tokenizers safetensors peft
    numpy requests tqdm regex prometheus-client werkzeug pytest pyyaml matplotlib jinja2 click
    markupsafe attrs h11 certifi packaging urllib3""".split()
}
LOCAL = {"toppings", "bench", "tests", "cpu_lora_helpers"}
# Python 3.12 on Linux, as on the device
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}  # fmt: skip


def carried() -> set[str]:
    lines = (ROOT / "bench" / "gpu_wheels.txt").read_text().splitlines()
    reqs = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    return {canonicalize_name(r.name) for r in reqs}


def module_level_imports() -> set[str]:
    """Top-level names imported at module level under tests/, bench/ and the packages."""
    names = set()
    for folder in ("tests", "bench", "server", "cpu_lora", "gpu_lora", "scheduler", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.Import):
                    names.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - LOCAL - {"__future__"}


def test_what_the_tree_imports_is_in_the_image_or_carried():
    dists = packages_distributions()
    have = IMAGE | carried()
    unprovided = sorted(m for m in module_level_imports() if m not in dists)
    assert not unprovided, f"no installed distribution provides {unprovided}"
    missing = sorted(
        m for m in module_level_imports() if not {canonicalize_name(d) for d in dists[m]} & have
    )
    assert not missing, f"add to bench/gpu_wheels.txt (or IMAGE, if the image has it): {missing}"


def test_every_carried_wheel_needs_only_the_image_or_other_carried_wheels():
    listed = carried()
    missing = set()
    for name in sorted(listed):
        try:
            needs = [Requirement(r) for r in requires(name) or []]
        except PackageNotFoundError:
            continue  # pinned for the device, not installed here: its needs are not known here
        for need in needs:
            if need.marker is None or need.marker.evaluate(MARKERS):
                if canonicalize_name(need.name) not in IMAGE | listed:
                    missing.add(f"{need.name} (for {name})")
    assert not missing, f"carry these too (bench/gpu_wheels.txt): {sorted(missing)}"
