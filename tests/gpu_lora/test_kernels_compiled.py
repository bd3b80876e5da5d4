"""Triton LoRA kernels compiled for a GPU: a cubin build that needs no GPU, and runs on CUDA.

Interpret mode (tests/gpu_lora/test_kernels.py) checks the numbers but never compiles, so a kernel
that only the compiler rejects would pass there; the first test here catches that on any machine.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from toppings.gpu_lora.kernels import get_kernels, reference

COMPILE_FOR_SM90 = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from toppings.gpu_lora.kernels import triton_decode, triton_prefill

for kern in (triton_decode._shrink_kernel, triton_decode._expand_kernel,
             triton_prefill._shrink_kernel, triton_prefill._expand_kernel):
    for padded in (True, False):
        consts = {"BLOCK_M": 32, "BLOCK_R": 64 if padded else 16, "BLOCK_K": 64, "BLOCK_N": 64,
                  "PADDED": padded, "UPCAST": False}
        consts = {k: v for k, v in consts.items() if k in kern.arg_names}
        sig = {}
        for name in kern.arg_names:
            if name in consts:
                sig[name] = "constexpr"
            elif name in ("offsets_ptr", "ranks_ptr", "seg_starts_ptr"):
                sig[name] = "*i32"
            elif name in ("h_ptr", "scales_ptr"):
                sig[name] = "*fp32"
            else:
                sig[name] = "*bf16" if name.endswith("_ptr") else "i32"
        src = ASTSource(fn=kern, signature=sig, constexprs=consts)
        assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
"""


def test_triton_kernels_compile_for_sm90():
    """Interpret mode never compiles: build every kernel into an H100/H200 cubin (no GPU needed)."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton ships no ptxas here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_SM90], env=env, cwd=root, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernel", ["bgmv", "mbgmv"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_on_cuda(kernel, dtype):
    """Compiled kernels on real shapes (H 4096, 32 requests, ranks 8-64) against the reference."""
    gen = torch.Generator().manual_seed(23)
    hidden, pool_ranks = 4096, (16, 64, 8, 32)
    num_rows = sum(pool_ranks) + 3 * len(pool_ranks)
    lora_a = torch.full((num_rows, hidden), math.nan)  # NaN in every row no adapter owns
    lora_b = torch.full((num_rows, hidden), math.nan)
    offsets, pos = [], 0
    for r in pool_ranks:
        offsets.append(pos + 3)
        lora_a[pos + 3 : pos + 3 + r] = torch.randn(r, hidden, generator=gen) / hidden**0.5
        lora_b[pos + 3 : pos + 3 + r] = torch.randn(r, hidden, generator=gen) / r**0.5
        pos += 3 + r
    pick = torch.randint(len(pool_ranks), (32,), generator=gen).tolist()
    meta = (
        torch.tensor([offsets[a] for a in pick], dtype=torch.int32),
        torch.tensor([pool_ranks[a] for a in pick], dtype=torch.int32),
        0.5 + torch.rand(32, generator=gen),
    )
    lengths = torch.randint(1, 40, (32,), generator=gen)
    seg_starts = torch.cat([torch.zeros(1), lengths.cumsum(0)]).to(torch.int32)
    x = torch.randn(int(seg_starts[-1]), hidden, generator=gen).to(dtype)
    y0 = torch.randn(int(seg_starts[-1]), hidden, generator=gen).to(dtype)
    lora_a, lora_b = lora_a.to(dtype), lora_b.to(dtype)
    tail = (64,) if kernel == "bgmv" else ()
    for phase in ("decode", "prefill"):
        rows = slice(0, 32) if phase == "decode" else slice(None)
        lead = (seg_starts,) if phase == "prefill" else ()
        expected = y0[rows].clone()
        ref = getattr(reference, f"{kernel}_{phase}")
        ref(expected, x[rows], lora_a, lora_b, *lead, *meta, *tail)
        on_gpu = [t.cuda() for t in (y0[rows], x[rows], lora_a, lora_b, *lead, *meta)]
        get_kernels("triton").table[(kernel, phase)](*on_gpu, *tail)
        out = on_gpu[0].cpu()
        atol, rtol = TOL[dtype]
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
