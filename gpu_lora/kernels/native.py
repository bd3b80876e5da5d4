"""MBGMV over runs of one adapter's tokens in one native call: the CPU engine's LoRA (MBGMV).

A CPU decode step has few tokens per adapter, so the torch segment kernel's two small matmuls per
run cost more in dispatch than in arithmetic (16 runs x 3 projections x 30 layers are 1440 pairs a
step). `lora_runs` in `csrc/lora.c` (built and cached by `native_build`) does every run of every
projection that shares an input (q, k and v) in one call, reading each token's own adapter rows
only, in blocks of 4 tokens spread over the threads. It serves prefill too, faster than the torch
kernel at every rank measured (bench_cpu_decode_paths and docs/benchmarks.md, "Measurements behind
the code"), except on a CPU with AMX, where a prompt's long runs go to oneDNN's products instead
(`PRODUCT_MIN_WORK`). Same semantics as `gpu_lora.kernels.reference.mbgmv_prefill`
(tests/gpu_lora/test_native_lora.py checks it against that reference); BGMV keeps the torch kernels,
whose zero-padding is its cost model. Where the library cannot be built (no compiler,
`TOPPINGS_NATIVE=0`), `library()` is None, `available` says False and every function here runs the
torch segment kernel (`gpu_lora.kernels.cpu`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from toppings.gpu_lora.kernels import cpu, native_build
from toppings.gpu_lora.kernels.checks import check_prefill, check_shapes

_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
# csrc/lora_api.h's functions that Python calls (tests/gpu_lora/test_native_abi.py compares)
SIGNATURES = {"lora_runs": [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _P, _I64, _I, _I]}
SOURCES = ("lora.c", "lora_parts.c")  # in csrc/, each including lora_api.h
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_PREPARED = 64  # RunsStep's C structs kept, by (modules, runs skipped)
# A bfloat16 run of T tokens at rank r with T * r at least this runs as two oneDNN products on a
# CPU with AMX: a prompt's LoRA, where the tile unit beats the kernel's blocks of 4 tokens (below
# it the products' fixed cost is the larger; docs/benchmarks.md, "Measurements behind the code").
PRODUCT_MIN_WORK = 8192
# (run, first token, end token, first pool row, rank, scale) of a run on oneDNN's products
ProductRun = tuple[int, int, int, int, int, float]


@functools.cache
def default_product_min_work() -> int:
    """PRODUCT_MIN_WORK where the CPU has AMX (amx_bf16), else 0: never (unmeasured there)."""
    return PRODUCT_MIN_WORK if "amx_bf16" in native_build.cpu_flags() else 0


# (y, lora_a, lora_b, ranks): one projection of a call; y [T, H_out] (rows may be strided),
# lora_a [C, H_in], lora_b [C, H_out] contiguous, ranks [B] int32 (0: the run skips it).
Projection = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class LoraProj(ctypes.Structure):
    """One projection of a `lora_runs` call: the C struct of csrc/lora_api.h, field for field."""

    _fields_ = [
        ("A", ctypes.c_void_p),
        ("Bt", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
        ("ranks", ctypes.c_void_p),
        ("ld_y", ctypes.c_int64),
        ("H_out", ctypes.c_int64),
        ("pool_rows", ctypes.c_int64),
    ]


def _parts_functions(lib: ctypes.CDLL) -> tuple[int, int]:
    """The addresses of lora_parts.c's `lora_shrink_part` and `lora_expand_part`, or (0, 0)
    where this build has no AVX-512 (lora_parts.c then defines neither)."""
    try:
        shrink, expand = lib.lora_shrink_part, lib.lora_expand_part
    except AttributeError:
        return 0, 0
    return ctypes.cast(shrink, ctypes.c_void_p).value, ctypes.cast(expand, ctypes.c_void_p).value


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled `csrc/lora.c`, or None where it cannot be built here (logged once)."""
    return native_build.load(
        "lora_kernels", Path(__file__).with_name("csrc"), SOURCES, ("lora_vec.h",), SIGNATURES,
        fallback="LoRA over runs uses the torch segment kernel",
    )  # fmt: skip


