"""`--chat-template PATH`: a Jinja chat template used instead of the checkpoint's own, as vLLM's
and llama.cpp's `--chat-template` take it (for a checkpoint whose template lacks tools or a
system role, or renders them badly).

The file is read and compiled when the command line is parsed, before the model loads, so a
missing, unreadable or malformed template is one line and exit status 2. It compiles in the
environment chat templates render in (server.chat_template.sandbox); the tokenizer copies that
tokenize chat requests carry it (server.api.tokenizer_pool).

Only a regular file of at most MAX_TEMPLATE_BYTES is taken. The path is the operator's, but a
wrong one must not turn into a secret or a hang: nothing under /proc, /sys or /dev (their files
say size 0, and /proc/self/environ holds the process's environment, the API key included), no
device or fifo (opened without blocking, then checked on the open file), and no symbolic link
whose target lies outside the link's own directory (a link to /etc/passwd). The read takes at
most one byte past the cap whatever the file's size says.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_TEMPLATE_BYTES = 1 << 20  # a chat template is kilobytes; this bounds a wrong path's read
PSEUDO_ROOTS = ("/proc", "/sys", "/dev")  # kernel files, not templates


def _under(path: Path, root: str) -> bool:
    return path == Path(root) or Path(root) in path.parents


def _checked_target(file: Path, where: str) -> Path:
    """The real path of `file` once it passes the path rules; raises ValueError."""
    if not file.exists() and not file.is_symlink():
        raise ValueError(f"{where}: no such file")
    try:
        target = file.resolve(strict=True)
    except (OSError, RuntimeError):  # a dangling link or a loop of them
        raise ValueError(f"{where}: a link to nothing readable") from None
    if file.is_symlink():
        home = file.absolute().parent.resolve()
        if not _under(target, str(home)):
            raise ValueError(f"{where}: a symbolic link to {target}, outside its directory "
                             f"{home}: give the file itself")  # fmt: skip
    for root in PSEUDO_ROOTS:
        if _under(target, root) or _under(file.absolute(), root):
            raise ValueError(f"{where}: under {root}: not a chat template file")
    return target


def _read_bounded(target: Path, where: str) -> bytes:
    """At most MAX_TEMPLATE_BYTES + 1 bytes of the regular file at `target`."""
    # O_NONBLOCK: opening a fifo would wait for a writer; the check below then refuses it.
    fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{where}: not a regular file")
        chunks, left = [], MAX_TEMPLATE_BYTES + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 16))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_chat_template(path: str) -> str:
    """The template text of the file at `path`; raises ValueError (one line, naming the flag)
    when it is missing, not a regular file (or a link out of its directory), unreadable, over
    MAX_TEMPLATE_BYTES, not UTF-8 text, empty or not valid Jinja."""
    import jinja2

    from toppings.server.chat_template.sandbox import compile_template

    where = f"--chat-template {path}"
    try:
        data = _read_bounded(_checked_target(Path(path).expanduser(), where), where)
    except OSError as e:
        raise ValueError(f"{where}: cannot read it: {e.strerror or e}") from None
    if len(data) > MAX_TEMPLATE_BYTES:
        raise ValueError(f"{where}: over {MAX_TEMPLATE_BYTES} bytes: not a chat template")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{where}: not UTF-8 text") from None
    if not text.strip():
        raise ValueError(f"{where}: the file is empty")
    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as e:
        problem = f"line {e.lineno}: {e.message}"
        raise ValueError(f"{where}: not a valid Jinja template: {problem}") from None
    return text
