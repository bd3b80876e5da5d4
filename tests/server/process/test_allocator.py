"""The server's glibc allocator (issue 48): few arenas however many handler threads allocate,
and free pages trimmed. Run in fresh processes: arenas, once made, stay for the process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from toppings.server.process.allocator import MAX_ARENAS, _glibc

SCRIPT = """
import ctypes, os, re, sys, tempfile, threading
if sys.argv[1] == "tuned":
    from toppings.server.process.allocator import tune_allocator
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
    from toppings.server.process.allocator import ONEDNN_CACHE_ENTRIES, bound_onednn_caches

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "64")  # the operator's
    bound_onednn_caches()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_CACHE_ENTRIES)
    assert os.environ["LRU_CACHE_CAPACITY"] == "64"
