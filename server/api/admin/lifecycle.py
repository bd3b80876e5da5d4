"""Adapters registered and dropped at run time: path confinement and the load/unload logic.

A client names an adapter directory by path, so the path is the attack surface: only
directories under the operator's allowed roots (`--lora-dir`, `--allowed-lora-root`) are read.
A path with a `..` component is refused outright; every other path is resolved with
`os.path.realpath` (symlinks included) and must stay inside a root, and so must the two files
read from it (a 403 that names the escape). That check is on paths, and a file can be swapped
for a symlink between the check and the read; so the loader opens the directory once and each
file relative to it with O_NOFOLLOW, checking the opened file (gpu_lora.peft.directory): adapter
files must be regular files, and a symlinked one, even one pointing inside a root, fails the
load with a 400. Only safetensors weights are ever read (the PEFT loader refuses pickle-only
adapters).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from toppings.gpu_lora.host_memory import ContentKey
from toppings.gpu_lora.peft.adapter import LoraAdapter
from toppings.gpu_lora.peft.config import CONFIG_FILE, WEIGHTS_FILE, AdapterError
from toppings.server.process.threads import torch_on_this_thread_only
from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.errors import ADAPTER_NAME_RE, ADAPTER_NAME_RULE
from toppings.server.requests.request import RequestError

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_PATH_CHARS = 4096


def _real(path: str | os.PathLike) -> str:
    """The resolved path; a 409 when it cannot be resolved because an entry changed under it
    (a symlink swapped for a file between realpath's lstat and its readlink)."""
    try:
        return os.path.realpath(os.fspath(path))
    except OSError as exc:
        raise RequestError(_changed(path, exc), 409, "conflict") from None


def _changed(path: str | os.PathLike, exc: OSError) -> str:
    return (f"{os.fspath(path)!r} changed while it was being read ({exc.strerror or exc}); "
            "retry once it is in place")  # fmt: skip


def is_within(path: str, root: str) -> bool:
    """Whether the resolved `path` is `root` or lies under it (both already realpath'd)."""
    return os.path.commonpath([path, root]) == root


class AdapterPaths:
    """The allowed adapter roots of one server, and the check of a client's `lora_path`."""

    def __init__(self, roots: Iterable[str | os.PathLike]):
        self.roots = tuple(dict.fromkeys(_real(r) for r in roots))

    def resolve(self, raw: object) -> str:
        """The real path of an adapter directory a client named; raises RequestError.

        A relative path is looked up under each root in turn (the first that exists wins).
        """
        if not isinstance(raw, str) or not raw or len(raw) > MAX_PATH_CHARS or "\0" in raw:
            raise RequestError("'lora_path' must be a non-empty path string")
        if ".." in Path(raw).parts:
            raise RequestError("'lora_path' must not contain '..'")
        if not self.roots:
            raise RequestError(
                "loading adapters at run time is disabled: start the server with --lora-dir or "
                "--allowed-lora-root",
                403,
                "permission_denied",
            )
        if os.path.isabs(raw):
            candidates = [raw]
        else:
            candidates = [os.path.join(root, raw) for root in self.roots]
            candidates = [c for c in candidates if os.path.exists(c)] or candidates[:1]
        real = _real(candidates[0])
        self._check_inside(real, raw)
        if not os.path.isdir(real):
            raise RequestError(f"adapter directory {raw!r} does not exist", 404, "not_found")
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            # An early, clear refusal; the loader's O_NOFOLLOW open is what closes the race.
            self._check_inside(_real(os.path.join(real, name)), raw)
        return real

    def _check_inside(self, real: str, raw: str) -> None:
        if not any(is_within(real, root) for root in self.roots):
            raise RequestError(
                f"'lora_path' {raw!r} is outside the allowed adapter directories",
                403,
                "permission_denied",
            )


def check_name(name: object, base_model: str) -> str:
    if not isinstance(name, str) or not ADAPTER_NAME_RE.fullmatch(name):
        raise RequestError(f"'lora_name' must be {ADAPTER_NAME_RULE}")
    if name == base_model:
        raise RequestError(f"{name!r} is the base model's name", 409, "conflict")
    return name


def discover(lora_dir: str | os.PathLike) -> dict[str, str]:
    """Every PEFT adapter directory directly under `lora_dir`, by directory name (sorted).

    Entries that resolve outside `lora_dir` (symlinks) are skipped like any other escape.
    """
    root = Path(lora_dir)
    if not root.is_dir():
        raise AdapterError(f"--lora-dir {str(root)!r} is not a directory")
    paths = AdapterPaths([root])
    found = {}
    for child in sorted(root.iterdir()):
        if not child.is_dir():
            continue
        if not (child / CONFIG_FILE).is_file():
            log.warning("skipping %s: no %s", child, CONFIG_FILE)
            continue
        try:
            found[child.name] = paths.resolve(child.name)
        except RequestError as exc:
            log.warning("skipping %s: %s", child, exc)
    return found


class AdapterThread:
    """The threads on which adapters are registered and unregistered at run time: one for
    loads, one for unloads.

    A load and an unload run torch ops on the adapter pool's rows (an unload zeroes the
    adapter's rows in every layer) large enough for torch to run them in parallel, and OpenMP
    gives every thread that starts a parallel region a team of worker threads of its own, kept
    for that thread's life. On the HTTP handler threads (hundreds, long-lived, woken in turn),
    every handler that ever loaded or unloaded an adapter kept a team: the soak's thread count
    and memory grew for an hour (bench/soak.py, issue 48). Here torch runs on this thread
    alone, so it starts no team at all (a second team slows every decode step: threads.py).
    An unload waits for the engine's step (it takes the engine's lock); a registration, outside
    the cached mode, touches the host side only and does not: on one thread, every first use of
    a resolved adapter waited behind the unload that made room for another one. So unloads have
    a thread of their own, and the engine orders the two (Engine.register_adapter)."""

    def __init__(self) -> None:
        self._loads = _torch_thread("adapter-admin")
        self._unloads = _torch_thread("adapter-unload")

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) on the loads' thread; its result or its exception."""
        return self._loads.submit(fn, *args).result()

    def run_unload(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) on the unloads' thread; its result or its exception."""
        return self._unloads.submit(fn, *args).result()


