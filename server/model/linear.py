"""The base model's projections: `F.linear`, or oneDNN with a pre-packed weight on a CPU.

On a CPU, torch's float32 `F.linear` calls MKL's sgemm, which streams the weight far below
memory bandwidth at the few rows of a decode step, where oneDNN with a weight reordered once into
its blocked layout runs several times faster, in float32 and bfloat16 (bench_cpu_linear,
`cpu_linear.json`; docs/benchmarks.md, "Measurements behind the code"). The packed path uses torch's
own mkldnn ops, the ones its compiler uses to pre-pack CPU weights. They are private, so
`packing_works` checks them once per dtype against `F.linear` and every weight stays on `F.linear`
when they are missing or disagree. On a GPU nothing is packed.

At a decode step's few rows a bf16 projection only streams its weight, which oneDNN's packed
GEMM does well below the memory's bandwidth: there a native GEMV reads a copy of the weight of its
own instead (`gemv_kernel`). Where the CPU has AMX, `gemv_bf16_tiles` (`csrc/gemv_tiles.c`) takes
1-16 rows at the cost of one (17-32 at a little more), from a copy laid out in the tile unit's
1 KiB tiles; else `gemv_bf16` (`csrc/linear.c`, faster than oneDNN at 1-4 rows:
bench_single_stream) reads a plain copy, where the CPU has avx512_bf16; float32 likewise has
`gemv_f32` where the CPU has AVX-512; a CPU with AVX2 + FMA only (AMD EPYC before Zen 4) gets
float32 GEMVs of either dtype (`csrc/gemv_int8.c`). The copy doubles the weights' memory (a tied
lm_head's plain copy is the embedding's too), which is why `LlamaModel(plain_gemv=...)` decides it
once for the whole model (by default: only where the copy takes at most a quarter of the host
memory available, `plain_copy_affordable`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from toppings.server import native
from toppings.server.model.huge_pages import place

log = logging.getLogger(__name__)


class Linear:
    """y = x @ W.T (+ b) for a fixed weight W [out, in] and optional bias b [out];
    x [T, in] -> y [T, out] in W's dtype."""

    def __init__(
        self,
        weight: torch.Tensor,
        pack: bool = True,
        plain_gemv: bool = False,
        bias: torch.Tensor | None = None,
    ):
        """pack: a CPU weight goes through oneDNN, packed once; plain_gemv: also keep a copy of
        the weight for the native GEMV at up to `gemv_rows` rows (where one runs); bias: added
        to every row after the product, on every path (as nn.Linear's addmm adds it)."""
        self.out_features, self.in_features = weight.shape
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias {tuple(bias.shape)} does not fit a weight of {weight.shape}")
        self.bias = bias
        self.is_packed = pack and weight.device.type == "cpu" and packing_works(weight.dtype)
        # Only the packed copy is kept here (a tied lm_head's embedding stays, for the lookup).
        self._weight = _pack(weight) if self.is_packed else weight
        wanted = plain_gemv and native.library() is not None  # gemv_kernel's answer is cached
        kernel = gemv_kernel(weight.dtype) if wanted and gemv_fits(weight) else None
        # the GEMV's copy in 2 MiB pages (huge_pages.py); unpacked, the products read a plain one
        self._copy = place(gemv_layout(weight, kernel)) if kernel is not None else None
        if not self.is_packed and self._copy is not None and not kernel.tiled:
            self._weight = self._copy
        self.native_gemv = kernel  # what its decode rows run (decode_structs.py reads it too)
        # The GEMV's kernel and weight bound once: a decode step makes ~120 of these calls, and
        # looking both up per call was a visible share of the step's host time (probe_step_glue).
        self._gemv = _bound_gemv(self._copy, kernel) if self._copy is not None else None

    @property
    def gemv_rows(self) -> int:
        """The most rows its native GEMV takes (0: none runs here)."""
        return self.native_gemv.max_rows if self._gemv is not None else 0

    @property
    def gemv_tiled(self) -> bool:
        """Whether `gemv_weight` is in gemv_tiles.c's tiles rather than plain."""
        return self._gemv is not None and self.native_gemv.tiled

    @property
    def gemv_weight(self) -> torch.Tensor | None:
        """The copy of the weight the native GEMV reads (decode of up to `gemv_rows` rows),
        contiguous: plain [out, in], or in gemv_tiles.c's tiles where `gemv_tiled` ([out, in]
        values in another order); None where this projection has no native GEMV."""
        return self._copy if self._gemv is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x)
        if self.bias is not None:
            y += self.bias
        return y

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T, [T, out], a fresh tensor."""
        rows = x.shape[0]
        if self._gemv is not None and rows <= self.gemv_rows and x.dtype == self._copy.dtype:
            if x.dim() != 2 or x.shape[1] != self.in_features:
                raise ValueError(f"x {tuple(x.shape)} does not fit a weight of "
                                 f"{(self.out_features, self.in_features)}")  # fmt: skip
            if x.stride(-1) == 1:
                y = torch.empty(rows, self.out_features, dtype=x.dtype)
                if not self._gemv(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), rows):
                    return y
        if self.is_packed:
            return _packed_linear(x, self._weight)
        return F.linear(x, self._weight)


GEMV_MAX_ROWS = 32  # the most rows of any GEMV here (gemv_tiles.c's two tiles of x)
PLAIN_COPY_MAX_SHARE = 0.25  # of the host memory available when the model is built


def plain_copy_affordable(num_bytes: int) -> bool:
    """Whether a second copy of `num_bytes` of weights fits the host's spare memory: at most
    PLAIN_COPY_MAX_SHARE of what /proc/meminfo calls available (SmolLM2's 212 MB yes, a 7B
    model's 13 GB on a 24 GiB host no). Where that cannot be read, only copies under 1 GiB."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return num_bytes < 1 << 30
    return num_bytes <= PLAIN_COPY_MAX_SHARE * available


class GemvKernel(NamedTuple):
    """A native GEMV: its name in the library, what `in` must be a multiple of, the most rows it
    takes, and whether it reads the weight in tiles (`pack_tiles`) rather than plain."""

    name: str
    multiple: int
    max_rows: int
    tiled: bool = False


# The GEMVs of each dtype, best first: bf16 on AMX's tile unit (csrc/gemv_tiles.c: 1-32 rows,
# 1-16 at the cost of one), bf16 with avx512_bf16, float32 with AVX-512 (csrc/linear.c; at one
# row it streams float32 weights faster than oneDNN's packed GEMM, bench/bench_single_stream.py);
# else either with AVX2 + FMA in float32 (csrc/gemv_int8.c), for CPUs without AVX-512. `gemv_kernel`
# picks the first that was built here, runs on this CPU and agrees with F.linear.
_GEMV = {
    torch.bfloat16: (
        GemvKernel("gemv_bf16_tiles", 32, 32, tiled=True),
        GemvKernel("gemv_bf16", 32, 4),
        GemvKernel("gemv_bf16_avx2", 16, 4),
    ),
    torch.float32: (GemvKernel("gemv_f32", 16, 4), GemvKernel("gemv_f32_avx2", 16, 4)),
}


def gemv_fits(weight: torch.Tensor) -> bool:
    """Whether a native GEMV can run this weight here (bf16 or float32 on a CPU, 16 | out, and
    `in` a multiple of what the dtype's kernel here needs: 32 for avx512_bf16, else 16)."""
    out_features, in_features = weight.shape
    if weight.device.type != "cpu" or out_features % 16:
        return False
    kernel = gemv_kernel(weight.dtype)
    return kernel is not None and in_features % kernel.multiple == 0


def gemv_works(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a GEMV of `dtype` was built here and agrees with F.linear (`gemv_kernel`)."""
    return gemv_kernel(dtype) is not None


@functools.cache
def gemv_kernel(dtype: torch.dtype) -> GemvKernel | None:
    """The first of `_GEMV[dtype]` built here that runs and agrees with F.linear at one row and
    at its most rows, or None (no native library, or no kernel of this dtype runs here)."""
    if native.library() is None or dtype not in _GEMV:
        return None
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 64, generator=gen).to(dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for kernel in _GEMV[dtype]:
        copy = gemv_layout(weight, kernel)
        for rows in sorted({1, 3, kernel.max_rows}):
            x = torch.randn(rows, 64, generator=gen).to(dtype)
            got = _gemv(x, copy, kernel)
            want = F.linear(x.float(), weight.float())
            if got is None or not torch.allclose(got.float(), want, rtol=tol, atol=tol):
                break
        else:
            return kernel
    return None


def gemv_layout(weight: torch.Tensor, kernel: GemvKernel) -> torch.Tensor:
    """The copy of `weight` [out, in] that `kernel` reads: plain and contiguous, or tiled."""
    return pack_tiles(weight) if kernel.tiled else weight.contiguous()


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [out, in] in gemv_tiles.c's layout (16 | out, 32 | in), as a tensor of the
    same shape and dtype (its values in the tiles' order: not a weight F.linear can read)."""
    out_features, in_features = weight.shape
    lib = native.library()
    packed = torch.empty_like(weight, memory_format=torch.contiguous_format)
    source = weight.contiguous()
    if lib is None or weight.dtype != torch.bfloat16 or lib.pack_bf16_tiles(
        ctypes.c_void_p(source.data_ptr()), out_features, in_features,
        ctypes.c_void_p(packed.data_ptr()),
    ):  # fmt: skip
        raise ValueError(f"no tiles for a {weight.dtype} weight of {tuple(weight.shape)}")
    return packed


def _gemv(x: torch.Tensor, copy: torch.Tensor, kernel: GemvKernel) -> torch.Tensor | None:
    """x [T, in] @ W.T -> [T, out] in W's dtype (bf16 or float32), W as `copy` holds it for
    `kernel` (`gemv_layout`), or None where the kernel declines."""
    if x.dim() != 2 or x.shape[1] != copy.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of {tuple(copy.shape)}")
    lib = native.library()  # None where the native kernels are off (TOPPINGS_NATIVE=0)
    if lib is None or x.dtype != copy.dtype or x.stride(-1) != 1 or x.shape[0] > kernel.max_rows:
        return None
    y = torch.empty(x.shape[0], copy.shape[0], dtype=copy.dtype)
    failed = getattr(lib, kernel.name)(
        ctypes.c_void_p(x.data_ptr()), x.stride(0), ctypes.c_void_p(copy.data_ptr()),
        copy.shape[0], copy.shape[1], ctypes.c_void_p(y.data_ptr()), y.stride(0), x.shape[0],
        torch.get_num_threads(),
    )  # fmt: skip
    return None if failed else y


def _bound_gemv(copy: torch.Tensor, chosen: GemvKernel) -> Callable[..., int]:
    """`chosen`'s kernel for the weight `copy` (`gemv_layout`), its pointer and shape bound: a
    call (x pointer, x row stride, y pointer, y row stride, rows) -> 0, or nonzero where the
    kernel declined (nothing written). The threads are the calling thread's torch count at each
    call."""
    kernel, weight, (out_features, in_features) = (
        getattr(native.library(), chosen.name),
        copy.data_ptr(),
        copy.shape,
    )
    get_threads = torch.get_num_threads

    def call(x: int, ld_x: int, y: int, ld_y: int, rows: int) -> int:
        return kernel(x, ld_x, weight, out_features, in_features, y, ld_y, rows, get_threads())

    return call


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [T, in] @ W.T through oneDNN, W as `_pack` left it; no bias, no fused activation."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")


@functools.cache
def packing_works(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear exists here and agrees with F.linear for `dtype`."""
    if not torch.backends.mkldnn.is_available():
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=gen).to(dtype)
    x = torch.randn(3, 80, generator=gen).to(dtype)
    try:
        got = _packed_linear(x, _pack(weight))
    except (AttributeError, NotImplementedError, RuntimeError) as exc:
        log.info("oneDNN packed linear unavailable (%s); using F.linear", exc)
        return False
    want = F.linear(x.float(), weight.float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    ok = got.shape == want.shape and torch.allclose(got.float(), want, rtol=tol, atol=tol * 10)
    if not ok:
        log.warning("oneDNN packed linear disagrees with F.linear for %s; not used", dtype)
    return ok
