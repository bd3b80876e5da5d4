"""Copies and fills that stay on the calling thread.

torch runs an op over more than GRAIN_SIZE elements as an OpenMP parallel region; its helper threads
then spin on the very cores the CPU LoRA workers need while the caller waits for them (a small copy_
then takes orders of magnitude longer: docs/benchmarks.md, "Measurements behind the code"). The
pool's own copies therefore go through numpy, or through torch in chunks below the grain size when a
dtype conversion is needed.
"""

from __future__ import annotations

import numpy as np
import torch

GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: smaller ops run serially
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> np.ndarray:
    """A numpy view of the raw bits of a CPU tensor (bfloat16 included)."""
    return t.detach().view(_BITS[t.element_size()]).numpy()


def copy_serial(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) on the calling thread, in place; both [N] or both [T, H], same shape."""
    if dst.dtype == src.dtype:
        np.copyto(_bits(dst), _bits(src))
        return
    step = GRAIN_SIZE if src.dim() == 1 else max(1, GRAIN_SIZE // max(1, src.shape[-1]))
    for start in range(0, src.shape[0], step):
        dst[start : start + step].copy_(src[start : start + step])


def zeros_serial(num_rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(num_rows, width, dtype=dtype), filled on the calling thread."""
    out = torch.empty(num_rows, width, dtype=dtype)
    _bits(out).fill(0)
    return out
