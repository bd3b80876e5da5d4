"""The native MBGMV-over-runs kernel against the float32 reference prefill kernel."""

from __future__ import annotations

import pytest
import torch

from toppings.gpu_lora.kernels import native as native_lora
from toppings.gpu_lora.kernels import reference

pytestmark = pytest.mark.skipif(native_lora.library() is None, reason="no C compiler here")
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def case(dtype, runs, ranks, h_in=48, h_out=40, pool_rows=160, seed=0):
    """Pool rows hold NaN except where the runs' adapters sit; y is a strided view."""
    gen = torch.Generator().manual_seed(seed)
    lora_a = torch.full((pool_rows, h_in), float("nan"))
    lora_b = torch.full((pool_rows, h_out), float("nan"))
    offsets, off = [], 3
    for r in ranks:
        offsets.append(off)
        lora_a[off : off + r] = torch.randn(r, h_in, generator=gen) / h_in**0.5
        lora_b[off : off + r] = torch.randn(r, h_out, generator=gen)
        off += max(r, 1) + 5
    starts = [0]
    for n in runs:
        starts.append(starts[-1] + n)
    x = torch.randn(starts[-1], h_in, generator=gen).to(dtype)
    wide = torch.randn(starts[-1], h_out + 7, generator=gen).to(dtype)
    args = (
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(offsets, dtype=torch.int32),
        torch.tensor(ranks, dtype=torch.int32),
        torch.rand(len(ranks), generator=gen) * 2,
    )
    return wide[:, :h_out], x, lora_a.to(dtype), lora_b.to(dtype), args


