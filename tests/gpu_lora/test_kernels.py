"""LoRA kernel backends against the float32 reference (Triton runs in interpret mode on CPU).

Every pool built here has NaN in the rows between adapters and past the pool's end (inside the
same allocation), adapters at non-zero, unaligned offsets, and its last adapter flush with the
pool's end, so a kernel that reads a row it does not own, or lets BGMV's padding touch memory,
produces NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from toppings.gpu_lora.kernels import cpu, get_kernels, native, reference, select

POOL_RANKS = (16, 64, 8, 32, 64, 16, 32, 8)  # mixed ranks in one pool; the last is the smallest
GAP = 3  # NaN rows before each adapter
H_IN, H_OUT = 96, 80
TOL = {  # (atol, rtol) against the reference run on the same dtype
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (3e-2, 2e-2),
    torch.float16: (4e-3, 4e-3),
}
BACKENDS = ("triton", "cpu")
MIXES = ("distinct", "uniform", "zipf", "identical", "skewed")
KERNELS = ("bgmv", "mbgmv")


@dataclass
class Pool:
    lora_a: torch.Tensor  # [C, H_in]
    lora_b: torch.Tensor  # [C, H_out]
    offsets: list[int]
    ranks: list[int]


def make_pool(dtype=torch.float32, h_in=H_IN, h_out=H_OUT, ranks=POOL_RANKS, seed=0) -> Pool:
    gen = torch.Generator().manual_seed(seed)
    num_rows = sum(ranks) + GAP * len(ranks)
    # 64 NaN rows past the pool inside the same storage catch unmasked BGMV padding reads.
    store_a = torch.full((num_rows + 64, h_in), math.nan)
    store_b = torch.full((num_rows + 64, h_out), math.nan)
    offsets, pos = [], 0
    for r in ranks:
        pos += GAP
        offsets.append(pos)
        store_a[pos : pos + r] = torch.randn(r, h_in, generator=gen) / math.sqrt(h_in)
        store_b[pos : pos + r] = torch.randn(r, h_out, generator=gen) / math.sqrt(r)
        pos += r
    return Pool(store_a.to(dtype)[:num_rows], store_b.to(dtype)[:num_rows], offsets, list(ranks))


def pick_adapters(mix: str, num: int, num_adapters: int, gen: torch.Generator) -> list[int]:
    """Adapter index of each of num requests under a named popularity mix."""
    if mix == "distinct":
        perm = torch.randperm(num_adapters, generator=gen).tolist()
        return [perm[i % num_adapters] for i in range(num)]
    if mix == "uniform":
        return torch.randint(num_adapters, (num,), generator=gen).tolist()
    if mix == "zipf":
        weights = 1.0 / torch.arange(1, num_adapters + 1, dtype=torch.float64) ** 1.5
        return torch.multinomial(weights, num, replacement=True, generator=gen).tolist()
    if mix == "identical":
        return [1] * num  # everyone on one rank-64 adapter
    if mix == "skewed":
        rest = torch.randint(num_adapters, (num,), generator=gen)
        hot = torch.rand(num, generator=gen) < 0.8
        return torch.where(hot, 2, rest).tolist()
    raise ValueError(mix)


def batch_meta(pool: Pool, adapters: list[int | None], gen, index_dtype=torch.int32):
    """offsets, ranks, scales of one request per entry (None: no adapter, rank 0)."""
    offsets = [pool.offsets[a] if a is not None else 0 for a in adapters]
    ranks = [pool.ranks[a] if a is not None else 0 for a in adapters]
    scales = 0.5 + 1.5 * torch.rand(len(adapters), generator=gen)
    return torch.tensor(offsets, dtype=index_dtype), torch.tensor(ranks, dtype=index_dtype), scales


def run_case(backend, kernel, phase, pool, x, y0, meta, seg_starts=None, max_rank=None):
    """(result of backend, result of reference) on copies of y0; checks the inputs stay intact."""
    offsets, ranks, scales = meta
    bound = max(int(ranks.max()), 1) if max_rank is None else max_rank
    tail = (bound,) if kernel == "bgmv" else ()
    lead = (seg_starts,) if phase == "prefill" else ()
    fn = get_kernels(backend).table[(kernel, phase)]
    ref = getattr(reference, f"{kernel}_{phase}")
    inputs = [t.clone() for t in (x, pool.lora_a, pool.lora_b)]
    out, expected = y0.clone(), y0.clone()
    fn(out, x, pool.lora_a, pool.lora_b, *lead, offsets, ranks, scales, *tail)
    ref(expected, x, pool.lora_a, pool.lora_b, *lead, offsets, ranks, scales, *tail)
    for before, after in zip(inputs, (x, pool.lora_a, pool.lora_b), strict=True):
        torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)
    return out, expected


def assert_matches(out, expected, dtype) -> None:
    atol, rtol = TOL[dtype]
    assert torch.isfinite(out).all(), "NaN from an unowned pool row reached y"
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


def decode_inputs(pool, adapters, dtype, gen, h_in=H_IN, h_out=H_OUT):
    x = torch.randn(len(adapters), h_in, generator=gen).to(dtype)
    y0 = torch.randn(len(adapters), h_out, generator=gen).to(dtype)
    return x, y0, batch_meta(pool, adapters, gen)


def prefill_inputs(pool, adapters, lengths, dtype, gen, index_dtype=torch.int32):
    seg_starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=index_dtype)
    num_tokens = int(seg_starts[-1])
    x = torch.randn(num_tokens, pool.lora_a.shape[1], generator=gen).to(dtype)
    y0 = torch.randn(num_tokens, pool.lora_b.shape[1], generator=gen).to(dtype)
    return x, y0, batch_meta(pool, adapters, gen, index_dtype), seg_starts


@pytest.mark.parametrize("num", [1, 3, 7, 13])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_matches_reference(backend, kernel, mix, num):
    gen = torch.Generator().manual_seed(num * 31 + MIXES.index(mix))
    pool = make_pool()
    adapters = pick_adapters(mix, num, len(POOL_RANKS), gen)
    x, y0, meta = decode_inputs(pool, adapters, torch.float32, gen)
    out, expected = run_case(backend, kernel, "decode", pool, x, y0, meta)
    assert not torch.equal(expected, y0)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("num", [1, 3, 7, 13])
@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_matches_reference(backend, kernel, mix, num):
    gen = torch.Generator().manual_seed(num * 37 + MIXES.index(mix))
    pool = make_pool()
    adapters = pick_adapters(mix, num, len(POOL_RANKS), gen)
    lengths = torch.randint(1, 20, (num,), generator=gen).tolist()
    x, y0, meta, seg_starts = prefill_inputs(pool, adapters, lengths, torch.float32, gen)
    out, expected = run_case(backend, kernel, "prefill", pool, x, y0, meta, seg_starts)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes(dtype, backend, kernel, phase):
    gen = torch.Generator().manual_seed(5)
    pool = make_pool(dtype)
    adapters = [0, 1, None, 3, 1, 7, 4]
    if phase == "decode":
        x, y0, meta = decode_inputs(pool, adapters, dtype, gen)
        out, expected = run_case(backend, kernel, phase, pool, x, y0, meta)
    else:
        lengths = [5, 17, 3, 1, 0, 9, 4]
        x, y0, meta, seg_starts = prefill_inputs(pool, adapters, lengths, dtype, gen)
        out, expected = run_case(backend, kernel, phase, pool, x, y0, meta, seg_starts)
    assert out.dtype == dtype
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_requests_without_adapter_are_untouched(backend, kernel, phase):
    gen = torch.Generator().manual_seed(9)
    pool = make_pool()
    adapters = [None, 4, None, 7, None]
    lengths = [3, 6, 1, 4, 2]
    if phase == "decode":
        x, y0, meta = decode_inputs(pool, adapters, torch.float32, gen)
        out, expected = run_case(backend, kernel, phase, pool, x, y0, meta)
        untouched = [0, 2, 4]
    else:
        x, y0, meta, seg_starts = prefill_inputs(pool, adapters, lengths, torch.float32, gen)
        out, expected = run_case(backend, kernel, phase, pool, x, y0, meta, seg_starts)
        untouched = [0, 1, 2, 9, 14, 15]  # tokens of segments 0, 2 and 4
    assert torch.equal(out[untouched], y0[untouched])
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_all_ranks_zero_is_a_no_op(backend, phase):
    gen = torch.Generator().manual_seed(2)
    pool = make_pool()
    kernels = get_kernels(backend)
    x, y0, meta = decode_inputs(pool, [None] * 3, torch.float32, gen)
    out = y0.clone()
    if phase == "decode":
        kernels.bgmv_decode(out, x, pool.lora_a, pool.lora_b, *meta, 0)
        kernels.mbgmv_decode(out, x, pool.lora_a, pool.lora_b, *meta)
    else:
        seg_starts = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
        kernels.bgmv_prefill(out, x, pool.lora_a, pool.lora_b, seg_starts, *meta, 0)
        kernels.mbgmv_prefill(out, x, pool.lora_a, pool.lora_b, seg_starts, *meta)
    assert torch.equal(out, y0)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bgmv_padding_contributes_zero(backend, phase):
    """max_rank far above every rank (windows reach NaN rows and past the pool) changes nothing."""
    gen = torch.Generator().manual_seed(4)
    pool = make_pool()
    adapters = [7, 2, 7, 0]  # ranks 8, 8, 8, 16; adapter 7 ends the pool
    if phase == "decode":
        x, y0, meta = decode_inputs(pool, adapters, torch.float32, gen)
        out, expected = run_case(backend, "bgmv", phase, pool, x, y0, meta, max_rank=64)
    else:
        x, y0, meta, seg_starts = prefill_inputs(pool, adapters, [4, 2, 7, 3], torch.float32, gen)
        out, expected = run_case(backend, "bgmv", phase, pool, x, y0, meta, seg_starts, 64)
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
@pytest.mark.parametrize("kernel", KERNELS)
def test_pool_layout_is_peft_layout(backend, kernel):
    """Rows [off, off+r) of lora_a / lora_b are PEFT's lora_A.weight / lora_B.weight.T."""
    gen = torch.Generator().manual_seed(11)
    h_in, h_out, num_rows = 40, 24, 70
    lora_a = torch.full((num_rows, h_in), math.nan)
    lora_b = torch.full((num_rows, h_out), math.nan)
    peft = {}  # offset -> (lora_A, lora_B) as PEFT holds them
    for off, r in ((5, 8), (23, 16), (41, 3), (50, 20)):
        lin_a = torch.nn.Linear(h_in, r, bias=False)  # PEFT's lora_A: weight [r, H_in]
        lin_b = torch.nn.Linear(r, h_out, bias=False)  # PEFT's lora_B: weight [H_out, r]
        torch.nn.init.normal_(lin_a.weight, generator=gen)
        torch.nn.init.normal_(lin_b.weight, generator=gen)
        lora_a[off : off + r] = lin_a.weight.detach()
        lora_b[off : off + r] = lin_b.weight.detach().T
        peft[off] = (lin_a, lin_b)
    offsets = torch.tensor([23, 5, 50, 41, 23], dtype=torch.int64)
    ranks = torch.tensor([16, 8, 20, 3, 16], dtype=torch.int64)
    scales = torch.tensor([0.5, 2.0, 1.0, 4.0, 0.25])
    x, y0 = torch.randn(5, h_in, generator=gen), torch.randn(5, h_out, generator=gen)
    with torch.no_grad():
        expected = torch.stack(
            [y0[i] + scales[i] * peft[int(off)][1](peft[int(off)][0](x[i])) for i, off in
             enumerate(offsets)]
        )  # fmt: skip
    fn = get_kernels(backend).table[(kernel, "decode")]
    out = y0.clone()
    fn(out, x, lora_a, lora_b, offsets, ranks, scales, *((20,) if kernel == "bgmv" else ()))
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_wide_hidden_long_segments_and_strided_y(backend, kernel):
    """Odd H_in over several split-K slices, segments spanning several token tiles, y a view."""
    gen = torch.Generator().manual_seed(13)
    pool = make_pool(h_in=300, h_out=72)
    adapters = [1, None, 4, 1]
    x, _, meta, seg_starts = prefill_inputs(pool, adapters, [37, 1, 50, 20], torch.float32, gen)
    fused = torch.randn(x.shape[0], 200, generator=gen)  # y is columns 40:112 of a wider output
    for phase in ("decode", "prefill"):
        if phase == "decode":
            xs, fs, m = x[:4], fused[:4].clone(), meta
        else:
            xs, fs, m = x, fused.clone(), meta
        offsets, ranks, scales = m
        fn = get_kernels(backend).table[(kernel, phase)]
        ref = getattr(reference, f"{kernel}_{phase}")
        lead = (seg_starts,) if phase == "prefill" else ()
        tail = (64,) if kernel == "bgmv" else ()
        expected = fs.clone()
        ref(expected[:, 40:112], xs, pool.lora_a, pool.lora_b, *lead, offsets, ranks, scales, *tail)
        fn(fs[:, 40:112], xs, pool.lora_a, pool.lora_b, *lead, offsets, ranks, scales, *tail)
        assert torch.equal(fs[:, :40], fused[: fs.shape[0], :40])
        assert torch.equal(fs[:, 112:], fused[: fs.shape[0], 112:])
        assert_matches(fs, expected, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mbgmv_max_rank_bound_and_int64_indices(backend):
    gen = torch.Generator().manual_seed(17)
    pool = make_pool()
    adapters = [3, 0, 6, 2, 7]
    lengths = [2, 5, 1, 6, 3]
    x, y0, meta, seg_starts = prefill_inputs(
        pool, adapters, lengths, torch.float32, gen, torch.int64
    )
    kernels = get_kernels(backend)
    expected = y0.clone()
    reference.mbgmv_prefill(expected, x, pool.lora_a, pool.lora_b, seg_starts, *meta)
    for bound in (32, 64, 100):
        out = y0.clone()
        kernels.mbgmv_prefill(out, x, pool.lora_a, pool.lora_b, seg_starts, *meta, max_rank=bound)
        assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_triton_clamps_ranks_above_the_bound(kernel, phase):
    """A caller that breaks max_rank >= ranks gets rank-clamped numbers, not a corrupt workspace."""
    gen = torch.Generator().manual_seed(19)
    pool = make_pool()
    x, y0, meta, seg_starts = prefill_inputs(pool, [1, 3, 0], [3, 4, 2], torch.float32, gen)
    offsets, ranks, scales = meta
    clamped = (offsets, ranks.clamp(max=16), scales)
    num = 3 if phase == "decode" else x.shape[0]
    lead = (seg_starts,) if phase == "prefill" else ()
    out, expected = y0[:num].clone(), y0[:num].clone()
    get_kernels("triton").table[(kernel, phase)](
        out, x[:num], pool.lora_a, pool.lora_b, *lead, *meta, 16
    )
    getattr(reference, f"{kernel}_{phase}")(
        expected, x[:num], pool.lora_a, pool.lora_b, *lead, *clamped, 16
    )
    assert_matches(out, expected, torch.float32)


def test_get_kernels_table_and_unknown_backend():
    for backend in ("reference", "cpu", "triton"):
        table = get_kernels(backend).table
        assert sorted(table) == [(k, p) for k in KERNELS for p in ("decode", "prefill")]
        assert all(callable(fn) for fn in table.values())
    with pytest.raises(ValueError, match="unknown kernel backend"):
        get_kernels("cuda")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_select_picks_one_backend_per_device_kernel_and_dtype(kernel, dtype):
    on_gpu = select(kernel, "cuda", dtype)
    assert (on_gpu.name, on_gpu.padded) == ("triton", kernel == "bgmv")
    assert on_gpu.segment_decode is None and on_gpu.runs_step is None
    on_cpu = select(kernel, "cpu", dtype)
    assert on_cpu.padded == (kernel == "bgmv")
    assert on_cpu.decode is getattr(cpu, f"{kernel}_decode")
    if kernel == "mbgmv" and native.available(dtype):  # float32/bfloat16 where a compiler is found
        assert on_cpu.name == "native" and on_cpu.runs_step is native.RunsStep
        assert on_cpu.prefill is on_cpu.segment_decode is native.mbgmv_runs
    else:
        assert on_cpu.name == "cpu" and on_cpu.runs_step is None
        assert on_cpu.prefill is on_cpu.segment_decode is getattr(cpu, f"{kernel}_prefill")


def test_select_refuses_unknown_kernels_and_devices():
    with pytest.raises(ValueError, match="unknown LoRA kernel"):
        select("sgmv", "cpu", torch.float32)
    with pytest.raises(ValueError, match="unknown device"):
        select("mbgmv", "tpu", torch.float32)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_bad_arguments_are_rejected(backend):
    kernels = get_kernels(backend)
    pool = make_pool()
    x, y = torch.randn(2, H_IN), torch.randn(2, H_OUT)
    offs, scales = torch.tensor([3, 22], dtype=torch.int32), torch.ones(2)
    ranks = torch.tensor([16, 64], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_rank"):
        kernels.bgmv_decode(y, x, pool.lora_a, pool.lora_b, offs, ranks, scales, 32)
    with pytest.raises(ValueError, match="outside the pool"):
        far = torch.tensor([3, pool.lora_a.shape[0] - 8], dtype=torch.int32)
        kernels.mbgmv_decode(y, x, pool.lora_a, pool.lora_b, far, ranks, scales)
    with pytest.raises(TypeError):
        kernels.mbgmv_decode(y.half(), x, pool.lora_a, pool.lora_b, offs, ranks, scales)
    with pytest.raises(TypeError):
        kernels.mbgmv_decode(y, x, pool.lora_a, pool.lora_b, offs, ranks, scales.double())
    with pytest.raises(ValueError, match="non-decreasing"):
        seg = torch.tensor([0, 2, 1], dtype=torch.int32)
        kernels.mbgmv_prefill(y, x, pool.lora_a, pool.lora_b, seg, offs, ranks, scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num", "rank"), [(1, 8), (7, 64), (0, 16)])
def test_host_rows_kernel_matches_the_reference(dtype, num, rank):
    gen = torch.Generator().manual_seed(num + rank)
    x = torch.randn(num, H_IN, generator=gen).to(dtype)
    lora_a = (torch.randn(rank, H_IN, generator=gen) / H_IN**0.5).to(dtype)
    lora_b_peft = torch.randn(H_OUT, rank, generator=gen).to(dtype)  # [H_out, R], as PEFT has it
    out, want = torch.full((num, H_OUT), float("nan"), dtype=dtype), torch.zeros(num, H_OUT)
    cpu.lora_rows(out, x, lora_a, lora_b_peft.T, 0.5)
    reference.lora_rows(want, x, lora_a, lora_b_peft.T, 0.5)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)
