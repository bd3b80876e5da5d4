"""Named POSIX shared memory and semaphores with process-wide cleanup.

Every name this package creates is `/toppings-<tag>-<counter>-<what>`, where the creator's tag
is its pid and a random word (`process_tag`), so a test (or an orphaned worker) can find what a
process left behind in /dev/shm: shared memory appears there as `toppings-...`, semaphores as
`sem.toppings-...`. The word matters where two processes have one pid: two containers (each
its own PID namespace, each server pid 1) sharing a /dev/shm; named by the pid alone, the second
server took the first one's live names for stale ones and unlinked them, and each one's exit
removed the other's. Created names and started worker processes are
tracked here and removed by `cleanup()`, which runs at interpreter exit (atexit) and on SIGTERM.
The SIGTERM handler is installed only where none is set (the default disposition); it cleans up
and then lets the default action end the process. A program that sets its own SIGTERM handler
keeps it and is expected to close its pools (atexit still runs on a normal exit).

/dev/shm is a tmpfs: a segment sized by ftruncate alone is sparse, and the first write to a page
the tmpfs cannot back kills the process with SIGBUS. `create_shm` therefore reserves the pages it
is asked to (`os.posix_fallocate`) before mapping, and `reserve_shm` reserves a range of a sparse
segment before it is written; running out is a `SharedMemoryFull` raised there, never a signal.
"""

from __future__ import annotations

import atexit
import errno
import itertools
import logging
import mmap
import os
import secrets
import signal
import subprocess
import threading

import posix_ipc

log = logging.getLogger(__name__)

PREFIX = "toppings"
SHM_DIR = "/dev/shm"

_counter = itertools.count()
_lock = threading.Lock()
_shm_names: set[str] = set()
_sem_names: set[str] = set()
_processes: dict[int, subprocess.Popen] = {}
_owner_pid: int | None = None  # a forked child must not unlink its parent's names at its exit
_word: tuple[int, str] | None = None  # (pid, random word) of process_tag
_prev_sigterm = None


class SharedMemoryFull(OSError):
    """/dev/shm cannot back the bytes asked for; the message names them and the space free."""


def free_bytes() -> int:
    """Bytes free in /dev/shm now."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _full(name: str, size: int, exc: OSError) -> SharedMemoryFull:
    error = SharedMemoryFull(
        f"shared memory is full: {name} needs {size} bytes, {SHM_DIR} has {free_bytes()} bytes "
        f"free ({exc.strerror or exc})"
    )
    error.errno = exc.errno
    return error


# Errors of ftruncate, fallocate and mmap that mean "no room", not a bug.
_NO_ROOM = (errno.ENOSPC, errno.EFBIG, errno.ENOMEM)


def process_tag() -> str:
    """This process's part of its names, `<pid>.<random word>` (a forked child gets its own)."""
    global _word
    pid = os.getpid()
    if _word is None or _word[0] != pid:
        _word = (pid, secrets.token_hex(4))
    return f"{pid}.{_word[1]}"


def new_name(what: str) -> str:
    """A fresh name `/toppings-<tag>-<n>-<what>` for a shared memory segment or semaphore."""
    return f"/{PREFIX}-{process_tag()}-{next(_counter)}-{what}"


def leftovers(creator: int | str | None = None) -> list[str]:
    """Entries of /dev/shm (semaphores included) created by this process (None), by the
    process of tag `creator` (a str), or by any process of pid `creator` (an int: a child this
    one started, in its PID namespace)."""
    if creator is None:
        creator = process_tag()
    start = f"{creator}." if isinstance(creator, int) else f"{creator}-"
    mine = (f"{PREFIX}-{start}", f"sem.{PREFIX}-{start}")
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(mine))