MIXES = {
    "distinct": ([1, 1, 1, 1], [8, 16, 32, 64]),
    "uniform": ([3, 3, 3], [16, 16, 16]),
    "skewed": ([9, 1, 2], [64, 8, 0]),  # rank 0: no adapter, rows untouched
    "single": ([5], [32]),
    "empty runs": ([0, 2, 0], [8, 8, 16]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("h_out", [40, 32])  # 32: blocks of 4 tokens, vectorized (16 | H)
def test_matches_reference(dtype, mix, h_out):
    y, x, lora_a, lora_b, args = case(dtype, *MIXES[mix], h_out=h_out)
    want = y.clone()
    reference.mbgmv_prefill(want, x, lora_a, lora_b, *args)
    native_lora.mbgmv_runs(y, x, lora_a, lora_b, *args)
    torch.testing.assert_close(y.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_rows_outside_the_pool_are_refused_before_anything_is_written():
    y, x, lora_a, lora_b, (starts, offsets, ranks, scales) = case(torch.float32, [2, 2], [8, 8])
    before = y.clone()
    offsets[1] = lora_a.shape[0] - 4  # rank 8 would read past the pool
    with pytest.raises(ValueError):
        native_lora.mbgmv_runs(y, x, lora_a, lora_b, starts, offsets, ranks, scales)
    assert torch.equal(y, before)


def projection_case(dtype, runs, ranks, h_outs, seed=0):
    """Projections of one input, each with its own pool, width and ranks (0: not targeted)."""
    y, x, lora_a, lora_b, (starts, offsets, _, scales) = case(dtype, runs, ranks, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    projections = []
    for p, h_out in enumerate(h_outs):
        ranks_p = [0 if (g + p) % 3 == 2 else r for g, r in enumerate(ranks)]
        b = torch.randn(lora_b.shape[0], h_out, generator=gen).to(dtype)
        wide = torch.randn(x.shape[0], h_out + 5, generator=gen).to(dtype)
        a = (lora_a.float() * (p + 1)).to(dtype)
        projections.append((wide[:, :h_out], a, b, torch.tensor(ranks_p, dtype=torch.int32)))
    return x, projections, starts, offsets, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 32 | H_out: bf16 pairs of B rows (odd ranks leave one row unpaired); 48, 16: float32 strips;
# 40: the scalar path
@pytest.mark.parametrize("h_outs", [(64, 32, 96), (48, 16, 16), (40, 32), (64,)])
# one run of one token (a decode step of one request: fewer blocks of tokens than threads, so
# the blocks are split by projection over the threads) or several runs
@pytest.mark.parametrize(("runs", "ranks"), [
    ([1], [16]), ([4, 1, 7, 0, 2], [8, 16, 64, 8, 32]), ([4, 1, 7, 0, 2], [7, 1, 33, 5, 2]),
])  # fmt: skip
def test_every_projection_of_one_input_matches_the_reference(dtype, h_outs, runs, ranks):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the kernel takes the caller's count
    try:
        check_every_projection(dtype, h_outs, runs, ranks)
    finally:
        torch.set_num_threads(threads)


def check_every_projection(dtype, h_outs, runs, ranks):
    x, projections, starts, offsets, scales = projection_case(dtype, runs, ranks, h_outs)
    wants = []
    for y, a, b, ranks in projections:
        want = y.clone()
        reference.mbgmv_prefill(want, x, a, b, starts, offsets, ranks, scales)
        wants.append(want)
    native_lora.mbgmv_runs_multi(x, projections, starts, offsets, scales)
    for (y, a, b, ranks), want in zip(projections, wants):
        # bf16 rounds x @ A.T before B (as PEFT's bf16 LoRA does): its error scales with the
        # terms' magnitudes, |x| @ |A|.T @ |B|, not with a sum that may cancel to near zero.
        terms = torch.zeros(y.shape)
        reference.mbgmv_prefill(terms, x.float().abs(), a.float().abs(), b.float().abs(), starts,
                                offsets, ranks, scales.abs())  # fmt: skip
        error = (y.float() - want.float()).abs()
        assert (error <= TOL[dtype] * (1 + want.float().abs() + terms / 8)).all()


def test_one_bad_projection_stops_the_call_before_any_projection_is_written():
    x, projections, starts, offsets, scales = projection_case(
        torch.float32, [2, 3], [8, 16], (32, 48)
    )
    before = [y.clone() for y, *_ in projections]
    y, a, b, ranks = projections[1]
    ranks[1] = a.shape[0]  # rank past the end of the pool, in the second projection only
    with pytest.raises(ValueError):
        native_lora.mbgmv_runs_multi(x, projections, starts, offsets, scales)
    for (y, *_), old in zip(projections, before):
        assert torch.equal(y, old)


def test_mismatched_shapes_are_refused():
    x, projections, starts, offsets, scales = projection_case(torch.float32, [2], [8], (32,))
    y, a, b, ranks = projections[0]
    with pytest.raises(ValueError):
        native_lora.mbgmv_runs_multi(x, [(y[:1], a, b, ranks)], starts, offsets, scales)
    with pytest.raises(ValueError):
        native_lora.mbgmv_runs_multi(x, [(y, a, b[:, :16], ranks)], starts, offsets, scales)


def step_case(dtype, num_layers=3, seed=1):
    """Pool tables [L, C, H] of three projections of one input (q, k, v shapes), runs of 4 units."""
    gen = torch.Generator().manual_seed(seed)
    h_in, h_outs = 48, {"q_proj": 48, "k_proj": 16, "v_proj": 32}
    ranks, offsets, rows = [8, 0, 5, 16], [0, 0, 8, 13], 40  # runs of 2, 3, 1 and 4 tokens
    tables = {}
    for module, h_out in h_outs.items():
        a = torch.randn(num_layers, rows, h_in, generator=gen) / h_in**0.5
        b = torch.randn(num_layers, rows, h_out, generator=gen)
        module_ranks = torch.tensor([0 if module == "k_proj" and r == 5 else r for r in ranks])
        tables[module] = (a.to(dtype), b.to(dtype), module_ranks.to(torch.int32))
    starts = torch.tensor([0, 2, 5, 6, 10], dtype=torch.int32)
    x = torch.randn(10, h_in, generator=gen).to(dtype)
    meta = (starts, torch.tensor(offsets, dtype=torch.int32), torch.rand(4, generator=gen) + 0.5)
    return tables, x, meta


def check_step_layer(step, tables, x, meta, layer, skip) -> None:
    """`step` at `layer` with the runs `skip` left out adds what the reference does, into fresh
    random outputs of every module of `tables`."""
    starts, offsets, scales = meta
    outputs, want = [], []
    for module, (a, b, ranks) in tables.items():
        y = torch.randn(x.shape[0], b.shape[2]).to(x.dtype)
        expected = y.clone()
        kept = ranks.clone()
        kept[list(skip)] = 0
        reference.mbgmv_prefill(expected, x, a[layer], b[layer], starts, offsets, kept, scales)
        outputs.append((module, y))
        want.append(expected)
    step(layer, x, outputs, skip)
    tol = TOL[x.dtype]
    for (module, y), expected in zip(outputs, want):
        torch.testing.assert_close(y.float(), expected.float(), rtol=tol, atol=tol, msg=module)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("skip", [(), (2,), (0, 3)])
def test_a_prepared_step_matches_the_reference_at_every_layer(dtype, skip):
    tables, x, meta = step_case(dtype)
    step = native_lora.RunsStep(tables, *meta)
    for layer in range(3):
        check_step_layer(step, tables, x, meta, layer, skip)


def test_runs_skipped_layer_by_layer_stay_on_the_native_call(monkeypatch):
    """A step with an adapter still loading (or served on the host) skips its runs at the layers
    not on the device: the native call with those ranks at 0, the sets switching between calls,
    never the general path, and no set's ranks leak into another's."""
    tables, x, meta = step_case(torch.bfloat16)
    step = native_lora.RunsStep(tables, *meta)
    before = {m: r.clone() for m, (_, _, r) in tables.items()}

    def general(*args):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(step, "_general", general)
    for layer, skip in [(0, (2,)), (0, ()), (1, (0, 3)), (1, (2,)), (2, ()), (2, (0, 3))]:
        check_step_layer(step, tables, x, meta, layer, skip)
    for module, (_, _, ranks) in tables.items():  # the step's own tables untouched
        assert torch.equal(ranks, before[module])


@pytest.mark.parametrize("skip", [(), (3,), (0, 2)])
def test_runs_on_onednn_products_match_the_reference(skip):
    """A bfloat16 step whose long runs go to oneDNN's products (tokens x rank at least
    product_min_work: here runs 0 and 3), the others to the native call, skipped runs in
    neither; the C decode caller is then not given the step (it would not know to leave the
    product runs out)."""
    tables, x, meta = step_case(torch.bfloat16)
    step = native_lora.RunsStep(tables, *meta, product_min_work=16)
    assert step.layout() is None
    for layer in range(3):
        check_step_layer(step, tables, x, meta, layer, skip)
    products = {g for runs in step._products.values() for g, *_ in runs}
    assert products == {0, 3}
    assert native_lora.RunsStep(tables, *meta, product_min_work=0).layout() is not None


def test_a_prepared_step_takes_strided_outputs_and_refuses_wrong_widths():
    tables, x, meta = step_case(torch.float32)
    step = native_lora.RunsStep(tables, *meta)
    wide = torch.zeros(x.shape[0], 48 + 16 + 32)  # q, k, v as column slices of one output
    outputs = [("q_proj", wide[:, :48]), ("k_proj", wide[:, 48:64]), ("v_proj", wide[:, 64:])]
    step(1, x, outputs)
    for module, y in outputs:
        a, b, ranks = tables[module]
        expected = torch.zeros_like(y)
        reference.mbgmv_prefill(expected, x, a[1], b[1], meta[0], meta[1], ranks, meta[2])
        torch.testing.assert_close(y, expected, rtol=TOL[torch.float32], atol=TOL[torch.float32])
    with pytest.raises(ValueError, match="does not match"):
        step(1, x, [("q_proj", torch.zeros(x.shape[0], 40))])
    with pytest.raises(ValueError, match="token count"):
        step(1, x, [("q_proj", torch.zeros(x.shape[0] + 1, 48))])


def test_the_lora_library_is_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOPPINGS_CACHE_DIR", str(tmp_path))
    native_lora.library.cache_clear()
    try:
        assert native_lora.library() is not None
        built = list((tmp_path / "native").glob("lora_kernels-*.so"))
        assert len(built) == 1
        native_lora.library.cache_clear()
        assert native_lora.library() is not None
        assert list((tmp_path / "native").iterdir()) == built  # reused, no second build
    finally:
        native_lora.library.cache_clear()


def test_turned_off_the_runs_use_the_torch_kernel(monkeypatch):
    monkeypatch.setenv("TOPPINGS_NATIVE", "0")
    native_lora.library.cache_clear()
    try:
        assert native_lora.library() is None and not native_lora.available(torch.float32)
        y, x, lora_a, lora_b, args = case(torch.float32, *MIXES["distinct"])
        want = y.clone()
        reference.mbgmv_prefill(want, x, lora_a, lora_b, *args)
        native_lora.mbgmv_runs(y, x, lora_a, lora_b, *args)
        torch.testing.assert_close(y, want, rtol=TOL[torch.float32], atol=TOL[torch.float32])
    finally:
        native_lora.library.cache_clear()