def available(dtype: torch.dtype) -> bool:
    """Whether the native kernel runs pools of `dtype` here (float32/bfloat16, library built)."""
    return dtype in _DTYPES and library() is not None


def mbgmv_runs(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    seg_starts: torch.Tensor, offsets: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
    max_rank: int | None = None,
) -> None:  # fmt: skip
    """y[t] += scales[b] * (x[t] @ A_b.T) @ B_b for the tokens t of each run b, in place.

    Args as `mbgmv_prefill`: y [T, H_out], x [T, H_in] (rows may be strided), lora_a [C, H_in],
    lora_b [C, H_out], one of float32/bfloat16; seg_starts [B + 1], offsets, ranks [B]; scales
    [B] float32; max_rank unused (each token runs at its own rank).
    """
    check_prefill(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales)
    mbgmv_runs_multi(x, [(y, lora_a, lora_b, ranks)], seg_starts, offsets, scales)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def _native_ok(x: torch.Tensor, projections: Sequence[Projection], scales: torch.Tensor) -> bool:
    return (
        x.dtype in _DTYPES
        and x.stride(-1) == 1
        and scales.is_contiguous()
        and all(
            y.stride(-1) == 1 and a.is_contiguous() and b.is_contiguous()
            for y, a, b, _ in projections
        )
    )


def mbgmv_runs_multi(
    x: torch.Tensor, projections: Sequence[Projection], seg_starts: torch.Tensor,
    offsets: torch.Tensor, scales: torch.Tensor,
) -> None:  # fmt: skip
    """`mbgmv_runs` for every projection that reads x, in one native call, in place.

    Semantics: for (y, lora_a, lora_b, ranks) in projections:
        mbgmv_runs(y, x, lora_a, lora_b, seg_starts, offsets, ranks, scales)

    Args: x [T, H_in]; projections as `Projection` (their shapes and dtypes are checked here,
    the runs by the kernel, which refuses any outside y or the pool);
    seg_starts [B + 1], offsets [B] int32/int64; scales [B] float32. Off the native path (no
    compiler, other dtypes or layouts) each projection runs the torch segment kernel.
    """
    for y, a, b, _ in projections:  # what the kernel cannot see: rows of y beyond x's, widths
        check_shapes(y, x, a, b)
    lib = library()
    if lib is None or not _native_ok(x, projections, scales):
        for y, a, b, ranks in projections:
            cpu.mbgmv_prefill(y, x, a, b, seg_starts, offsets, ranks, scales, None)
        return
    starts, offs = _int32(seg_starts), _int32(offsets)
    ranks = [_int32(r) for _, _, _, r in projections]  # kept alive through the call
    procs = (LoraProj * len(projections))(*(
        LoraProj(a.data_ptr(), b.data_ptr(), y.data_ptr(), r.data_ptr(), y.stride(0),
                 y.shape[1], a.shape[0])
        for (y, a, b, _), r in zip(projections, ranks)
    ))  # fmt: skip
    call_runs(x, procs, starts, offs, scales)


def call_runs(
    x: torch.Tensor, procs: ctypes.Array, starts: torch.Tensor, offsets: torch.Tensor,
    scales: torch.Tensor,
) -> None:  # fmt: skip
    """One `lora_runs` call over `LoraProj` structs a caller made and keeps the tables of alive
    (checked by it: shapes, dtypes, contiguous rows; the kernel checks the runs). x [T, H_in]
    on the CPU, float32/bfloat16, rows contiguous; starts [G + 1], offsets [G] int32 and
    scales [G] float32, contiguous. Needs the library (`available`)."""
    failed = library().lora_runs(
        x.data_ptr(), x.stride(0), x.shape[1], x.shape[0], procs, len(procs),
        starts.data_ptr(), offsets.data_ptr(), scales.data_ptr(), offsets.shape[0],
        _DTYPES[x.dtype], torch.get_num_threads(),
    )  # fmt: skip
    _check_status(failed)