def create_shm(name: str, size: int, reserve: int | None = None) -> mmap.mmap:
    """Create (exclusively) and map a zero-filled shared memory segment of `size` bytes.

    Its first `reserve` bytes (default: all) are backed by /dev/shm before it is mapped; a
    caller that reserves less calls `reserve_shm` before writing past them. Raises
    SharedMemoryFull, with nothing left behind, when /dev/shm cannot hold them.
    """
    _install_handlers()
    reserve = size if reserve is None else min(reserve, size)
    shm = _create(posix_ipc.SharedMemory, name)
    with _lock:
        _shm_names.add(name)
    try:
        os.ftruncate(shm.fd, size)
        if reserve:
            os.posix_fallocate(shm.fd, 0, reserve)
        return mmap.mmap(shm.fd, size)
    except OSError as exc:
        unlink_shm(name)
        if exc.errno in _NO_ROOM:
            raise _full(name, reserve or size, exc) from None
        raise
    except BaseException:
        unlink_shm(name)
        raise
    finally:
        shm.close_fd()


def reserve_shm(name: str, offset: int, length: int) -> None:
    """Back bytes [offset, offset + length) of segment `name` by /dev/shm (SharedMemoryFull when
    it cannot); data already there is kept."""
    if length <= 0:
        return
    shm = posix_ipc.SharedMemory(name)
    try:
        os.posix_fallocate(shm.fd, offset, length)
    except OSError as exc:
        if exc.errno in _NO_ROOM:
            raise _full(name, length, exc) from None
        raise
    finally:
        shm.close_fd()


def attach_shm(name: str) -> mmap.mmap:
    """Map an existing shared memory segment whole (read-write)."""
    shm = posix_ipc.SharedMemory(name)
    try:
        return mmap.mmap(shm.fd, shm.size)
    finally:
        shm.close_fd()


def create_sem(name: str) -> posix_ipc.Semaphore:
    """Create (exclusively) a named semaphore with value 0."""
    _install_handlers()
    sem = _create(posix_ipc.Semaphore, name, initial_value=0)
    with _lock:
        _sem_names.add(name)
    return sem


def _create(kind, name: str, **kwargs):
    """Create `name` exclusively (a name of this process's tag cannot exist unless this process
    made it: ExistentialError is a bug, never another process's name to take)."""
    return kind(name, posix_ipc.O_CREX, **kwargs)


def unlink_shm(name: str) -> None:
    """Remove a shared memory name; mappings stay valid until their last view is gone."""
    with _lock:
        _shm_names.discard(name)
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def unlink_sem(name: str) -> None:
    with _lock:
        _sem_names.discard(name)
    try:
        posix_ipc.unlink_semaphore(name)
    except posix_ipc.ExistentialError:
        pass


def track_process(proc: subprocess.Popen) -> None:
    """Kill `proc` at cleanup unless it was untracked before."""
    with _lock:
        _processes[proc.pid] = proc


def untrack_process(proc: subprocess.Popen) -> None:
    with _lock:
        _processes.pop(proc.pid, None)


def cleanup() -> None:
    """Kill tracked worker processes and unlink every tracked name (idempotent)."""
    if _owner_pid != os.getpid():
        return
    with _lock:
        procs, shms, sems = list(_processes.values()), list(_shm_names), list(_sem_names)
    for proc in procs:
        kill_process(proc)
    for name in shms:
        unlink_shm(name)
    for name in sems:
        unlink_sem(name)


def kill_process(proc: subprocess.Popen, grace_s: float = 0.0) -> None:
    """Wait up to grace_s for proc to exit, then SIGKILL and reap it."""
    if grace_s > 0:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    untrack_process(proc)


def unlink_orphans(tag: str) -> None:
    """Unlink every name the process of `tag` created: a worker's last act when its parent has
    died."""
    for entry in leftovers(tag):
        try:
            if entry.startswith("sem."):
                posix_ipc.unlink_semaphore("/" + entry[len("sem.") :])
            else:
                posix_ipc.unlink_shared_memory("/" + entry)
        except posix_ipc.ExistentialError:
            pass


def _install_handlers() -> None:
    global _owner_pid, _prev_sigterm
    with _lock:
        if _owner_pid == os.getpid():
            return
        _owner_pid = os.getpid()
    atexit.register(cleanup)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit still covers us
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        _prev_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    log.info("SIGTERM: removing shared memory and CPU LoRA workers")
    cleanup()
    # Chain to what was there before us (the default action): terminate with SIGTERM.
    signal.signal(signal.SIGTERM, _prev_sigterm or signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
