"""token_logprobs against float64 log-softmax: the native pass (as built here, as an AVX2-only
CPU and a CPU without AVX build it) and the torch path give each row's value, rank and top-k
over odd vocabularies, ties, strided rows, every k, and rows longer than a chunk."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch

from toppings.gpu_lora.kernels import native_build
from toppings.gpu_lora.kernels.native_build import cpu_flags
from toppings.server import native
from toppings.server.sampling import logits as logits_module
from toppings.server.sampling.logits import token_logprobs

TOL = 1e-5


def build_with(tmp_path, flags: list[str]) -> ctypes.CDLL:
    """logits.c built as the library is, plus `flags` (an older ISA)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    out = tmp_path / "logits.so"
    subprocess.run(
        [compiler, *native_build.FLAGS, *flags, f"-I{native_build.INCLUDE_DIR}",
         str(native.CSRC / "logits.c"), "-o", str(out), "-lm"],
        check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lib = ctypes.CDLL(str(out))
    fn = lib.logits_logprobs
    fn.restype, fn.argtypes = ctypes.c_int, native.SIGNATURES["logits_logprobs"]
    return lib


@pytest.fixture(params=["native", "avx2", "plain", "torch"])
def path(request, monkeypatch, tmp_path):
    """Which implementation token_logprobs takes (the module's `native_library` replaced)."""
    if request.param == "native":
        lib = native.library()
        if lib is None:
            pytest.skip("the native library is not built here")
    elif request.param == "avx2":
        if not {"avx2", "fma"} <= cpu_flags():
            pytest.skip("this CPU cannot run the AVX2 build")
        lib = build_with(tmp_path, ["-mno-avx512f"])
    elif request.param == "plain":
        lib = build_with(tmp_path, ["-mno-avx512f", "-mno-avx2", "-mno-fma"])
    else:
        lib = None
    monkeypatch.setattr(logits_module, "native_library", lambda: lib)
    return request.param


def check(logits: torch.Tensor, ids: list[int], k: int) -> None:
    """token_logprobs(logits, ids, k) against float64: value, rank (ties within TOL), top ids
    whose values are the k largest (within TOL), in descending order."""
    got = token_logprobs(logits, ids, k)
    want = torch.log_softmax(logits.double(), dim=-1)
    assert [g.token_id for g in got] == ids
    for row, (g, t) in enumerate(zip(got, ids)):
        value = float(want[row, t])
        assert abs(g.logprob - value) < TOL, (row, g.logprob, value)
        above = int((want[row] > value + TOL).sum()), int((want[row] > value - TOL).sum())
        assert above[0] + 1 <= g.rank <= above[1] + 1, (row, g.rank, above)
        assert len(g.top) == k
        top_ids = [i for i, _ in g.top]
        assert len(set(top_ids)) == k
        values = torch.tensor([v for _, v in g.top], dtype=torch.float64)
        assert torch.allclose(values, want[row, top_ids], atol=TOL)
        assert all(values[:-1] >= values[1:] - TOL)
        if k:
            kth = torch.topk(want[row], k).values[-1]
            assert float(values[-1]) >= float(kth) - TOL


@pytest.mark.parametrize("vocab", [1, 7, 16, 33, 49152, 50257])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_values_ranks_and_tops_match_float64(path, vocab, k):
    k = min(k, vocab)
    gen = torch.Generator().manual_seed(vocab * 31 + k)
    logits = torch.randn(6, vocab, generator=gen) * 4
    ids = torch.randint(0, vocab, (6,), generator=gen).tolist()
    ids[0] = int(logits[0].argmax())  # rank 1
    ids[1] = int(logits[1].argmin())  # rank near V
    check(logits, ids, k)


def test_equal_logits_rank_and_order_by_id(path):
    """Ties: a rank counts only the logits above; the native pass orders equal ones by id
    (torch's topk orders them as it likes: only which ones)."""
    logits = torch.zeros(3, 100)
    logits[0, [5, 40, 90]] = 2.0  # three equal maxima
    logits[1, 17] = 1.0
    logits[2] = torch.arange(100.0) % 10  # ten of each value
    got = token_logprobs(logits, [40, 3, 99], 4)
    assert [g.rank for g in got] == [1, 2, 1]
    tops = [[i for i, _ in g.top] for g in got]
    assert set(tops[0][:3]) == {5, 40, 90} and tops[1][0] == 17
    assert all(i % 10 == 9 for i in tops[2])
    if path != "torch":
        assert tops == [[5, 40, 90, 0], [17, 0, 1, 2], [9, 19, 29, 39]]


def test_a_maximum_in_every_lane_and_the_tail(path):
    """The top entry at each position a vector's lanes and the tail cover."""
    for at in (0, 4, 15, 16, 31, 48, 49151, 49155):
        logits = torch.zeros(1, 49156)
        logits[0, at] = 3.0
        got = token_logprobs(logits, [at], 2)[0]
        assert got.rank == 1 and got.top[0][0] == at
        assert got.top[1][0] == (1 if at == 0 else 0)  # then the first of the zeros


def test_strided_rows_and_more_rows_than_a_chunk(path):
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(logits_module.LOGPROB_CHUNK_ROWS + 9, 300, generator=gen) * 3
    logits = wide[:, :250]  # row stride 300
    ids = torch.randint(0, 250, (logits.shape[0],), generator=gen).tolist()
    check(logits, ids, 3)


def test_a_row_with_nan_still_gives_every_field(path):
    """A NaN logit makes its row's values meaningless (the model runner fails such a request),
    but nothing is left unwritten: k top ids, each a token of the vocabulary."""
    logits = torch.randn(2, 40)
    logits[0, 7] = float("nan")
    got = token_logprobs(logits, [7, 1], 5)
    assert all(len(g.top) == 5 and all(0 <= i < 40 for i, _ in g.top) for g in got)
    check(logits[1:], [1], 5)
