"""oneDNN's shape caches are bounded (issue 48): a server that meets a new token count keeps one
compiled primitive per shape, and with the default 1024-entry caches its RSS grew for hours.
Run in a fresh process, as a server starts: the caches read their size at their first use."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from toppings.server.model.linear import packing_works

SCRIPT = """
import ctypes, json
from toppings.server.process.allocator import bound_onednn_caches
bound_onednn_caches()  # as toppings-serve does, before the first oneDNN op
import torch
from toppings.server.model.linear import Linear

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks "
                "fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info

def held() -> int:
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd

torch.set_num_threads(1)
linear = Linear(torch.randn(384, 256).to(torch.bfloat16))
assert linear.is_packed
marks = []
for rows in range(200, 700):
    linear(torch.randn(rows, 256).to(torch.bfloat16))
    if rows in (400, 699):
        marks.append(held())
print(json.dumps({"growth": marks[1] - marks[0]}))
"""


@pytest.mark.skipif(
    not packing_works(torch.bfloat16), reason="oneDNN's packed bf16 linear is not available"
)
def test_new_token_counts_do_not_grow_memory_once_the_caches_are_full():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=600, check=True)  # fmt: skip
    growth = json.loads(out.stdout.strip().splitlines()[-1])["growth"]
    # 300 new shapes past a full cache: with 1024-entry caches they all stay (tens of MB)
    assert growth < 8 << 20, f"{growth / 2**20:.1f} MiB held by 300 new shapes"