def _without(ranks: list[torch.Tensor], skip: tuple[int, ...]) -> list[torch.Tensor]:
    """Copies of the runs' ranks [B] with the runs `skip` at 0 (the tensors themselves: none)."""
    return [r.clone().index_fill_(0, torch.tensor(skip), 0) for r in ranks] if skip else ranks


def _check_status(failed: int) -> None:
    """Raise what a nonzero `lora_runs` status means (out of range: bad runs, nothing written)."""
    if failed == native_build.Status.OUT_OF_RANGE:
        raise ValueError("seg_starts, offsets or ranks point outside y or the pool")
    if failed:
        raise MemoryError("lora_runs could not allocate its buffers")


@dataclass(frozen=True)
class ModuleLayout:
    """One module's tables in a RunsLayout: layer l's A [rows, h_in] at a0 + l * a_step bytes,
    its B [rows, h_out] at b0 + l * b_step, each run's rank at `ranks` (int32 [B])."""

    a0: int
    b0: int
    a_step: int
    b_step: int
    h_in: int
    h_out: int
    rows: int
    ranks: int


@dataclass(frozen=True)
class RunsLayout:
    """A step's runs for a native caller that calls `lora_runs` itself, layer by layer (the CPU
    decode path, server/model/decode_path.py): the function's address, csrc/lora_parts.c's two
    (0 where the build has none: no AVX-512), the addresses of the
    runs' starts [B + 1], offsets [B] (int32) and scales [B] (float32), the tables' dtype and
    layers, per module its `ModuleLayout`, and the runs served from the host (their ranks 0 in
    the tables: gpu_lora.host_runs' HostTable, None: none). Valid while what made it lives."""

    function: int
    shrink_part: int
    expand_part: int
    starts: int
    offsets: int
    scales: int
    num_runs: int
    dtype: torch.dtype
    num_layers: int
    modules: Mapping[str, ModuleLayout]
    host: object | None = None  # gpu_lora.host_runs.HostTable


