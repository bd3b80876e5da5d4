"""Decode and prefill attention against a plain float32 softmax reference, native and torch."""

from __future__ import annotations

import pytest
import torch

from toppings.server import native
from toppings.server.model import attention

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def reference_decode(q, k_cache, v_cache, index, lengths):
    """Per request and head: softmax(q . k / sqrt(D)) @ v over its own slots, in float64."""
    b, n, d = q.shape
    group = n // k_cache.shape[0]
    out = torch.empty(b, n, d, dtype=torch.float64)
    for i in range(b):
        slots = index[i, : lengths[i]]
        for h in range(n):
            keys = k_cache[h // group, slots].double()  # [L, D]
            vals = v_cache[h // group, slots].double()
            p = torch.softmax(keys @ q[i, h].double() / d**0.5, dim=0)
            out[i, h] = p @ vals
    return out.reshape(b, n * d)


def random_pool(dtype, num_kv=3, group=3, d=16, lengths=(1, 7, 33, 2, 64)):
    gen = torch.Generator().manual_seed(0)
    slots_total = sum(lengths) + 9
    k_cache = torch.randn(num_kv, slots_total, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_kv, slots_total, d, generator=gen).to(dtype)
    perm = torch.randperm(slots_total - 1, generator=gen) + 1  # slots scattered over the pool
    index = torch.randint(0, slots_total, (len(lengths), max(lengths)), generator=gen)
    start = 0
    for i, n in enumerate(lengths):  # entries past a request's length stay stale garbage
        index[i, :n] = perm[start : start + n]
        start += n
    q = torch.randn(len(lengths), num_kv * group, d, generator=gen).to(dtype)
    return q, k_cache, v_cache, index, torch.tensor(lengths, dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("head_dim", [16, 64])  # 64: the kernel's vectorized path
@pytest.mark.parametrize("group", [3, 5])  # query heads per kv head: passes of 4 heads and less
def test_decode_attention_matches_reference(dtype, path, head_dim, group, monkeypatch):
    if path == "native" and native.library() is None:
        pytest.skip("no C compiler here")
    if path == "torch":
        monkeypatch.setattr(native, "library", lambda: None)
    q, *rest = random_pool(dtype, group=group, d=head_dim)
    wide = torch.cat([q, q[:, :2]], dim=1)  # q as a strided view, as the model passes it
    args = (wide[:, : q.shape[1]], *rest)
    got = attention.decode_attention(*args)
    assert got.dtype == dtype and got.shape == (5, 3 * group * head_dim)
    want = reference_decode(*args)
    torch.testing.assert_close(got.double(), want, rtol=TOL[dtype], atol=TOL[dtype])


def test_native_library_is_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOPPINGS_CACHE_DIR", str(tmp_path))
    native.library.cache_clear()
    try:
        lib = native.library()
        if lib is None:
            pytest.skip("no C compiler here")
        built = list((tmp_path / "native").glob("cpu_kernels-*.so"))
        assert len(built) == 1
        native.library.cache_clear()
        assert native.library() is not None
        assert list((tmp_path / "native").iterdir()) == built  # reused, no second build
    finally:
        native.library.cache_clear()


def test_native_library_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("TOPPINGS_NATIVE", "0")
    native.library.cache_clear()
    try:
        assert native.library() is None
    finally:
        native.library.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_is_causal_per_segment(dtype):
    gen = torch.Generator().manual_seed(1)
    seg_starts = [0, 5, 6, 19]
    q = torch.randn(19, 6, 8, generator=gen).to(dtype)
    key = torch.randn(19, 2, 8, generator=gen).to(dtype)
    val = torch.randn(19, 2, 8, generator=gen).to(dtype)
    got = attention.prefill_attention(q, key, val, seg_starts)
    for start, end in zip(seg_starts[:-1], seg_starts[1:]):
        for t in range(start, end):
            for h in range(6):
                keys, vals = (
                    key[start : t + 1, h // 3].double(),
                    val[start : t + 1, h // 3].double(),
                )
                p = torch.softmax(keys @ q[t, h].double() / 8**0.5, dim=0)
                want = p @ vals
                torch.testing.assert_close(
                    got[t, h * 8 : (h + 1) * 8].double(), want, rtol=TOL[dtype], atol=TOL[dtype]
                )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("group", [3, 5])  # query heads per kv head
def test_native_prefill_rows_match_the_sdpa_path(dtype, head_dim, group, monkeypatch):
    """Short segments (one after a cached prefix) in the rows kernel, the long one in the
    blocked kernel, as SDPA attends them."""
    if native.library() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setattr(attention, "TILE_MIN_LEN", 24)
    monkeypatch.setattr(attention, "TILE_MIN_WORK", 0)
    gen = torch.Generator().manual_seed(2)
    seg_starts = [0, 5, 35, 36, 47]  # 30 tokens: past the native bound
    num_tokens, num_slots = seg_starts[-1], 90
    q = torch.randn(num_tokens, 2 * group, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, 2, head_dim, generator=gen).to(dtype)
    val = torch.randn(num_tokens, 2, head_dim, generator=gen).to(dtype)
    k_cache = torch.randn(2, num_slots, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(2, num_slots, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_slots, generator=gen)
    slots, past = perm[:num_tokens], perm[num_tokens : num_tokens + 7]
    k_cache[:, slots], v_cache[:, slots] = key.transpose(0, 1), val.transpose(0, 1)
    past_slots = [None, None, None, past]  # the last segment follows a 7-token cached prefix
    plan = attention.plan_prefill(seg_starts, past_slots, slots)
    assert plan.tiles.tolist() == [[5, 30, 5, 0]] and plan.has_rows
    args = (q, key, val, seg_starts, past_slots, k_cache, v_cache)
    got = attention.prefill_attention(*args, plan)
    want = attention.prefill_attention(*args)  # every segment through SDPA
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_of_a_mixed_step_are_one_batch_on_the_torch_path(dtype, monkeypatch):
    """Without the native kernel (a GPU) a mixed step's one-token segments after a past go to
    one batched decode call, the chunk and the fresh prompt to SDPA; all as SDPA alone gives."""
    monkeypatch.setattr(native, "library", lambda: None)
    gen = torch.Generator().manual_seed(3)
    # decode rows after 9 and 20 tokens, a chunk of 4 after 5, a decode row after 1, a prompt of 10
    seg_starts = [0, 1, 2, 6, 7, 17]
    num_tokens, num_slots = seg_starts[-1], 80
    q = torch.randn(num_tokens, 6, 16, generator=gen).to(dtype)
    key = torch.randn(num_tokens, 2, 16, generator=gen).to(dtype)
    val = torch.randn(num_tokens, 2, 16, generator=gen).to(dtype)
    k_cache = torch.randn(2, num_slots, 16, generator=gen).to(dtype)
    v_cache = torch.randn(2, num_slots, 16, generator=gen).to(dtype)
    perm = torch.randperm(num_slots, generator=gen)
    slots, past = perm[:num_tokens], perm[num_tokens:]
    k_cache[:, slots], v_cache[:, slots] = key.transpose(0, 1), val.transpose(0, 1)
    past_slots = [past[:9], past[9:29], past[29:34], past[34:35], None]
    plan = attention.plan_prefill(seg_starts, past_slots, slots)
    assert isinstance(plan, attention.DecodeRows)
    assert plan.rows.tolist() == [0, 1, 6] and plan.segments == [2, 4]
    args = (q, key, val, seg_starts, past_slots, k_cache, v_cache)
    got = attention.prefill_attention(*args, plan)
    want = attention.prefill_attention(*args)  # every segment through SDPA
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    # a step with at most one decode row has nothing to batch
    assert attention.plan_prefill([0, 1, 11], [past[:9], None], slots[:11]) is None


def _segments_in_a_pool(dtype, group, head_dim, segments, seed=4, num_kv=2):
    """q, key, val of segments [(t, P)] laid one after another, their keys and values written to
    scattered slots of a pool after pasts of P scattered slots of it."""
    gen = torch.Generator().manual_seed(seed)
    seg_starts = [0]
    for t, _ in segments:
        seg_starts.append(seg_starts[-1] + t)
    num_tokens = seg_starts[-1]
    num_slots = num_tokens + sum(p for _, p in segments) + 5
    q = torch.randn(num_tokens, num_kv * group, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv, head_dim, generator=gen).to(dtype)
    val = torch.randn(num_tokens, num_kv, head_dim, generator=gen).to(dtype)
    k_cache = torch.randn(num_kv, num_slots, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_kv, num_slots, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_slots, generator=gen)
    slots, rest = perm[:num_tokens], perm[num_tokens:]
    k_cache[:, slots], v_cache[:, slots] = key.transpose(0, 1), val.transpose(0, 1)
    past_slots, used = [], 0
    for _, p in segments:
        past_slots.append(rest[used : used + p] if p else None)
        used += p
    return q, key, val, seg_starts, past_slots, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [20, 64, 128])  # 20: not a multiple of 8
@pytest.mark.parametrize("group", [1, 3, 5])  # query heads per kv head
def test_blocked_prefill_matches_sdpa(dtype, head_dim, group, monkeypatch):
    """The blocked kernel over odd segment lengths and pasts (a whole prompt, chunks after a
    past shorter and longer than a key block, a tile's edge either side) as torch's SDPA."""
    if native.library() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setattr(attention, "TILE_MIN_LEN", 16)  # every segment of 16+ tokens blocked
    monkeypatch.setattr(attention, "TILE_MIN_WORK", 0)
    segments = [(16, 0), (33, 0), (77, 5), (31, 130), (40, 64), (3, 70), (129, 211)]
    q, key, val, seg_starts, past_slots, k_cache, v_cache, slots = _segments_in_a_pool(
        dtype, group, head_dim, segments
    )
    plan = attention.plan_prefill(seg_starts, past_slots, slots)
    assert plan.tiles[:, 1].tolist() == [16, 33, 77, 31, 40, 129]  # all but the 3-token chunk
    wide = torch.cat([q, q[:, :1]], dim=1)[:, : q.shape[1]]  # q as a strided view
    args = (key, val, seg_starts, past_slots, k_cache, v_cache)
    got = attention.prefill_attention(wide, *args, plan)
    want = attention.prefill_attention(q, *args)  # every segment through SDPA
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])


def test_segments_go_to_the_blocked_kernel_by_their_work():
    """A short prompt or a short chunk to the rows kernel; a long prompt, or a chunk of 32+
    tokens after a long past, to the blocked one."""
    segments = [(128, 0), (300, 0), (16, 2300), (40, 2300), (1, 900)]
    *_, seg_starts, past_slots, _, _, slots = _segments_in_a_pool(torch.float32, 1, 8, segments)
    plan = attention.plan_prefill(seg_starts, past_slots, slots)
    if native.library() is None:
        pytest.skip("no C compiler here")
    assert plan.tiles[:, :2].tolist() == [[128, 300], [444, 40]] and plan.has_rows


def test_blocked_prefill_of_a_long_prompt_matches_sdpa():
    """A whole prompt of several thousand tokens and a chunk after a long past, SmolLM2's heads
    (9 query heads over 3 kv heads, D = 64): the shapes the engine runs."""
    if native.library() is None:
        pytest.skip("no C compiler here")
    for segments in ([(1500, 0)], [(256, 1300)]):
        q, key, val, seg_starts, past_slots, k_cache, v_cache, slots = _segments_in_a_pool(
            torch.float32, 3, 64, segments, seed=5, num_kv=3
        )
        plan = attention.plan_prefill(seg_starts, past_slots, slots)
        args = (q, key, val, seg_starts, past_slots, k_cache, v_cache)
        got = attention.prefill_attention(*args, plan)
        want = attention.prefill_attention(*args)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_segments_go_to_sdpa_beside_the_native_kernels(dtype):
    """With `sdpa_from`, the segments of that many new tokens or more (a whole prompt, a chunk
    after a past) are attended by SDPA, the others natively in the same step, as SDPA attends
    them all."""
    if native.library() is None:
        pytest.skip("no C compiler here")
    segments = [(3, 0), (70, 0), (40, 600), (64, 30), (1, 50)]
    q, key, val, seg_starts, past_slots, k_cache, v_cache, slots = _segments_in_a_pool(
        dtype, 3, 64, segments, seed=3, num_kv=3
    )
    plan = attention.plan_prefill(seg_starts, past_slots, slots, sdpa_from=64)
    assert plan.sdpa == [1, 3] and plan.tiles[:, 1].tolist() == [40] and plan.has_rows
    args = (q, key, val, seg_starts, past_slots, k_cache, v_cache)
    got = attention.prefill_attention(*args, plan)
    want = attention.prefill_attention(*args)  # every segment through SDPA
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    only = attention.plan_prefill(seg_starts[:2], past_slots[:1], slots[:3], sdpa_from=1)
    assert only.sdpa == [0] and not only.has_rows and only.tiles.numel() == 0


def test_sdpa_attends_long_bfloat16_segments_only_on_a_cpu_with_amx(monkeypatch):
    """SDPA_MIN_LEN for bfloat16 on a CPU whose flags have amx_bf16; never in float32, without
    AMX, or off the CPU."""
    flags = {"avx512f", "avx512_bf16"}
    monkeypatch.setattr(attention.native_build, "cpu_flags", lambda: flags)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert attention.sdpa_min_len(bf16, cpu) == 0
    flags.add("amx_bf16")
    assert attention.sdpa_min_len(bf16, cpu) == attention.SDPA_MIN_LEN > 0
    assert attention.sdpa_min_len(torch.float32, cpu) == 0
    assert attention.sdpa_min_len(bf16, torch.device("cuda")) == 0