def _torch_thread(name: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                              initializer=torch_on_this_thread_only)  # fmt: skip


class AdapterAdmin:
    """The logic behind /v1/load_lora_adapter and /v1/unload_lora_adapter."""

    def __init__(self, engine, paths: AdapterPaths, thread: AdapterThread | None = None):
        """thread: where the engine's adapter table changes (shared with the peer fetcher)."""
        self.engine = engine
        self.paths = paths
        self.thread = thread or AdapterThread()

    def load(self, body: dict) -> dict:
        """Register `lora_name` from `lora_path`; returns the adapter's card."""
        name, path = self.check(body)
        with _read_errors(name, path):
            adapter = self.thread.run(self.engine.add_adapter, name, path)
        log.info("loaded adapter %s from %s", name, path)
        return {"lora_name": name, "rank": adapter.rank, "target_modules": adapter.target_modules}

    def check(self, body: dict) -> tuple[str, str]:
        """The name and real directory of a load body `{"lora_name", "lora_path"}`, once the
        name follows the rule and is not loaded and the path lies under an allowed root."""
        unknown = set(body) - {"lora_name", "lora_path"}
        if unknown:
            raise RequestError(f"unknown fields: {', '.join(sorted(unknown))}")
        name = check_name(body.get("lora_name"), self.engine.model_name)
        path = self.paths.resolve(body.get("lora_path"))
        if any(a["name"] == name for a in self.engine.adapters()):
            raise RequestError(f"adapter {name!r} is already loaded", 409, "conflict")
        return name, path

    def open(self, name: str, path: str) -> LoraAdapter:
        """Read and check the adapter at `path` (from `check`) without registering it, on the
        calling thread, which must start no OpenMP team (torch_on_this_thread_only): the slow
        part of a load, several at once (the resolver's readers)."""
        with _read_errors(name, path):
            return self.engine.open_adapter(name, path)

    def register(self, adapter: LoraAdapter, content: ContentKey | None = None) -> AdapterRef:
        """Register an adapter `open` read, or one `remove` returned, on the adapter thread;
        `content`: its content key when the caller made it."""
        return self.thread.run(self.engine.register_adapter, adapter, content)

    def unload(self, body: dict) -> dict:
        unknown = set(body) - {"lora_name"}
        if unknown:
            raise RequestError(f"unknown fields: {', '.join(sorted(unknown))}")
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise RequestError("'lora_name' must be a non-empty string")
        self.remove(name)
        return {"lora_name": name, "unloaded": True}

    def remove(self, name: str) -> LoraAdapter:
        """Unregister `name` (RequestError 404 or 409); returns the adapter as it was held."""
        adapter = self.thread.run_unload(self.engine.remove_adapter, name)
        log.info("unloaded adapter %s", name)
        return adapter

    def retire(self, name: str) -> LoraAdapter:
        """`remove`, without waiting for a running step (Engine.retire_adapter)."""
        adapter = self.thread.run_unload(self.engine.retire_adapter, name)
        log.debug("unloaded adapter %s", name)  # the resolver logs the eviction
        return adapter


@contextlib.contextmanager
def _read_errors(name: str, path: str) -> Iterator[None]:
    """A loader's refusal as the client's error: a bad adapter is a 400, a file replaced while
    it was read (past the loader's checks) a 409."""
    try:
        yield
    except AdapterError as exc:
        raise RequestError(f"cannot load adapter {name!r}: {exc}") from None
    except OSError as exc:
        raise RequestError(_changed(path, exc), 409, "conflict") from None
