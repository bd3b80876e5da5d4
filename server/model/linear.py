"""The base model's projections: `F.linear`, or oneDNN with a pre-packed weight on a CPU.

On a CPU, torch's float32 `F.linear` calls MKL's sgemm, which streams the weight far below
memory bandwidth at the few rows of a decode step, where oneDNN with a weight reordered once into
its blocked layout runs several times faster, in float32 and bfloat16 (bench_cpu_linear,
`cpu_linear.json`; docs/benchmarks.md, "Measurements behind the code"). The packed path uses torch's
own mkldnn ops, the ones its compiler uses to pre-pack CPU weights. They are private, so
`packing_works` checks them once per dtype against `F.linear` and every weight stays on `F.linear`
when they are missing or disagree. On a GPU nothing is packed.

At 1-4 rows (decode of a few requests) a bf16 projection only streams its weight, which
oneDNN's packed GEMM does well below the memory's bandwidth: there `gemv_bf16` (`csrc/linear.c`,
faster at it: bench_single_stream) reads a plain copy of the weight instead, where the CPU has
avx512_bf16; float32 likewise has `gemv_f32` where the CPU has AVX-512; a CPU with AVX2 + FMA
only (AMD EPYC before Zen 4) gets float32 GEMVs of either dtype (`csrc/gemv_int8.c`). The plain copy
doubles the weights' memory (a tied lm_head shares the embedding's), which is why
`LlamaModel(plain_gemv=...)` decides it once for the whole model (by default: only where the
copy takes at most a quarter of the host memory available, `plain_copy_affordable`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

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
        """pack: a CPU weight goes through oneDNN, packed once; plain_gemv: also keep the plain
        weight for the native GEMV at up to GEMV_MAX_ROWS rows (where it can run); bias: added
        to every row after the product, on every path (as nn.Linear's addmm adds it)."""
        self.out_features, self.in_features = weight.shape
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias {tuple(bias.shape)} does not fit a weight of {weight.shape}")
        self.bias = bias
        self.is_packed = pack and weight.device.type == "cpu" and packing_works(weight.dtype)
        # Only the packed copy is kept here (a tied lm_head's embedding stays, for the lookup).
        self._weight = _pack(weight) if self.is_packed else weight
        # the plain copy in 2 MiB pages (huge_pages.py); unpacked, the products read it too
        self._plain = place(weight.contiguous()) if plain_gemv and gemv_fits(weight) else None
        if not self.is_packed and self._plain is not None:
            self._weight = self._plain
        # The GEMV's kernel and weight bound once: a decode step makes ~120 of these calls, and
        # looking both up per call was a visible share of the step's host time (probe_step_glue).
        self._gemv = _bound_gemv(self._plain) if self._plain is not None else None

    @property
    def gemv_weight(self) -> torch.Tensor | None:
        """The plain weight [out, in] the native GEMV reads (decode of up to GEMV_MAX_ROWS rows),
        contiguous; None where this projection has no native GEMV."""
        return self._plain if self._gemv is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x)
        if self.bias is not None:
            y += self.bias
        return y

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T, [T, out], a fresh tensor."""
        rows = x.shape[0]
        if self._gemv is not None and rows <= GEMV_MAX_ROWS and x.dtype == self._plain.dtype:
            if x.dim() != 2 or x.shape[1] != self.in_features:
                raise ValueError(f"x {tuple(x.shape)} does not fit a weight of "
                                 f"{tuple(self._plain.shape)}")  # fmt: skip
            if x.stride(-1) == 1:
                y = torch.empty(rows, self.out_features, dtype=x.dtype)
                if not self._gemv(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), rows):
                    return y
        if self.is_packed:
            return _packed_linear(x, self._weight)
        return F.linear(x, self._weight)


GEMV_MAX_ROWS = 4  # csrc/linear.c's bound: one pass over the weight for every row
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


# The GEMVs of each dtype, best first, and what `in` must be a multiple of: bf16 with
# avx512_bf16, float32 with AVX-512 (csrc/linear.c; at one row it streams float32 weights faster
# than oneDNN's packed GEMM, bench/bench_single_stream.py); else either with
# AVX2 + FMA in float32 (csrc/gemv_int8.c), for CPUs without AVX-512. `gemv_kernel` picks the
# first that was built here and agrees with F.linear.
_GEMV = {
    torch.bfloat16: (("gemv_bf16", 32), ("gemv_bf16_avx2", 16)),
    torch.float32: (("gemv_f32", 16), ("gemv_f32_avx2", 16)),
}


def gemv_fits(weight: torch.Tensor) -> bool:
    """Whether a native GEMV can run this weight here (bf16 or float32 on a CPU, 16 | out, and
    `in` a multiple of what the dtype's kernel here needs: 32 for avx512_bf16, else 16)."""
    out_features, in_features = weight.shape
    if weight.device.type != "cpu" or out_features % 16:
        return False
    kernel = gemv_kernel(weight.dtype)
    return kernel is not None and in_features % kernel[1] == 0


def gemv_works(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a GEMV of `dtype` was built here and agrees with F.linear (`gemv_kernel`)."""
    return gemv_kernel(dtype) is not None


@functools.cache
def gemv_kernel(dtype: torch.dtype) -> tuple[str, int] | None:
    """The first of `_GEMV[dtype]` built here that agrees with F.linear: (its name, what `in`
    must be a multiple of), or None (no native library, or no kernel of this dtype runs)."""
    if native.library() is None or dtype not in _GEMV:
        return None
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 64, generator=gen).to(dtype)
    x = torch.randn(3, 64, generator=gen).to(dtype)
    want = F.linear(x.float(), weight.float())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for name, multiple in _GEMV[dtype]:
        got = _gemv(x, weight, name)
        if got is not None and torch.allclose(got.float(), want, rtol=tol, atol=tol):
            return name, multiple
    return None


def _gemv(x: torch.Tensor, plain: torch.Tensor, kernel: str | None = None) -> torch.Tensor | None:
    """x [T, in] @ plain.T -> [T, out] in plain's dtype (bf16 or float32), or None where the
    kernel declines; kernel: a name of `_GEMV[plain.dtype]`, by default `gemv_kernel`'s."""
    if x.dim() != 2 or x.shape[1] != plain.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of {tuple(plain.shape)}")
    lib = native.library()  # None where the native kernels are off (TOPPINGS_NATIVE=0)
    if lib is None or x.dtype != plain.dtype or plain.dtype not in _GEMV or x.stride(-1) != 1:
        return None
    if kernel is None:
        chosen = gemv_kernel(plain.dtype)
        if chosen is None:
            return None
        kernel = chosen[0]
    y = torch.empty(x.shape[0], plain.shape[0], dtype=plain.dtype)
    failed = getattr(lib, kernel)(
        ctypes.c_void_p(x.data_ptr()), x.stride(0), ctypes.c_void_p(plain.data_ptr()),
        plain.shape[0], plain.shape[1], ctypes.c_void_p(y.data_ptr()), y.stride(0), x.shape[0],
        torch.get_num_threads(),
    )  # fmt: skip
    return None if failed else y


def _bound_gemv(plain: torch.Tensor) -> Callable[[int, int, int, int, int], int] | None:
    """`gemv_kernel`'s kernel for this plain weight, its pointer and shape bound: a call
    (x pointer, x row stride, y pointer, y row stride, rows) -> 0, or nonzero where the kernel
    declined (nothing written); None where no kernel runs here. The threads are the calling
    thread's torch count at each call."""
    lib, chosen = native.library(), gemv_kernel(plain.dtype)
    if lib is None or chosen is None:
        return None
    kernel, weight, (out_features, in_features) = (
        getattr(lib, chosen[0]),
        plain.data_ptr(),
        plain.shape,
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
