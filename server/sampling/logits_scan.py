"""A step's logits checked and its greedy tokens found in one pass, before sampling.

Which rows are finite (a row with inf or NaN fails its request alone: model_runner.py) and each
row's argmax (the token of a greedy request). On a CPU one native call (`csrc/logits.c`): the
torch ops it replaces (a max and a min over each row, two finiteness tests, an argmax and their
lists) each run cold after the step's weights have streamed through the caches, and cost several
times what they cost warm (docs/benchmarks.md). Elsewhere, and where the library is not built,
the same from torch.
"""

from __future__ import annotations

import numpy
import torch

from toppings.server import native


def scan_logits(logits: torch.Tensor) -> tuple[list[bool], list[int]]:
    """Whether each row of logits [B, V] float32 is finite, and its argmax (torch's: the first
    of equal maxima; -1 for a row that is not finite)."""
    lib = native.library() if logits.device.type == "cpu" else None
    b, v = logits.shape
    if lib is None or logits.dtype != torch.float32 or logits.stride(1) != 1 or b == 0:
        finite = (logits.amax(dim=1).isfinite() & logits.amin(dim=1).isfinite()).tolist()
        best = logits.argmax(dim=1).tolist()
        return finite, [t if ok else -1 for t, ok in zip(best, finite)]
    # numpy, not torch (see the doc) nor ctypes arrays, whose lists cost three times the scan
    flags, best = numpy.empty(b, dtype=numpy.bool_), numpy.empty(b, dtype=numpy.int64)
    failed = lib.logits_scan(logits.data_ptr(), logits.stride(0), b, v, flags.ctypes.data,
                             best.ctypes.data, torch.get_num_threads())  # fmt: skip
    if failed:
        raise ValueError(f"logits of shape {tuple(logits.shape)} cannot be scanned")
    return flags.tolist(), best.tolist()