class RunsStep:
    """`mbgmv_runs_multi` for every layer of one step, its per-step arguments built once.

    The runs, offsets, scales and each projection's ranks are the same in every layer of a step;
    only the layer's rows of the pool, its input and its outputs change. Built once a step by
    `gpu_lora.lora_batch.LoraBatch`, called once a layer and input: a few field writes and the
    native call (the general function re-checks and rebuilds everything, once per layer and input of
    every step). Holds the pool's tables of the step (a table the pool reallocates later stays alive
    until the step ends).
    """

    def __init__(
        self, tables: Mapping[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        seg_starts: torch.Tensor, offsets: torch.Tensor, scales: torch.Tensor,
        product_min_work: int | None = None,
    ) -> None:  # fmt: skip
        """tables: module -> (lora_a [L, C, H_in], lora_b [L, C, H_out], ranks [B] int32);
        seg_starts [B + 1], offsets [B] int32/int64; scales [B] float32; product_min_work: a
        bfloat16 run of T tokens at rank r with T * r at least this runs as two oneDNN products
        (`_add_products`; None: `default_product_min_work()`, 0: never)."""
        self._tables = {m: (a, b, _int32(r)) for m, (a, b, r) in tables.items()}
        self._starts, self._offsets = _int32(seg_starts), _int32(offsets)
        self._scales = scales
        self._num_runs = offsets.shape[0]
        self._threads = torch.get_num_threads()  # the engine thread's team, set before steps
        first = next(iter(self._tables.values()), None)
        self._dtype = None if first is None else first[0].dtype
        self._num_layers = 0 if first is None else first[0].shape[0]
        if product_min_work is None:
            product_min_work = default_product_min_work()
        self._products = self._product_runs(product_min_work)
        self._product_skip = tuple(sorted({g for runs in self._products.values()
                                           for g, *_ in runs}))  # fmt: skip
        self._procs: dict[tuple[tuple[str, ...], tuple[int, ...]], tuple] = {}  # see _prepare
        self._skip_ranks: list[torch.Tensor] = []  # `layout`'s ranks
        self._layout: dict[str, tuple[int, int, int, int, int, int, int]] = {}
        for module, (a, b, r) in self._tables.items():
            fast = (
                a.dim() == 3 and b.dim() == 3 and a.shape[:2] == b.shape[:2]
                and a.dtype == b.dtype == self._dtype and a.dtype in _DTYPES
                and a.is_contiguous() and b.is_contiguous() and r.shape == (self._num_runs,)
                and scales.dtype == torch.float32 and scales.is_contiguous()
            )  # fmt: skip
            if fast:  # module -> A, B pointers of layer 0, bytes per layer, H_in, H_out, rows
                size = a.element_size()
                self._layout[module] = (
                    a.data_ptr(), b.data_ptr(), a.stride(0) * size, b.stride(0) * size,
                    a.shape[2], b.shape[2], a.shape[1],
                )  # fmt: skip

    def __call__(
        self, layer: int, x: torch.Tensor, outputs: Sequence[tuple[str, torch.Tensor]],
        skip: Sequence[int] = (),
    ) -> None:  # fmt: skip
        """y += each run's delta for every (module, y) of outputs, in place; x [T, H_in], y
        [T, H_out] of the tables' dtype; skip: runs left out at this layer (rank 0)."""
        products = self._product_skip if x.dtype == self._dtype else ()
        if not products:
            self._runs(layer, x, outputs, tuple(skip))
            return
        self._runs(layer, x, outputs, tuple(sorted({*skip, *products})))  # all but those
        self._add_products(layer, x, outputs, skip)

    def _runs(
        self, layer: int, x: torch.Tensor, outputs: Sequence[tuple[str, torch.Tensor]],
        skip: tuple[int, ...],
    ) -> None:  # fmt: skip
        """The native call (or the general function) for every run but `skip`."""
        modules = tuple(m for m, _ in outputs)
        key = (modules, skip)
        entry = self._procs.get(key) or self._prepare(*key)
        lib = library()
        fast = (
            entry is not None and lib is not None
            and 0 <= layer < self._num_layers and x.dim() == 2 and x.stride(1) == 1
            and x.dtype == self._dtype
        )  # fmt: skip
        procs, layouts = entry[:2] if fast else ((), ())
        num_tokens, h_in = x.shape if fast else (0, 0)
        for p, (_, y), (a0, b0, a_step, b_step, in_features, out_features) in zip(
            procs, outputs, layouts
        ):
            if (
                y.shape != (num_tokens, out_features) or in_features != h_in
                or y.dtype != self._dtype or y.stride(1) != 1
            ):  # fmt: skip
                fast = False
                break
            p.A, p.Bt = a0 + layer * a_step, b0 + layer * b_step
            p.y, p.ld_y = y.data_ptr(), y.stride(0)
        if not fast:  # anything unusual: the general function, which checks and says what
            self._general(layer, x, outputs, skip)
            return
        failed = lib.lora_runs(
            x.data_ptr(), x.stride(0), h_in, num_tokens, procs, len(modules),
            self._starts.data_ptr(), self._offsets.data_ptr(), self._scales.data_ptr(),
            self._num_runs, _DTYPES[x.dtype], self._threads,
        )  # fmt: skip
        _check_status(failed)

    def layout(self, skip: tuple[int, ...] = ()) -> RunsLayout | None:
        """The step for a native caller (see RunsLayout), the runs `skip` at rank 0 in every
        layer; None where the library is not built or a module's tables have no native layout
        (the caller then calls this object)."""
        lib = library()
        if lib is None or not self._tables or any(m not in self._layout for m in self._tables):
            return None
        if self._product_skip:  # runs the C caller would not know to leave out
            return None
        # the ranks it points into, kept while this object lives
        ranks = self._skip_ranks = _without([r for _, _, r in self._tables.values()], skip)
        modules = {m: ModuleLayout(*self._layout[m], r.data_ptr())
                   for m, r in zip(self._tables, ranks, strict=True)}  # fmt: skip
        function = ctypes.cast(lib.lora_runs, ctypes.c_void_p).value
        return RunsLayout(
            function, *_parts_functions(lib), self._starts.data_ptr(), self._offsets.data_ptr(),
            self._scales.data_ptr(), self._num_runs, self._dtype, self._num_layers, modules,
        )  # fmt: skip

    def _prepare(self, modules: tuple[str, ...], skip: tuple[int, ...]):
        """(the C structs, each one's layout) for this tuple of modules with the runs `skip` at
        rank 0 (a step with an adapter still loading or served on the host: the same few sets
        layer after layer), or None when one of them has no native layout (its tables are not
        contiguous float32/bfloat16)."""
        if not all(m in self._layout for m in modules):
            return None
        if len(self._procs) >= MAX_PREPARED:  # skip sets of loads that moved on
            self._procs.clear()
        procs = (LoraProj * len(modules))()
        # the runs not this call's at 0: still loading, on the host, or products
        ranks = _without([self._tables[m][2] for m in modules], skip)
        for p, m, r in zip(procs, modules, ranks):
            p.ranks, p.H_out, p.pool_rows = r.data_ptr(), *self._layout[m][5:]
        entry = procs, [self._layout[m][:6] for m in modules], ranks  # ranks: kept alive
        self._procs[(modules, skip)] = entry
        return entry

    def _product_runs(self, min_work: int) -> dict[str, list[ProductRun]]:
        """module -> its `ProductRun`s: the bfloat16 runs whose tokens x largest rank over the
        modules reach `min_work` (0: none), each in every module it has rows in."""
        if not min_work or self._dtype != torch.bfloat16:
            return {}
        starts, offsets = self._starts.tolist(), self._offsets.tolist()
        scales = self._scales.tolist()
        ranks = {m: r.tolist() for m, (_, _, r) in self._tables.items()}
        chosen = [
            g
            for g in range(self._num_runs)
            if (starts[g + 1] - starts[g]) * max(r[g] for r in ranks.values()) >= min_work
        ]
        products = {}
        for module, module_ranks in ranks.items():
            runs = [(g, starts[g], starts[g + 1], offsets[g], module_ranks[g], scales[g])
                    for g in chosen if module_ranks[g] > 0]  # fmt: skip
            if runs:
                products[module] = runs
        return products

    def _add_products(self, layer, x, outputs, skip) -> None:
        """The product runs not in `skip`: y[run] += scale * (x[run] @ A^T) @ B^T, the
        shrinkage rounded to bfloat16 as PEFT rounds its A output, the expansion scaled and
        added in oneDNN's float32 and y rounded once."""
        for module, y in outputs:
            a, b, _ = self._tables[module]
            for g, start, end, offset, rank, scale in self._products.get(module, ()):
                if g not in skip:
                    h = x[start:end] @ a[layer, offset : offset + rank].T  # [T, r]
                    y[start:end].addmm_(h, b[layer, offset : offset + rank], alpha=scale)

    def _general(self, layer, x, outputs, skip) -> None:
        projections = []
        for module, y in outputs:
            a, b, ranks = self._tables[module]
            if skip:
                ranks = ranks.clone()
                ranks[list(skip)] = 0  # these runs' rows of this layer are not there yet
            projections.append((y, a[layer], b[layer], ranks))
        mbgmv_runs_multi(x, projections, self._starts, self._offsets, self._scales)
