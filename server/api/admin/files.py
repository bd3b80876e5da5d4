"""The files of a PEFT adapter as servers exchange them, and the SHA-256 the registry records.

Part of the HTTP contract between servers and the scheduler (like requests/errors.py): a server
lists an adapter's files at `GET /v1/adapters/NAME/files` and streams each one at
`GET /v1/adapters/NAME/files/FILE`; a server that fetches an adapter from a peer checks the
files against the digest the scheduler's registry holds for it. Only the two files a PEFT
adapter needs are ever listed, served or written (FILES); nothing else of a directory leaves it.

Every file is opened relative to its directory without following a symlink and checked on the
opened descriptor (gpu_lora.peft.directory): a file swapped for a symlink out of the adapter roots
is never listed, hashed or served (an OSError instead).

Digest: SHA-256 over the files in FILES order, each as its name, a zero byte, its size as 8
bytes big-endian, then its bytes. The names and sizes are hashed too, so bytes cannot move
from one file to the other unnoticed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from typing import BinaryIO

from toppings.gpu_lora.peft.config import CONFIG_FILE, WEIGHTS_FILE
from toppings.gpu_lora.peft.config import MAX_FILE_BYTES as MAX_BYTES
from toppings.gpu_lora.peft.directory import file_size, open_dir, open_file

FILES = (CONFIG_FILE, WEIGHTS_FILE)
CHUNK_BYTES = 1 << 20
HEX = frozenset("0123456789abcdef")


def is_digest(value: object) -> bool:
    """Whether `value` is a SHA-256 hex digest (64 lowercase hex digits)."""
    return isinstance(value, str) and len(value) == 64 and set(value) <= HEX


class Digest:
    """Incremental form of the digest, fed file by file in FILES order."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def begin_file(self, name: str, num_bytes: int) -> None:
        self._hash.update(name.encode() + b"\0" + num_bytes.to_bytes(8, "big"))

    def update(self, chunk: bytes) -> None:
        self._hash.update(chunk)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _open(directory: str | os.PathLike, name: str) -> BinaryIO:
    """One of FILES, opened without following a symlink (raises OSError, UnsafeFile)."""
    dir_fd = open_dir(directory)
    try:
        return open_file(dir_fd, name, MAX_BYTES[name])
    finally:
        os.close(dir_fd)


def adapter_digest(directory: str | os.PathLike) -> str:
    """The digest of the adapter in `directory` (raises OSError when a file is missing or is not
    a regular file)."""
    digest = Digest()
    for name in FILES:
        with _open(directory, name) as f:
            digest.begin_file(name, file_size(f))
            while chunk := f.read(CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


def manifest(name: str, directory: str | os.PathLike) -> dict:
    """What `GET /v1/adapters/NAME/files` answers: `{"name", "files": [{"name", "bytes"}]}`."""
    files = []
    for file_name in FILES:
        with _open(directory, file_name) as f:
            files.append({"name": file_name, "bytes": file_size(f)})
    return {"name": name, "files": files}


def read_chunks(directory: str | os.PathLike, name: str) -> Iterator[bytes]:
    """The bytes of one of FILES, in chunks (the file is opened before the first chunk)."""
    if name not in FILES:
        raise ValueError(f"{name!r} is not an adapter file")
    f = _open(directory, name)

    def chunks() -> Iterator[bytes]:
        with f:
            while chunk := f.read(CHUNK_BYTES):
                yield chunk

    return chunks()
