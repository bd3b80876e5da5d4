"""The flag reference, docs/flags.md, generated from the code.

`toppings-serve`'s flags come from its settings dataclasses (server/settings.py's `setting` and
`Flag` on the fields of server/cli_args.py's `SETTINGS_CLASSES`: the command's own, the HTTP
layer's, and the engine's four parts), one table per group with each flag's default, choices,
environment variable and help. The other commands' flags come from their argparse parsers, in
the same form. A test (tests/scripts/test_flag_reference.py) fails when docs/flags.md is not
what this makes from the code, so a flag added without regenerating it fails CI. Regenerate:

    python -m toppings.scripts.flag_reference            # writes docs/flags.md
    python -m toppings.scripts.flag_reference --check    # exit 1 when it drifted
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from dataclasses import MISSING
from pathlib import Path

DEFAULT_OUT = Path("docs/flags.md")
COMMAND = "python -m toppings.scripts.flag_reference"


def _cell(text: object) -> str:
    """Text fit for one cell of a Markdown table."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(field: dataclasses.Field, flag) -> str:
    from toppings.server.settings import FIELD_DEFAULT

    value = field.default if flag.default is FIELD_DEFAULT else flag.default
    if value is MISSING:
        return "required"
    if value is None or value == ():
        return "—"
    return f"`{value}`"


def serve_section() -> list[str]:
    """toppings-serve's flags, one table per settings class."""
    from toppings.server.cli_args import SETTINGS_CLASSES
    from toppings.server.settings import flag_name

    lines = ["## toppings-serve", ""]
    for cls in SETTINGS_CLASSES:
        summary = (cls.__doc__ or "").strip().splitlines()[0]
        lines += [f"### {cls.title}", "", f"{summary} (`{cls.__module__}.{cls.__name__}`)", ""]
        lines += ["| flag | default | values | help |", "| --- | --- | --- | --- |"]
        for field in dataclasses.fields(cls):
            flag = field.metadata.get("flag")
            if flag is None:
                continue
            choices = flag.choices if flag.choices is not None else field.metadata.get("choices")
            values = " / ".join(f"`{c}`" for c in choices) if choices else (flag.metavar or "")
            if flag.action == "append":
                values += " (repeatable)"
            help_text = flag.help or ""
            if flag.env:
                help_text += f" (environment: `${flag.env}`)"
            names = " / ".join(f"`{n}`" for n in (flag_name(field, flag), *flag.aliases))
            row = [names, _default(field, flag), values.strip(),
                   help_text or "—"]  # fmt: skip
            lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
        lines.append("")
    return lines


@contextlib.contextmanager
def _plain_environment() -> Iterator[None]:
    """No TOPPINGS_* variable: some flags read their defaults from them."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("TOPPINGS_")}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def parser_section(name: str, parser: argparse.ArgumentParser) -> list[str]:
    """One command's flags from its argparse parser, a table per argument group."""
    lines = [f"## {name}", "", _cell(parser.description or ""), ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        lines += (
            [f"### {group.title}", ""]
            if group.title not in ("options", "optional arguments")
            else []
        )
        lines += ["| flag | default | values | help |", "| --- | --- | --- | --- |"]
        for action in actions:
            default = action.default
            shown = "required" if action.required else (
                "—" if default in (None, [], (), argparse.SUPPRESS) or isinstance(default, bool)
                else f"`{default}`")  # fmt: skip
            values = " / ".join(f"`{c}`" for c in action.choices) if action.choices else (
                action.metavar or "")  # fmt: skip
            if isinstance(action, argparse._AppendAction):
                values = f"{values} (repeatable)".strip()
            help_text = (action.help or "—") % {"default": default, "prog": parser.prog}
            row = [" ".join(f"`{o}`" for o in action.option_strings), shown, values, help_text]
            lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
        lines.append("")
    return lines


def other_sections() -> list[str]:
    """The other commands' flags, from their parsers."""
    from toppings.scheduler.cli import build_parser as scheduler_parser
    from toppings.scripts.demo import build_parser as demo_parser
    from toppings.scripts.launch.cli import build_parser as launch_parser
    from toppings.scripts.loadgen.cli import build_parser as loadgen_parser

    commands = {
        "toppings-scheduler": scheduler_parser,
        "toppings-launch": launch_parser,
        "toppings-loadgen": loadgen_parser,
        "toppings-demo": demo_parser,
    }
    lines: list[str] = []
    with _plain_environment():
        for name, build in commands.items():
            lines += parser_section(name, build())
    return lines


def generate() -> str:
    """The text of docs/flags.md from the code as it is now."""
    lines = [
        "# Flags",
        "",
        "<!-- Generated by `" + COMMAND + "` from the settings dataclasses and the commands' "
        "parsers: do not edit by hand. -->",
        "",
        "Every flag of every command, by group. `toppings-serve`'s come from the settings "
        "dataclasses (`server/settings.py`, `server/config.py`, `server/cli_args.py`, "
        "`server/api/options.py`), which also check each value before the model loads; a value "
        "out of range is one `error:` line and exit status 2. Regenerate this page after adding "
        f"a flag: `{COMMAND}` (CI fails when it drifted).",
        "",
        *serve_section(),
        *other_sections(),
    ]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="default: docs/flags.md")
    p.add_argument("--check", action="store_true", help="exit 1 if --out differs, write nothing")
    args = p.parse_args(argv)
    text = generate()
    if args.check:
        current = args.out.read_text() if args.out.is_file() else ""
        if current != text:
            print(f"{args.out} is not what the code makes: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
