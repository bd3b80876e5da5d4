"""Where an adapter named by a request but not registered is looked for: one class per kind.

`--lora-resolver KIND:ARG` picks a row of `SOURCE_KINDS` by its prefix (vLLM's resolver plugins
are the model: a directory, a hub, a bucket). A source maps a name to a directory under its
`root`, and that directory is then loaded exactly as `/v1/load_lora_adapter` loads one with
`root` as the only allowed root (server.api.admin.lifecycle: the `..` and symlink checks on the
path, the loader's O_NOFOLLOW opens, the rank and size limits, the digest dedupe of registration).
A source that fetches (a hub, S3) would download into `root` in `locate` and return the
directory it wrote; the checks after it stay the same.

The `dir` kind looks an adapter up as `PATH/<name>`. A name is looked up only when it is one
path component of the adapter-name rule (`ADAPTER_NAME_RE` without `/`): never `..`, never
absolute, never nested; anything else is simply not there (404), without touching the file system.
"""

from __future__ import annotations

import argparse
import os
from typing import ClassVar, Protocol

from toppings.server.requests.errors import ADAPTER_NAME_RE, NOT_FOUND, unknown_adapter
from toppings.server.requests.request import RequestError


class AdapterSource(Protocol):
    """Finds an unregistered adapter's directory by name (see the module docstring)."""

    root: str  # every directory `locate` returns lies under it (the load's only allowed root)

    def locate(self, name: str) -> str:
        """The adapter directory for `name`, relative to `root` or absolute under it; raises
        RequestError 404 (type not_found) when the source has no adapter of that name."""
        ...


def is_component_name(name: str) -> bool:
    """Whether `name` follows the adapter-name rule and is a single path component."""
    return ADAPTER_NAME_RE.fullmatch(name) is not None and "/" not in name


class DirSource:
    """`dir:PATH`: the adapter `name` is the directory `PATH/<name>`."""

    kind: ClassVar[str] = "dir"

    def __init__(self, arg: str):
        """arg: the directory; refused (ValueError) unless it is one now, so that a typo fails
        at start-up rather than as a 404 on every request."""
        if not arg or not os.path.isdir(arg):
            raise ValueError(f"--lora-resolver dir:{arg}: {arg!r} is not a directory")
        self.root = os.path.realpath(arg)

    def locate(self, name: str) -> str:
        # A missing directory is a 404 before any room is made for it (no eviction for it);
        # the load checks the path again, symlinks included.
        if not is_component_name(name) or not os.path.isdir(os.path.join(self.root, name)):
            raise RequestError(unknown_adapter(name), 404, NOT_FOUND)
        return name  # relative: resolved under `root` by the load's path checks


# The kinds of --lora-resolver, by the prefix before the first ':'.
SOURCE_KINDS: dict[str, type] = {DirSource.kind: DirSource}


def split_spec(spec: str) -> tuple[type, str]:
    """`KIND:ARG` -> (the kind's class, ARG); ValueError naming the kinds for anything else."""
    kind, sep, arg = spec.partition(":")
    if not sep or kind not in SOURCE_KINDS or not arg:
        kinds = ", ".join(f"{k}:..." for k in SOURCE_KINDS)
        raise ValueError(f"--lora-resolver wants KIND:ARG with KIND one of {kinds}, not {spec!r}")
    return SOURCE_KINDS[kind], arg


def make_source(spec: str) -> AdapterSource:
    """The source a `--lora-resolver` value names; ValueError when it cannot be made."""
    cls, arg = split_spec(spec)
    return cls(arg)


def resolver_spec(text: str) -> str:
    """argparse's type of --lora-resolver: the value, once its kind is known."""
    try:
        split_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
