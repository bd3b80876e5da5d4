"""The README stays a short guide and the documentation beside it builds: README bounds, its
links, the set-up and test commands CI runs from it, `mkdocs build --strict` (which fails on a
broken link), and the flag reference equal to what its generator makes from the code now."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import results_table
from toppings.scripts import flag_reference
from toppings.server.cli_args import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250
MAX_README_WIDTH = 119
SETUP = 'python3 -m pip install torch==2.13.0 -e ".[test]"'
TEST = "python3 -m pytest -q"
needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material are not installed (the test extras install them)",
)


def test_the_readme_is_short_and_narrow():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README has {len(lines)} lines"
    wide = [(i + 1, len(line)) for i, line in enumerate(lines) if len(line) > MAX_README_WIDTH]
    assert not wide, f"README lines over {MAX_README_WIDTH} characters (line, width): {wide}"


def test_the_readme_holds_the_commands_ci_runs():
    """.ci/run runs the README's set-up and test commands: both stay, as code lines."""
    code = {line.strip() for line in README.read_text().splitlines() if line.startswith("    ")}
    assert SETUP in code and TEST in code
    ci = (ROOT / ".ci" / "run").read_text()
    assert SETUP in ci and TEST in ci


def test_the_readmes_relative_links_exist():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert local, "the README links to its documentation"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
         "-d", str(site)],
        capture_output=True, text=True, timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip


@needs_mkdocs
def test_the_docs_build_strictly(tmp_path):
    result = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "flags" / "index.html").is_file()


@needs_mkdocs
def test_a_broken_link_fails_the_docs_build(tmp_path):
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "serving.md"
    page.write_text(page.read_text() + "\nSee [a page that is gone](no-such-page.md).\n")
    result = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stdout + result.stderr


def test_the_flag_reference_is_what_the_code_makes():
    """docs/flags.md drifted from the code: regenerate it with
    `python -m toppings.scripts.flag_reference`."""
    assert (ROOT / "docs" / "flags.md").read_text() == flag_reference.generate(), (
        "docs/flags.md is not what the code makes: run python -m toppings.scripts.flag_reference"
    )


def test_the_flag_reference_names_every_flag_of_every_command():
    from toppings.scheduler.cli import build_parser as scheduler_parser
    from toppings.scripts.demo import build_parser as demo_parser
    from toppings.scripts.launch.cli import build_parser as launch_parser
    from toppings.scripts.loadgen.cli import build_parser as loadgen_parser

    text = flag_reference.generate()
    for parser in (build_parser(), scheduler_parser(), launch_parser(), loadgen_parser(),
                   demo_parser()):  # fmt: skip
        flags = [o for a in parser._actions if a.dest != "help" for o in a.option_strings]
        missing = [flag for flag in flags if f"`{flag}`" not in text]
        assert not missing, (parser.prog, missing)


def test_the_flag_reference_check_fails_on_drift(tmp_path):
    stale = tmp_path / "flags.md"
    stale.write_text(flag_reference.generate().replace("`--chat-template`", "`--template`"))
    assert flag_reference.main(["--out", str(stale), "--check"]) == 1
    assert flag_reference.main(["--out", str(stale)]) == 0
    assert flag_reference.main(["--out", str(stale), "--check"]) == 0


def test_the_results_table_is_what_the_result_files_make():
    """docs/benchmarks.md's table drifted from bench/results: regenerate it with
    `python -m bench.results_table` (a new file goes into its CURRENT or EARLIER first)."""
    assert not results_table.unclassified(), (
        "result files in neither bench/results_table.py CURRENT nor EARLIER (or listed there "
        f"without a file): {results_table.unclassified()}"
    )
    page = results_table.PAGE.read_text()
    assert results_table.with_table(page, results_table.table()) == page, (
        "docs/benchmarks.md's table is stale: run python -m bench.results_table"
    )


def test_the_results_table_check_fails_on_drift_and_unknown_files(tmp_path, monkeypatch):
    results = tmp_path / "results"
    results.mkdir()
    for name in results_table.CURRENT:
        (results / name).write_text((results_table.RESULTS / name).read_text())
    for name in results_table.EARLIER:
        (results / name).write_text("{}")
    page = tmp_path / "benchmarks.md"
    page.write_text(f"# B\n\n{results_table.BEGIN}\n{results_table.END}\n")
    monkeypatch.setattr(results_table, "RESULTS", results)
    monkeypatch.setattr(results_table, "PAGE", page)
    assert results_table.main(["--check"]) == 1  # the table is missing
    assert results_table.main([]) == 0
    assert results_table.main(["--check"]) == 0
    assert "`engine_throughput.json`" in page.read_text()
    (results / "new_bench.json").write_text("{}")
    assert results_table.main(["--check"]) == 1  # a file in neither list
