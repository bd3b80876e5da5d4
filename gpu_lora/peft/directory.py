"""Open the files of an adapter directory without following a symlink, and check what was opened.

Checking a path and then opening the same path is a race: between the two, a file can be
swapped for a symlink that points out of the allowed roots, and the open follows it. So the
directory is opened once (`open_dir`), each file is opened relative to that descriptor with
O_NOFOLLOW (a symlink in a file's place fails instead of being followed), and the opened
descriptor, not the path, is checked: a regular file, within a size cap. Every read goes
through that descriptor. Adapter files must therefore be regular files, never symlinks (even
ones that stay inside the directory: what a symlink points to can change after any check).

O_NONBLOCK keeps the open of a FIFO in a file's place from waiting for a writer; it changes
nothing for a regular file. Errors are OSErrors (UnsafeFile for a file that is not a regular
file or is too large); callers turn them into their own messages.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafeFile(OSError):
    """An adapter file that is a symlink, not a regular file, or larger than its cap."""


def open_dir(path: str | os.PathLike) -> int:
    """A descriptor of the directory `path`, which the caller closes (os.close); raises OSError
    (FileNotFoundError, NotADirectoryError, ...)."""
    return os.open(path, _DIR_FLAGS)


def open_file(dir_fd: int, name: str, max_bytes: int | None = None) -> BinaryIO:
    """The file `name` of the directory `dir_fd`, opened for binary reading without following a
    symlink; raises UnsafeFile unless the opened file is a regular file of at most `max_bytes`,
    FileNotFoundError when there is none."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(f"{name} is a symlink; adapter files must be regular files") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFile(f"{name} is not a regular file")
        if max_bytes is not None and info.st_size > max_bytes:
            raise UnsafeFile(f"{name} is larger than {max_bytes} bytes")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def has_file(dir_fd: int, name: str) -> bool:
    """Whether the directory `dir_fd` has an entry `name` (a symlink counts, unfollowed)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def file_size(f: BinaryIO) -> int:
    """The size of an opened file, from its descriptor."""
    return os.fstat(f.fileno()).st_size
