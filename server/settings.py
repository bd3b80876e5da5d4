"""Settings as frozen dataclasses whose fields carry their command-line flag and their checks.

A field made with `setting(...)` may name a `Flag` (flag name, help, parse type, choices shown,
environment fallback) and the checks its value must pass (`choices`, a `Bound`). From those:
`add_flags` adds one argparse group per settings class, `build` makes a settings object from the
parsed namespace, and `validate` (run by every settings object's `__post_init__`, whether built
from the command line or in code) refuses a bad value with a ValueError that names the field.
A class checks what involves several of its fields in its own `check` method, which `validate`
calls after the per-field checks. `command_parser` is a whole command's parser from its classes:
every console command (toppings-serve, -scheduler, -launch, -loadgen, -demo) makes its flags so,
and the flag reference (docs/flags.md) is generated from the same classes.

Imports nothing else of toppings: the configuration modules, the HTTP options and every
command's flags use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import logging
import os
from collections.abc import Callable, Collection, Iterable
from dataclasses import MISSING, dataclass
from typing import Any, ClassVar
from urllib.parse import urlsplit

ON_OFF = ("on", "off")
KEY_FLAG_END = "api-key"  # every flag of a key ends so: --api-key, --admin-api-key, ...
FIELD_DEFAULT = object()  # a Flag's default: the field's own


class Bound(enum.Enum):
    """A lower bound a numeric setting must meet (None values are not checked)."""

    POSITIVE = "positive"  # > 0
    NON_NEGATIVE = ">= 0"


@dataclass(frozen=True)
class Flag:
    """How a setting appears on the command line.

    name: the flag (default: `--` and the field name with dashes); type: argparse's parse
    function; choices: the values argparse accepts (default: the setting's own choices);
    default: argparse's default when it differs from the field's (e.g. "auto"); parse: turns the
    parsed value into the field's value; env: an environment variable read as the default (or
    several: the first one set);
    aliases: other names of the same flag (an old name kept working).
    """

    help: str | None = None
    name: str | None = None
    type: Callable[[str], Any] | None = None
    choices: Collection[str] | None = None
    metavar: str | None = None
    action: str | None = None
    default: Any = FIELD_DEFAULT
    parse: Callable[[Any], Any] | None = None
    env: str | tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()

    @property
    def env_names(self) -> tuple[str, ...]:
        return (self.env,) if isinstance(self.env, str) else tuple(self.env or ())


def setting(
    default: Any = MISSING,
    *,
    flag: Flag | None = None,
    choices: Collection[str] | None = None,
    bound: Bound | None = None,
) -> Any:
    """A dataclass field with its flag (None: not on the command line) and its checks."""
    metadata = {"flag": flag, "choices": choices, "bound": bound}
    return dataclasses.field(default=default, metadata=metadata)


class Settings:
    """Base of the settings dataclasses: validated on construction; `title` names the group of
    their flags in `--help`."""

    title: ClassVar[str] = ""

    def __post_init__(self) -> None:
        validate(self)


def validate(settings: Any) -> None:
    """Check every field's choices and bound, then each class's own `check` (base classes
    first); raises ValueError naming the field."""
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            allowed = ", ".join(choices)
            raise ValueError(f"{f.name} must be one of {allowed}, not {value!r}")
        bound = f.metadata.get("bound")
        if bound is None or value is None:
            continue
        if bound is Bound.POSITIVE and not value > 0:
            raise ValueError(f"{f.name} must be positive")
        if bound is Bound.NON_NEGATIVE and not value >= 0:
            raise ValueError(f"{f.name} must be >= 0")
    for cls in reversed(type(settings).__mro__):
        check = cls.__dict__.get("check")
        if check is not None:
            check(settings)


def _flag_fields(cls: type) -> list[tuple[dataclasses.Field, Flag]]:
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if f.metadata.get("flag")]


def flag_name(f: dataclasses.Field, flag: Flag) -> str:
    return flag.name or "--" + f.name.replace("_", "-")


def summary(cls: type) -> str:
    """The first paragraph of `cls`'s docstring on one line: its group's description."""
    paragraph = (cls.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


def add_flags(parser: argparse.ArgumentParser, cls: type[Settings]) -> None:
    """Add the flags of `cls`'s fields to `parser`, in one group titled `cls.title`."""
    group = parser.add_argument_group(cls.title, summary(cls) or None)
    for f, flag in _flag_fields(cls):
        name = flag_name(f, flag)
        kwargs: dict[str, Any] = {"dest": f.name, "help": flag.help}
        default = f.default if flag.default is FIELD_DEFAULT else flag.default
        set_env = [os.environ[name] for name in flag.env_names if os.environ.get(name)]
        default = set_env[0] if set_env else default
        if default is MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = [] if flag.action == "append" else default
        choices = flag.choices if flag.choices is not None else f.metadata.get("choices")
        if choices is not None:
            kwargs["choices"] = tuple(choices)
        elif flag.metavar is None and f.name != name[2:].replace("-", "_"):
            kwargs["metavar"] = name[2:].replace("-", "_").upper()  # as argparse names it
        for key in ("type", "metavar", "action"):
            if getattr(flag, key) is not None:
                kwargs[key] = getattr(flag, key)
        group.add_argument(name, *flag.aliases, **kwargs)


