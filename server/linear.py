"""The base model's projections: `F.linear`, or oneDNN with a pre-packed weight on a CPU.

On a CPU, torch's float32 `F.linear` calls MKL's sgemm, which streams the weight far below
memory bandwidth at the few rows of a decode step (measured on this project's 2-core AMD VM,
2 threads: SmolLM2's lm_head [49152, 576] float32 at 4 rows, 23.1 ms with `F.linear` against
5.5 ms with oneDNN and a weight reordered once into its blocked layout; gate+up [3072, 576]
0.66 ms against 0.14 ms; bfloat16 gains 1.1-3x too). The packed path uses torch's own mkldnn
ops, the ones its compiler uses to pre-pack CPU weights. They are private, so `packing_works`
checks them once per dtype against `F.linear` and every weight stays on `F.linear` when they
are missing or disagree. On a GPU nothing is packed.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


class Linear:
    """y = x @ W.T for a fixed weight W [out, in]; x [T, in] -> y [T, out] in W's dtype."""

    def __init__(self, weight: torch.Tensor, pack: bool = True) -> None:
        self.out_features, self.in_features = weight.shape
        self.is_packed = pack and weight.device.type == "cpu" and packing_works(weight.dtype)
        # Only the packed copy is kept here (a tied lm_head's embedding stays, for the lookup).
        self._weight = _pack(weight) if self.is_packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_packed:
            return _packed_linear(x, self._weight)
        return F.linear(x, self._weight)


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
