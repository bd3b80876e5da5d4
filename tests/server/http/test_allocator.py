"""The server's glibc allocator (issue 48): few arenas however many handler threads allocate,
and free pages trimmed. Run in fresh processes: arenas, once made, stay for the process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from toppings.server.http.allocator import MAX_ARENAS, _glibc

SCRIPT = """
import ctypes, os, re, sys, tempfile, threading
if sys.argv[1] == "tuned":
    from toppings.server.http.allocator import tune_allocator
    assert tune_allocator()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.fopen.restype = ctypes.c_void_p
ready, go = threading.Barrier(9), threading.Event()

def work():
    ready.wait()
    blocks = [libc.malloc(4096) for _ in range(64)]  # each new thread asks for an arena
    go.wait()
    for b in blocks:
        libc.free(b)

threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
ready.wait()
path = tempfile.mktemp()
fp = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(fp))
libc.fclose(ctypes.c_void_p(fp))
go.set()
for t in threads:
    t.join()
print(len(re.findall('<heap nr="', open(path).read())))
os.unlink(path)
"""


def _heaps(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         timeout=120, check=True, env=env)  # fmt: skip
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(_glibc() is None, reason="glibc only")
def test_handler_threads_share_a_few_arenas():
    assert _heaps("tuned") <= MAX_ARENAS
    assert _heaps("default") > MAX_ARENAS  # glibc's own default: an arena per thread


def test_onednn_caches_bounded_unless_the_operator_set_them(monkeypatch):
    from toppings.server.http.allocator import ONEDNN_CACHE_ENTRIES, bound_onednn_caches

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "64")  # the operator's
    bound_onednn_caches()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_CACHE_ENTRIES)
    assert os.environ["LRU_CACHE_CAPACITY"] == "64"


@pytest.mark.skipif(_glibc() is None, reason="glibc only")
def test_tcache_turned_off_once_keeping_other_tunables():
    from toppings.server.http.allocator import tcache_off_environment

    env = tcache_off_environment({"GLIBC_TUNABLES": "glibc.malloc.mxfast=64"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.mxfast=64:glibc.malloc.tcache_count=0"}
    assert tcache_off_environment(env) is None  # the re-executed process goes on
    assert tcache_off_environment({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=3"}) is None


@pytest.mark.skipif(_glibc() is None, reason="glibc only")
def test_the_process_restarts_itself_with_the_tcache_off():
    # Issue 48: waitress's hundreds of handler threads each filled a cache of freed blocks.
    script = (
        "import os, sys\n"
        "from toppings.server.http.allocator import restart_without_tcache\n"
        "print('start', os.getpid(), flush=True)\n"
        "restart_without_tcache()\n"
        "print('tunables', os.getpid(), os.environ['GLIBC_TUNABLES'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True, env=env).stdout.split()  # fmt: skip
    pid = out[1]
    assert out == ["start", pid, "start", pid, "tunables", pid, "glibc.malloc.tcache_count=0"]