def command_parser(
    prog: str,
    description: str,
    classes: Iterable[type[Settings]],
    epilog: str | None = None,
) -> argparse.ArgumentParser:
    """A command's parser: one group of flags per settings class, in the order given."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog)
    for cls in classes:
        add_flags(parser, cls)
    return parser


def build(cls: type[Settings], args: argparse.Namespace, **given: Any) -> Any:
    """A `cls` from the parsed flags; `given` sets fields that have no flag of their own.
    Raises ValueError (from `validate`) for a value out of its range."""
    values = dict(given)
    for f, flag in _flag_fields(cls):
        value = getattr(args, f.name)
        values[f.name] = flag.parse(value) if flag.parse is not None else value
    return cls(**values)


def on_off(value: str | None) -> bool | None:
    """An `on`/`off` flag as a bool; None (the flag not given, no default) stays None."""
    return None if value is None else value == "on"


def name_path(spec: str) -> tuple[str, str]:
    """`NAME=PATH` -> (NAME, PATH)."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {spec!r}")
    return name, path


def parse_cores(spec: str) -> tuple[int, ...]:
    """`0,2,4-7` -> (0, 2, 4, 5, 6, 7); the order is kept, duplicates are refused."""
    cores: list[int] = []
    try:
        for part in spec.split(","):
            lo, sep, hi = part.strip().partition("-")
            cores.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected cores like 0,2,4-7, got {spec!r}") from None
    if not cores or min(cores) < 0 or len(set(cores)) != len(cores):
        raise argparse.ArgumentTypeError(f"expected distinct non-negative cores, got {spec!r}")
    return tuple(cores)


def process_cores() -> frozenset[int]:
    """The cores this process may run on (every core where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def http_origin(text: str) -> str:
    """An http(s) server's base URL as `scheme://host[:port]`, lower-cased without a trailing
    slash, so that two spellings of one server compare equal; a URL with a path, query,
    fragment or credentials is refused."""
    refused = argparse.ArgumentTypeError(f"expected an http(s) server URL like "
                                         f"http://10.0.0.2:8100, got {text!r}")  # fmt: skip
    try:
        parts = urlsplit(text.strip())
        parts.port  # noqa: B018 (parsing it refuses a port out of range)
    except ValueError:
        raise refused from None
    if (
        parts.scheme.lower() not in ("http", "https")
        or not parts.hostname
        or "@" in parts.netloc
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
    ):
        raise refused
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}"


def positive(text: str) -> int:
    """A positive integer; argparse refuses anything else."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def log_level(text: str) -> str:
    """A logging level name (DEBUG, INFO, ...), upper-cased; argparse refuses anything else."""
    level = text.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise argparse.ArgumentTypeError(f"expected DEBUG, INFO, WARNING or ERROR, got {text!r}")
    return level


def redact_keys(argv: list[str]) -> list[str]:
    """A command line as a log or a result file may show it: the value of every key flag
    (`--api-key KEY`, `--admin-api-key=KEY`, also inside `--scheduler-arg=--admin-api-key=KEY`)
    replaced by KEY."""
    out, hide = [], False
    for arg in argv:
        flag, eq, _ = arg.rpartition("=")
        if hide:
            out.append("KEY")
        elif eq and flag.endswith(KEY_FLAG_END):
            out.append(f"{flag}=KEY")
        else:
            out.append(arg)
        hide = arg.endswith(KEY_FLAG_END) and not eq
    return out
