"""The Triton attention over the paged KV (`server/model/paged/`) against the torch paths
(`attention._decode_torch`, one SDPA per prefill segment) and float64 softmax references.

On a CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1 before triton
is imported), small shapes only; the tests marked `cuda` run the compiled kernels, inside a CUDA
graph, and an engine whose decode graphs use them.
"""

from __future__ import annotations

import pytest
import torch

from tests.server.model.test_attention import _segments_in_a_pool, reference_decode
from toppings.server.model import attention, paged

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


def reference_by_request(q, k_cache, v_cache, index, lengths):
    """softmax(q . k / sqrt(D)) @ v over each request's own slots in float64, one request at a
    time on q's device (test_attention's `reference_decode`, batched over heads)."""
    b, n, d = q.shape
    num_kv = k_cache.shape[0]
    out = torch.empty(b, num_kv, n // num_kv, d, dtype=torch.float64, device=q.device)
    for i in range(b):
        slots = index[i, : int(lengths[i])]
        keys, vals = k_cache[:, slots].double(), v_cache[:, slots].double()  # [K, L, D]
        scores = q[i].double().view(num_kv, -1, d) @ keys.transpose(1, 2) / d**0.5  # [K, G, L]
        out[i] = torch.softmax(scores, dim=-1) @ vals
    return out.reshape(b, n * d)


def assert_matches(got, args, dtype, want=None) -> None:
    """got [B, N*D] agrees with the float64 reference (`want`, else computed here) and with
    the torch path."""
    q = args[0]
    assert got.dtype == dtype and got.shape == (q.shape[0], q.shape[1] * q.shape[2])
    assert torch.isfinite(got).all()  # no NaN slot past a length was read
    want = reference_by_request(*args) if want is None else want
    torch.testing.assert_close(got.double(), want, rtol=TOL[dtype], atol=TOL[dtype])
    torch_path = attention._decode_torch(*args)
    torch.testing.assert_close(got, torch_path, rtol=TOL[dtype], atol=TOL[dtype])


LENGTHS = (1, 7, 300, 2, 64, 129, 65)  # odd batch, blocks' edges either side, one long context


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("splits", [1, 3])  # one program per (request, kv head), or merged
def test_decode_matches_the_references(dtype, head_dim, group, splits):
    args = poisoned_pool(dtype, LENGTHS, group=group, d=head_dim)
    got = paged.paged_decode_attention(*args, splits=splits)
    assert_matches(got, args, dtype)


def test_the_batched_reference_is_the_plain_one():
    args = poisoned_pool(torch.float32, LENGTHS, group=3, d=16)
    torch.testing.assert_close(reference_by_request(*args), reference_decode(*args))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_default_splits_and_odd_head_dims(dtype):
    """The split rule's own choice (one request: split), a head dim not a power of two, a batch
    of requests of one position each."""
    args = poisoned_pool(dtype, (290,), num_kv=1, group=5, d=80, seed=1)
    assert paged.num_splits(1, 1, args[3].shape[1]) == 2
    assert_matches(paged.paged_decode_attention(*args), args, dtype)
    args = poisoned_pool(dtype, (1,) * 9, group=2, d=16, seed=2)
    assert_matches(paged.paged_decode_attention(*args, splits=4), args, dtype)


def test_split_rule_follows_the_shapes():
    """Split only when B * K programs would leave the GPU idle, never into chunks shorter than
    MIN_CHUNK, at most MAX_SPLITS."""
    assert paged.num_splits(64, 8, 4096) == 1  # 512 programs already
    assert paged.num_splits(1, 8, 4096) == paged.decode.MAX_SPLITS
    assert paged.num_splits(4, 2, 4096) == 16 and paged.num_splits(8, 4, 4096) == 8
    assert paged.num_splits(1, 1, 100) == 1  # shorter than a chunk
    assert paged.num_splits(1, 1, 3 * paged.decode.MIN_CHUNK) == 3


def test_decode_attention_dispatch_keeps_the_cpu_paths(monkeypatch):
    """A CPU tensor never reaches the Triton kernel: the native C path or the torch one runs."""
    called = []
    monkeypatch.setattr(paged, "paged_decode_attention", lambda *a: called.append(a))
    args = poisoned_pool(torch.float32, (3, 5), group=2, d=16)
    attention.decode_attention(*args)
    assert not called


def reference_prefill(q, k_cache, v_cache, seg_starts, past_slots, slots):
    """Per segment, token and head: softmax over its past and its own keys up to itself, float64."""
    num_tokens, n, d = q.shape
    num_kv = k_cache.shape[0]
    out = torch.empty(num_tokens, num_kv, n // num_kv, d, dtype=torch.float64)
    for i, (start, end) in enumerate(zip(seg_starts[:-1], seg_starts[1:])):
        past = past_slots[i] if past_slots[i] is not None else slots[:0]
        for t in range(start, end):
            seen = torch.cat([past, slots[start : t + 1]])
            keys, vals = k_cache[:, seen].double(), v_cache[:, seen].double()  # [K, L, D]
            scores = q[t].double().view(num_kv, -1, d) @ keys.transpose(1, 2) / d**0.5
            out[t] = torch.softmax(scores, dim=-1) @ vals  # [K, G, D]
    return out.reshape(num_tokens, n * d)


# (new tokens, past): whole prompts, chunks after a past (a tile's and a key block's edges either
# side), and a mixed step's decode rows (one token after a past)
SEGMENTS = [(16, 0), (33, 0), (77, 5), (1, 40), (31, 130), (3, 70), (1, 9), (1, 200), (65, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (3, 128), (4, 64)])
def test_prefill_matches_the_references(dtype, group, head_dim):
    q, key, val, seg_starts, past_slots, k_cache, v_cache, slots = _segments_in_a_pool(
        dtype, group, head_dim, SEGMENTS, seed=head_dim + group
    )
    unused = torch.ones(k_cache.shape[1], dtype=torch.bool)
    unused[slots] = False
    for past in past_slots:
        if past is not None:
            unused[past] = False
    k_cache[:, unused], v_cache[:, unused] = float("nan"), float("nan")  # never read
    wide = torch.cat([q, q[:, :1]], dim=1)[:, : q.shape[1]]  # q as a strided view
    plan = paged.plan_paged(seg_starts, past_slots, slots, group)
    got = paged.paged_prefill_attention(wide, k_cache, v_cache, plan)
    assert got.dtype == dtype and got.shape == (q.shape[0], q.shape[1] * head_dim)
    want = reference_prefill(q, k_cache, v_cache, seg_starts, past_slots, slots)
    torch.testing.assert_close(got.double(), want, rtol=TOL[dtype], atol=TOL[dtype])
    sdpa = attention.prefill_attention(q, key, val, seg_starts, past_slots, k_cache, v_cache)
    torch.testing.assert_close(got, sdpa, rtol=TOL[dtype], atol=TOL[dtype])


def test_prefill_plan_tiles_the_segments():
    """Tiles of BLOCK_R // G tokens per segment; each segment's list its past then its slots."""
    segments = [(50, 0), (1, 3), (22, 4)]
    *_, seg_starts, past_slots, _, _, slots = _segments_in_a_pool(torch.float32, 3, 8, segments)
    plan = paged.plan_paged(seg_starts, past_slots, slots, group=3)
    assert plan.tile_tokens == 21  # 63 of the 64 rows
    assert plan.tiles.tolist() == [
        [0, 50, 0, 0, 0], [0, 50, 0, 0, 21], [0, 50, 0, 0, 42],
        [50, 1, 50, 3, 0],
        [51, 22, 54, 4, 0], [51, 22, 54, 4, 21],
    ]  # fmt: skip
    want = [slots[:50], past_slots[1], slots[50:51], past_slots[2], slots[51:]]
    assert torch.equal(plan.index, torch.cat(want))
    with pytest.raises(ValueError, match="another group"):
        q = torch.zeros(73, 2 * 8, 8)  # a model of G = 8 with a plan for G = 3
        paged.paged_prefill_attention(q, torch.zeros(2, 80, 8), torch.zeros(2, 80, 8), plan)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("batch", "max_len", "group"), [(1, 4096, 4), (5, 700, 1), (48, 1500, 7)])
def test_compiled_decode_matches_the_references(dtype, batch, max_len, group):
    gen = torch.Generator().manual_seed(batch)
    lengths = torch.randint(1, max_len + 1, (batch,), generator=gen)
    lengths[0] = max_len
    args = poisoned_pool(dtype, lengths.tolist(), num_kv=2, group=group, d=128, device="cuda")
    want = reference_by_request(*args)
    for splits in (None, 1, 5):
        got = paged.paged_decode_attention(*args, splits=splits)
        assert_matches(got, args, dtype, want)
    assert_matches(attention.decode_attention(*args), args, dtype, want)  # as the model calls it


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_prefill_matches_sdpa(dtype):
    """A long prompt, a chunk after a long past, decode rows after long pasts, a short chunk:
    the engine's shapes (G = 4, D = 128), against one SDPA per segment."""
    segments = [(1500, 0), (256, 1300), (40, 64)] + [(1, 2000)] * 5
    q, key, val, seg_starts, past_slots, k_cache, v_cache, slots = (
        t.cuda() if isinstance(t, torch.Tensor) else t
        for t in _segments_in_a_pool(dtype, 4, 128, segments, seed=7, num_kv=2)
    )
    past_slots = [p.cuda() if p is not None else None for p in past_slots]
    plan = paged.plan_paged(seg_starts, past_slots, slots, group=4)
    got = paged.paged_prefill_attention(q, k_cache, v_cache, plan)
    sdpa = attention.prefill_attention(q, key, val, seg_starts, past_slots, k_cache, v_cache)
    torch.testing.assert_close(got, sdpa, rtol=TOL[dtype], atol=TOL[dtype])
    through = attention.prefill_attention(
        q, key, val, seg_starts, past_slots, k_cache, v_cache,
        attention.plan_prefill(seg_starts, past_slots, slots, 4),
    )  # fmt: skip
    torch.testing.assert_close(through, got, rtol=0, atol=0)  # the model's call: the kernel


@needs_cuda
def test_compiled_decode_replays_in_a_cuda_graph():
    """Captured once (split: 4 requests of 2 kv heads), replayed over other lengths, slots and
    queries written into the same buffers, as the engine's decode graphs do."""
    q, k_cache, v_cache, index, lengths = poisoned_pool(torch.bfloat16, [600, 3, 200, 1],
                                                        device="cuda")  # fmt: skip
    assert paged.num_splits(4, 2, index.shape[1]) > 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernels outside the capture
        paged.paged_decode_attention(q, k_cache, v_cache, index, lengths)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged.paged_decode_attention(q, k_cache, v_cache, index, lengths)
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
@pytest.mark.parametrize(
    ("min_chunk", "budget"),
    [
        (paged.decode.MIN_CHUNK, 4096),  # every prompt in one step, then the decode graphs
        (32, 4096),  # the decode kernel split inside the graphs
        (paged.decode.MIN_CHUNK, 24),  # chunks after their earlier chunks, mixed steps
    ],
)
def test_engine_on_the_kernels_gives_the_torch_paths_tokens(
    tiny_model_dir, adapters, min_chunk, budget, monkeypatch
):
    """Decode graphs on, the Triton kernels in them and in every prefill or mixed step: the
    tokens of the same engine on the torch path (gather + SDPA), eager."""
    from tests.server.model.test_cuda_graphs import JOBS, assert_same, generate, start

    monkeypatch.setattr(paged.decode, "MIN_CHUNK", min_chunk)
    calls: list[str] = []
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        kernel = getattr(paged, name)
        monkeypatch.setattr(paged, name, lambda *a, k=kernel, n=name: calls.append(n) or k(*a))
    engine_args = dict(max_num_batched_tokens=budget)  # above the batch bound of 16
    with start(tiny_model_dir, adapters, "cuda", True, **engine_args) as engine:
        got = generate(engine, JOBS)
        replays = engine.runner.graphs.counters.replays
    assert set(calls) == {"paged_decode_attention", "paged_prefill_attention"} and replays > 0
    monkeypatch.setattr(attention, "_paged", lambda: None)  # the torch path gathers again
    calls.clear()
    with start(tiny_model_dir, adapters, "cuda", False, **engine_args) as engine:
        want = generate(engine, JOBS)
    assert not calls
    assert_same(tiny_model_dir, adapters, JOBS, got, want)


def test_engine_through_the_interpreted_kernels_gives_the_torch_paths_tokens(
    tiny_model_dir, monkeypatch
):
    """The model's calls routed to the Triton kernels on the CPU (interpreted), as a GPU routes
    them: the plan built once a step for the model's group, q as a view of the qkv projection,
    whole prompts, chunks after their earlier chunks and mixed steps under a small budget.
    Greedy tokens equal the torch path's (float32; the tiny model: G = 2, D = 16)."""
    from tests.helpers import running_engine
    from toppings.server import native
    from toppings.server.model import llama
    from toppings.server.requests.request import GenerationRequest, SamplingParams

    monkeypatch.setattr(native, "library", lambda: None)  # op by op, the torch path
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (5, 23, 9, 40, 2)]

    calls: list[str] = []
    takes: list[bool] = []  # the model's `paged` argument at each call

    def run(paged_attention: bool | None = None) -> list[list[int]]:
        with running_engine(tiny_model_dir, max_batch_size=8, max_num_batched_tokens=16) as e:
            if paged_attention is not None:  # what `--paged-attention` sets on a GPU
                e.model.paged_attention = paged_attention
                calls.clear()  # the start-up forward (step_timing.warm_forward) ran before it
                takes.clear()
            params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
            handles = e.submit_all([GenerationRequest(p, params, None) for p in prompts])
            return [h.result(timeout_s=300).new_token_ids for h in handles]

    want = run()

    def plan(seg_starts, past_slots, slots, group, on, sdpa_from=0):
        calls.append("plan")
        takes.append(on)
        return paged.plan_paged(seg_starts, past_slots, slots, group)

    def prefill(q, key, val, seg_starts, past_slots, k_cache, v_cache, plan):
        calls.append("prefill")
        return paged.paged_prefill_attention(q, k_cache, v_cache, plan)

    def decode(q, k_cache, v_cache, index, lengths, on):
        calls.append("decode")
        takes.append(on)
        return paged.paged_decode_attention(q, k_cache, v_cache, index, lengths)

    monkeypatch.setattr(llama, "plan_prefill", plan)
    monkeypatch.setattr(llama, "prefill_attention", prefill)
    monkeypatch.setattr(llama, "decode_attention", decode)
    got = run(paged_attention=True)
    assert {"plan", "prefill", "decode"} <= set(calls)
    assert got == want
    assert all(takes)
    takes.clear()
    run(paged_attention=False)  # `--paged-attention off`: the model asks for the torch path
    assert takes and not any(takes)


def test_paged_attention_is_on_with_cuda_and_refused_on_a_cpu():
    from toppings.server.config import EngineConfig

    assert EngineConfig(device="cuda").use_paged_attention
    assert not EngineConfig(device="cuda", paged_attention=False).use_paged_attention
    assert not EngineConfig(device="cpu").use_paged_attention
    with pytest.raises(ValueError, match="--paged-attention on needs --device cuda"):
        EngineConfig(device="cpu", paged_attention=True)
