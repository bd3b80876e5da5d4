"""scan_logits against torch: finite rows and argmax (the first of equal maxima), native and
torch paths, over odd vocabularies, ties, infinities and NaN."""

from __future__ import annotations

import pytest
import torch

from toppings.server import native
from toppings.server.sampling import logits_scan
from toppings.server.sampling.logits_scan import scan_logits


def expected(logits: torch.Tensor) -> tuple[list[bool], list[int]]:
    finite = torch.isfinite(logits).all(dim=1).tolist()
    best = logits.argmax(dim=1).tolist()
    return finite, [t if ok else -1 for t, ok in zip(best, finite)]


def rows(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, vocab, generator=g) * 4
    x[:, vocab // 3] = x.max() + 1  # a tie: the first of two equal maxima wins
    x[:, vocab - 1] = x.max()
    if num_rows > 4:
        x[1, vocab // 2] = float("inf")
        x[2, 0] = float("nan")
        x[3, vocab - 1] = float("-inf")  # not finite either
        x[4] = float("-inf")
    return x


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    if request.param == "native" and native.library() is None:
        pytest.skip("the native library is not built here")
    if request.param == "torch":
        monkeypatch.setattr(logits_scan.native, "library", lambda: None)
    return request.param


@pytest.mark.parametrize("vocab", [1, 7, 16, 33, 49152, 50257])
@pytest.mark.parametrize("num_rows", [1, 6, 70])
def test_scan_matches_torch(path, vocab, num_rows):
    x = rows(num_rows, vocab, vocab * 100 + num_rows)
    assert scan_logits(x) == expected(x)


def test_scan_reads_rows_of_a_strided_tensor(path):
    wide = rows(6, 200, 1)
    x = wide[:, :150]  # row stride 200
    assert scan_logits(x) == expected(x)


def test_max_in_the_last_lanes_and_the_tail(path):
    for at in (0, 15, 16, 31, 48, 49151, 49155):
        x = torch.zeros(2, 49156)
        x[0, at] = 1.0
        x[1, at] = -1.0  # every other entry 0: the first zero wins
        assert scan_logits(x) == ([True, True], [at, 0 if at else 1])
