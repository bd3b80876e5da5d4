"""The Triton decode attention over the paged KV (`paged_attention.py`) against the torch path
(`attention._decode_torch`) and a float64 softmax reference.

On a CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1 before triton
is imported), small shapes only; the tests marked `cuda` run the compiled kernels, inside a CUDA
graph, and an engine whose decode graphs use them.
"""

from __future__ import annotations

import pytest
import torch

from tests.server.model.test_attention import reference_decode
from toppings.server.model import attention, paged_attention

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def needs_cuda(test):
    """Marked `cuda`, skipped without a CUDA device (bench/gpu_checks.sh runs them)."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.cuda(skip(test))


def poisoned_pool(dtype, lengths, num_kv=2, group=3, d=64, seed=0, device="cpu"):
    """q [B, N, D] (a strided view, as the model passes it), a pool whose last slot holds NaN
    keys and values, every request's slots scattered over the rest, and index entries past a
    request's length pointing at that slot: a kernel that reads past a length returns NaN.
    (The torch path reads slot 0 for them instead, and zeroes their weight.)"""
    gen = torch.Generator().manual_seed(seed)
    num_slots = sum(lengths) + 7
    k_cache = torch.randn(num_kv, num_slots, d, generator=gen)
    v_cache = torch.randn(num_kv, num_slots, d, generator=gen)
    k_cache[:, -1], v_cache[:, -1] = float("nan"), float("nan")
    perm = torch.randperm(num_slots - 1, generator=gen)
    index = torch.full((len(lengths), max(lengths) + 5), num_slots - 1)  # padded width
    start = 0
    for i, n in enumerate(lengths):
        index[i, :n] = perm[start : start + n]
        start += n
    n_heads = num_kv * group
    wide = torch.randn(len(lengths), n_heads + 2, d, generator=gen)
    q = wide.to(dtype).to(device)[:, :n_heads]
    tensors = (k_cache.to(dtype), v_cache.to(dtype), index, torch.tensor(lengths))
    return (q, *(t.to(device) for t in tensors))


def assert_matches(got, args, dtype) -> None:
    """got [B, N*D] agrees with the float64 reference and with the torch path."""
    q = args[0]
    assert got.dtype == dtype and got.shape == (q.shape[0], q.shape[1] * q.shape[2])
    assert torch.isfinite(got).all()  # no NaN slot past a length was read
    want = reference_decode(*(t.cpu() for t in args))
    torch.testing.assert_close(got.cpu().double(), want, rtol=TOL[dtype], atol=TOL[dtype])
    torch_path = attention._decode_torch(*args)
    torch.testing.assert_close(got, torch_path, rtol=TOL[dtype], atol=TOL[dtype])


LENGTHS = (1, 7, 300, 2, 64, 129, 65)  # odd batch, blocks' edges either side, one long context


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("splits", [1, 3])  # one program per (request, kv head), or merged
def test_decode_matches_the_references(dtype, head_dim, group, splits):
    args = poisoned_pool(dtype, LENGTHS, group=group, d=head_dim)
    got = paged_attention.paged_decode_attention(*args, splits=splits)
    assert_matches(got, args, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_default_splits_and_odd_head_dims(dtype):
    """The split rule's own choice (one request: split), a head dim not a power of two, a batch
    of requests of one position each."""
    args = poisoned_pool(dtype, (290,), num_kv=1, group=5, d=80, seed=1)
    assert paged_attention.num_splits(1, 1, args[3].shape[1]) == 2
    assert_matches(paged_attention.paged_decode_attention(*args), args, dtype)
    args = poisoned_pool(dtype, (1,) * 9, group=2, d=16, seed=2)
    assert_matches(paged_attention.paged_decode_attention(*args, splits=4), args, dtype)


def test_split_rule_follows_the_shapes():
    """Split only when B * K programs would leave the GPU idle, never into chunks shorter than
    MIN_CHUNK, at most MAX_SPLITS."""
    assert paged_attention.num_splits(64, 8, 4096) == 1  # 512 programs already
    assert paged_attention.num_splits(1, 8, 4096) == paged_attention.MAX_SPLITS
    assert (
        paged_attention.num_splits(4, 2, 4096) == 16 and paged_attention.num_splits(8, 4, 4096) == 8
    )
    assert paged_attention.num_splits(1, 1, 100) == 1  # shorter than a chunk
    assert paged_attention.num_splits(1, 1, 3 * paged_attention.MIN_CHUNK) == 3


def test_decode_attention_dispatch_keeps_the_cpu_paths(monkeypatch):
    """A CPU tensor never reaches the Triton kernel: the native C path or the torch one runs."""
    called = []
    monkeypatch.setattr(paged_attention, "paged_decode_attention", lambda *a: called.append(a))
    args = poisoned_pool(torch.float32, (3, 5), group=2, d=16)
    attention.decode_attention(*args)
    assert not called


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("batch", "max_len"), [(1, 4096), (5, 700), (48, 1500)])
@pytest.mark.parametrize("group", [1, 4, 7])
def test_compiled_decode_matches_the_references(dtype, batch, max_len, group):
    gen = torch.Generator().manual_seed(batch)
    lengths = torch.randint(1, max_len + 1, (batch,), generator=gen)
    lengths[0] = max_len
    args = poisoned_pool(dtype, lengths.tolist(), num_kv=2, group=group, d=128, device="cuda")
    for splits in (None, 1, 5):
        got = paged_attention.paged_decode_attention(*args, splits=splits)
        assert_matches(got, args, dtype)
    assert_matches(attention.decode_attention(*args), args, dtype)  # as the model calls it


@needs_cuda
def test_compiled_decode_replays_in_a_cuda_graph():
    """Captured once (split: 4 requests of 2 kv heads), replayed over other lengths, slots and
    queries written into the same buffers, as the engine's decode graphs do."""
    q, k_cache, v_cache, index, lengths = poisoned_pool(torch.bfloat16, [600, 3, 200, 1],
                                                        device="cuda")  # fmt: skip
    assert paged_attention.num_splits(4, 2, index.shape[1]) > 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernels outside the capture
        paged_attention.paged_decode_attention(q, k_cache, v_cache, index, lengths)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention.paged_decode_attention(q, k_cache, v_cache, index, lengths)
    for step in range(3):
        index.copy_(index.roll(step + 1, 0))
        lengths.copy_(lengths.roll(step + 1, 0))
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(step)).to(q))
        graph.replay()
        assert_matches(out.clone(), (q, k_cache, v_cache, index, lengths), torch.bfloat16)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    from tests.server.engine.test_exactness import make_adapters

    return make_adapters(tmp_path_factory.mktemp("paged_adapters"), tiny_model_dir)


@needs_cuda
@pytest.mark.parametrize("min_chunk", [paged_attention.MIN_CHUNK, 32])  # 32: split in the graphs
def test_engine_with_the_kernel_in_decode_graphs_gives_the_torch_paths_tokens(
    tiny_model_dir, adapters, min_chunk, monkeypatch
):
    from tests.server.model.test_cuda_graphs import JOBS, assert_same, generate, start

    monkeypatch.setattr(paged_attention, "MIN_CHUNK", min_chunk)
    kernel, calls = paged_attention.paged_decode_attention, []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(paged_attention, "paged_decode_attention", counted)
    with start(tiny_model_dir, adapters, "cuda", True, max_num_batched_tokens=4096) as engine:
        got = generate(engine, JOBS)
        replays = engine.runner.graphs.counters["replays"]
    assert calls and replays > 0  # the kernel was captured, and its graphs replayed
    monkeypatch.setattr(attention, "_paged", lambda: None)  # the torch path gathers again
    calls.clear()
    with start(tiny_model_dir, adapters, "cuda", False, max_num_batched_tokens=4096) as engine:
        want = generate(engine, JOBS)
    assert not calls
    assert_same(tiny_model_dir, adapters, JOBS, got, want)
