"""bfloat16 end to end: the engine served in `dtype="bfloat16"` with `quantization` none, int8
and int4 gives, in mixed-adapter batches and one request at a time, the logprobs and greedy
tokens of transformers + PEFT loaded in bfloat16 on the same weights.

Here beside test_quant_exactness.py, whose dequantized reference checkpoint it reuses: what it
checks is the model's bfloat16 paths (torch's bf16 kernels, the native bf16 / int8 / int4 GEMVs
and the one-call decode step), which every other end-to-end exactness test runs in float32.

The reference: the family's tiny checkpoint (tests/server/model/tiny_families.py), for int8 /
int4 with every projection replaced by the weight the engine multiplies by in a bfloat16 model
(`dequantize(torch.bfloat16)`: the scales, and int4's zeros, rounded to bfloat16 as the engine
keeps them: quant.py, quant_gemv.int4_bf16_gemv_layout), loaded with `dtype=torch.bfloat16` and
the adapters kept in bfloat16 (`autocast_adapter_dtype=False`), as the engine keeps them.
What rounding the scales and zeros to bf16 changes, measured on llama3 in float32 on both
sides (the engine in float32 against PEFT in float32 on these weights): 0.011 mean, 0.07 max in
logprob, half of bf16's own spread below (0.02 mean), so the reference dequantizes as the
engine multiplies rather than leaving it to TOL. What remains is inside TOL: loading in bf16
rounds each dequantized weight to bf16 (2^-9 relative, uncorrelated), while the native GEMVs
multiply by s * (q - 8) + z (int8: q * s) exactly in float32 (csrc/gemv_int4_bf16.c's note).

Tolerances. bf16 keeps 8 significant bits (unit roundoff u = 2^-8 relative, 2^-9 for one
rounding to nearest). The tiny checkpoints' logits span about 12 within a row (|logit| up to
~8), where one bf16 rounding of a logit moves it by up to 2^-5 = 0.031 (ulp 2^-4 in [8, 16));
the reference and the engine round differently at every op of two layers (norms, projections,
attention, residual adds, LoRA), so their logprobs differ by a few such steps. Measured here
(every family and a SmolLM2-wide llama3 x none / int8 / int4, mixed batch, follow-up turns and
one stream, AVX512_BF16 CPU, 1 and 2 threads): at most 0.154 at one position and at most 0.027
averaged over a run's positions; the engine in float32 against the same bf16 reference, at most
0.18 and 0.028. TOL (one position) is 0.35 and MEAN_TOL (the mean over a run's scored positions)
0.05: about twice the measured spread. Greedy tokens are checked teacher-forced: ours must be
the reference's argmax given the same ids unless the reference's logprob of ours is within
MARGIN = TOL of its best (bf16 logits tie outright: flips at reference margins of 0 to 0.125
were measured).

Real errors land far outside (each made on purpose, run, and undone when this was written): the
bf16 int4 GEMV's zero correction off by one at one row (csrc/gemv_int4_bf16.c, -137 for -136
when T == 1) moves single-stream logprobs by 0.8 to 5.7; off by one at every row its works check
catches, and the engine falls back to torch silently, which the kinds test below fails on; its
zero correction skipped past the first 16 groups of a row (the works check and the tiny
checkpoints have at most 4 groups) moves the wide checkpoint's logprobs by 5; the LoRA scale dropped
(gpu_lora/peft/adapter.py, scale 1) moves the mean by 0.48 to 0.57; rsLoRA scaled as plain LoRA
(one adapter of three) by 0.11 to 0.15; the LoRA skipped in the native decode step at one row
(csrc/decode_proj.c) moves single-stream logprobs by 0.4 to 1.9. int8 against the float model is
below bf16's resolution (see the last test): at bf16 this checks int8's bf16 paths run right,
not that they quantize (test_quant_exactness.py does that).
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from tests.helpers import running_engine
from tests.server.engine.test_family_exactness import (
    NEW_TOKENS,
    TOP,
    first_turn_prompts,
    run,
)
from tests.server.model.family_checkpoints import quantized_checkpoints
from tests.server.model.tiny_families import CHECKPOINTS
from toppings.server.config import Quantization
from toppings.server.requests.request import SamplingParams

TOL = 0.35  # one position's logprob, against the bf16 reference
MEAN_TOL = 0.05  # the mean over a run's scored positions
MARGIN = TOL  # a greedy token may differ where the reference's best is within MARGIN of ours
SCHEMES = ("none", "int8", "int4")
# llama3 as wide as SmolLM2 (H 576, I 1536, 9 heads of 64, 3 kv heads), initialized 3x narrower
# so that its logits span what the tiny ones do: the GEMVs' multi-block paths (more than 16
# groups of 32 inputs, several blocks of output rows, the projections split between threads).
WIDE = dict(
    hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
    initializer_range=0.2 / 3,
)  # fmt: skip
CASES = [(name, s) for name in (*CHECKPOINTS, "llama3-wide") for s in SCHEMES]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(name, scheme) -> (model dir, bf16 reference dir, {adapter: path}), made once per module."""
    return quantized_checkpoints(
        tmp_path_factory, torch.bfloat16, {"llama3-wide": ("llama3", WIDE)}
    )


_REFERENCE: dict = {}


def reference_logprobs(model_dir, adapters, ids: list[int], adapter: str | None) -> torch.Tensor:
    """log_softmax of transformers + PEFT's logits in bfloat16 at every position of `ids`
    (computed in float32 from the bf16 logits), [len, V]."""
    key = (str(model_dir), tuple(sorted(adapters.items())))
    if key not in _REFERENCE:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        (first, first_path), *rest = key[1]
        model = PeftModel.from_pretrained(
            base, first_path, adapter_name=first, autocast_adapter_dtype=False
        )
        for name, path in rest:
            model.load_adapter(path, adapter_name=name, autocast_adapter_dtype=False)
        _REFERENCE.clear()
        _REFERENCE[key] = model.eval()
    model = _REFERENCE[key]
    assert model.base_model.model.lm_head.weight.dtype == torch.bfloat16
    if adapter is not None:
        model.set_adapter(adapter)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: a second thread only waits (a loaded CI, 2 cores)
    try:
        with model.disable_adapter() if adapter is None else nullcontext(), torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    finally:
        torch.set_num_threads(threads)
    return torch.log_softmax(logits, dim=-1)


def check_against_bf16_reference(model_dir, adapters, prompts, results, what: str) -> None:
    """Every scored position's logprob and top-TOP logprobs within TOL of the reference's, their
    mean difference within MEAN_TOL, and every greedy token the reference's argmax after the
    same ids unless the reference's best is within MARGIN of ours. The prompt's positions are
    scored where the request asked for prompt logprobs, the output's always."""
    diffs = []
    for (prompt, name), out in zip(prompts, results):
        ids = prompt + out.new_token_ids
        ref = reference_logprobs(model_dir, adapters, ids, name)  # [len, V]
        first = 0  # the first position scored (predicting ids[first + 1])
        if out.prompt_logprobs is None:
            first, scored = len(prompt) - 1, out.logprobs
        else:
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
            scored = out.prompt_logprobs[1:] + out.logprobs  # predicts ids[1:]
        assert [s.token_id for s in scored] == ids[first + 1 :]
        for pos, s in enumerate(scored, start=first):
            want = ref[pos]
            diff = abs(s.logprob - float(want[ids[pos + 1]]))
            assert diff < TOL, f"{what}, {name}: position {pos} off by {diff:.3f}"
            diffs.append(diff)
            top_ids = [t for t, _ in s.top]
            got_top = torch.tensor([lp for _, lp in s.top])
            assert len(top_ids) == TOP
            assert torch.allclose(got_top, want[top_ids], atol=TOL), (what, name, pos)
            assert torch.allclose(got_top, want.topk(TOP).values, atol=TOL), (what, name, pos)
        for j, token in enumerate(out.new_token_ids):
            row = ref[len(prompt) - 1 + j]
            short = float(row.max() - row[token])
            assert short < MARGIN, f"{what}, {name}: token {j} is {token}, {short:.3f} below best"
    mean = sum(diffs) / len(diffs)
    assert mean < MEAN_TOL, f"{what}: mean logprob difference {mean:.4f}"


@pytest.mark.parametrize(("name", "scheme"), CASES)
def test_bf16_engine_matches_bf16_peft(checkpoints, name, scheme, monkeypatch):
    """A mixed batch (two requests per adapter, two base ones, scored prompt and output), each
    request's follow-up turn on its cached KV (output scored), then an adapter request of each
    adapter and a base request alone: their decode steps at batch 1,
    through the native decode path where the model built one, in one call a step where this
    build's silu takes the model (counted)."""
    serve_and_check(checkpoints, name, scheme, monkeypatch)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_bf16_engine_on_an_avx2_cpus_kernels_matches_bf16_peft(checkpoints, scheme, monkeypatch):
    """The kernels an AVX2 CPU without AVX-512 picks in bfloat16, on this one: the AVX2 bf16
    GEMV for float projections (in the native decode step), and for int4 torch's bf16 int4
    kernel op by op (no AVX512_BF16: no native int4 GEMV for bf16). (int8's GEMV picks its ISA
    in C, AVX-512 where there is one: its AVX2 path is test_gemv_int8.py's, per op.)"""
    from toppings.server.model import linear, quant
    from toppings.server.model.decode_structs import GEMV_KINDS
    from toppings.server.model.dtype import cpu_flags

    if native_library() is None or not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("no native library or no AVX2 + FMA here")
    avx2_only = {
        k: tuple(v for v in kernels if "avx2" in v[0]) for k, kernels in linear._GEMV.items()
    }
    monkeypatch.setattr(linear, "_GEMV", avx2_only)
    monkeypatch.setattr(quant, "int4_bf16_gemv_works", lambda: False)
    linear.gemv_kernel.cache_clear()
    try:
        assert linear.gemv_kernel(torch.bfloat16)[0] == "gemv_bf16_avx2"
        kinds = serve_and_check(checkpoints, "llama3", scheme, monkeypatch)
    finally:
        linear.gemv_kernel.cache_clear()
    if scheme == "none":
        assert kinds == {GEMV_KINDS["gemv_bf16_avx2"]}
    if scheme == "int4":
        assert kinds is None  # op by op


def native_library():
    from toppings.server import native

    return native.library()


def serve_and_check(checkpoints, name: str, scheme: str, monkeypatch) -> set[int] | None:
    """Serve `name` in bfloat16 with `scheme`: the mixed batch, its follow-up turns (reusing the
    first turns' cached KV), then the four requests alone
    (checked to run the native decode path at batch 1 where the model built one); both against
    the bf16 reference. Returns the decode path's projection kinds, None where it had none."""
    from toppings.server.model.decode_path import DecodePath

    rows: list[int] = []
    run_path = DecodePath.run

    def counted_path(self, model, batch, kv, h, cos, sin):
        rows.append(h.shape[0])
        return run_path(self, model, batch, kv, h, cos, sin)

    to_logits = DecodePath.run_to_logits

    def counted_whole(self, model, batch, kv):
        logits = to_logits(self, model, batch, kv)
        if logits is not None:  # the whole step in one call
            rows.append(batch.input_ids.shape[0])
        return logits

    split: list[int] = []  # steps whose layers ran as four calls each, not one call
    by_layer = DecodePath._layer_by_layer

    def counted_split(self, model, lora, kv, step, buffers):
        split.append(step.T)
        return by_layer(self, model, lora, kv, step, buffers)

    monkeypatch.setattr(DecodePath, "run", counted_path)
    monkeypatch.setattr(DecodePath, "run_to_logits", counted_whole)
    monkeypatch.setattr(DecodePath, "_layer_by_layer", counted_split)
    model_dir, ref_dir, adapters = checkpoints(name, scheme)
    scored = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=TOP, prompt_logprobs=TOP)  # fmt: skip
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=TOP)  # fmt: skip
    prompts = first_turn_prompts(256)
    alone = prompts[:3] + prompts[-1:]  # a3, a5, a7rs, base
    with running_engine(
        model_dir, adapters, dtype="bfloat16", quantization=scheme, max_total_tokens=4096,
        max_batch_size=16, prefix_cache=True,
    ) as engine:  # fmt: skip
        assert engine.model.dtype == torch.bfloat16
        assert engine.model.quantization is Quantization(scheme)
        mixed = run(engine, prompts, scored)
        # each request's next turn, on the first turn's KV (cached in bf16) under its adapter
        follow = [(p + out.new_token_ids + [7, 8, 9], a) for (p, a), out in zip(prompts, mixed)]
        hits = engine.stats().to_json()["memory"]["prefix_hit_tokens"]
        second = run(engine, follow, greedy)
        assert engine.stats().to_json()["memory"]["prefix_hit_tokens"] > hits, "no KV reused"
        rows.clear(), split.clear()
        single = [run(engine, [p], scored)[0] for p in alone]
        path = engine.model.decode_path
    kinds = None
    if path is not None:
        assert rows and set(rows) == {1}, "the single-stream steps skipped the native path"
        if path._one_call:
            assert split == [], "a single-stream step ran layer by layer, not in one call"
        kinds = {s.kind for layer in path._layers for s in layer.structs}
    check_against_bf16_reference(ref_dir, adapters, prompts, mixed, f"{name} {scheme} mixed")
    check_against_bf16_reference(ref_dir, adapters, follow, second, f"{name} {scheme} follow-up")
    check_against_bf16_reference(ref_dir, adapters, alone, single, f"{name} {scheme} alone")
    return kinds


@pytest.mark.parametrize("scheme", SCHEMES)
def test_native_bf16_decode_path_is_built_where_its_kernels_run(checkpoints, scheme):
    """Where this CPU runs the bf16 GEMVs natively, the test above ran the one-call decode step
    on the bf16 kernels (decode_layer.c's kinds): the plain bf16 GEMV (AVX-512 or AVX2), the int8
    GEMV with bf16 activations, the bf16 int4 GEMV (AVX512_BF16). A kernel the CPU should run
    that declines or disagrees with F.linear (its `*_works` check: the engine then falls back to
    torch, silently) fails here. Elsewhere (no native library, no AVX2, int4 without
    AVX512_BF16) the per-op path on torch's bf16 kernels is what the test above checked."""
    from toppings.server.model import quant_gemv
    from toppings.server.model.decode_structs import GEMV_KINDS, GemvKind
    from toppings.server.model.dtype import cpu_flags
    from toppings.server.model.linear import gemv_kernel

    needs = {"none": "avx2", "int8": "avx2", "int4": "avx512_bf16"}[scheme]
    if native_library() is None:
        pytest.skip("no native library here: the per-op path on torch's bf16 kernels ran")
    if needs not in cpu_flags():
        pytest.skip(f"no native bf16 GEMV for {scheme} here (needs {needs}): the per-op path ran")
    kernel = gemv_kernel(torch.bfloat16)
    assert kernel is not None, "the native bf16 GEMV declined or disagreed with F.linear"
    if scheme == "int8":
        assert quant_gemv.int8_gemv_works(torch.bfloat16), "the int8 GEMV failed its check"
    if scheme == "int4":
        assert quant_gemv.int4_bf16_gemv_works(), "the bf16 int4 GEMV failed its check"
    model_dir, _, adapters = checkpoints("llama3", scheme)
    with running_engine(
        model_dir, adapters, dtype="bfloat16", quantization=scheme, max_total_tokens=1024
    ) as engine:  # fmt: skip
        path = engine.model.decode_path
        assert path is not None and path._one_call
        kinds = {s.kind for layer in path._layers for s in layer.structs}
    want = {"none": GEMV_KINDS[kernel[0]], "int8": GemvKind.INT8, "int4": GemvKind.INT4_BF16}
    assert kinds == {want[scheme]}


def test_the_int4_reference_is_not_the_float_model(checkpoints):
    """The int4 reference differs from the float checkpoint (both in bf16) by far more than
    MEAN_TOL, so the int4 cases compare against the quantized weights, not by luck against the
    float ones. (int8 does not: its rounding, ~2^-9 of a row's largest weight, is bf16's own
    size, a mean of about 0.03 here; test_quant_exactness.py checks int8 in float32, at 1e-4.)"""
    model_dir, ref_dir, adapters = checkpoints("llama3", "int4")
    ids = first_turn_prompts(256)[0][0]
    diff = reference_logprobs(ref_dir, adapters, ids, "a3") - reference_logprobs(
        model_dir, adapters, ids, "a3"
    )
    assert diff.abs().mean() > 4 * MEAN_TOL


def test_bf16_adapters_served_on_the_host_match_bf16_peft(checkpoints, monkeypatch):
    """cpu-assisted with device room for the largest adapter alone: the mixed batch's others
    are served on the host (`HostLora.add`, its native call over the host tensors
    where this build has the kernel) at bfloat16, and give the bf16 reference's tokens and
    logprobs as the pool's rows do. On SmolLM2's widths (the kernel's vector paths)."""
    from toppings.gpu_lora.adapter_pool import AdapterPool
    from toppings.gpu_lora.kernels import native
    from toppings.gpu_lora.peft.adapter import inspect_peft_adapter
    from toppings.server.model.loader import load_checkpoint

    calls = []
    call_runs = native.call_runs
    monkeypatch.setattr(native, "call_runs", lambda *a: calls.append(1) or call_runs(*a))
    model_dir, ref_dir, adapters = checkpoints("llama3-wide", "none")
    shapes = load_checkpoint(str(model_dir), "dummy").config
    pool = AdapterPool(shapes, torch.bfloat16, "cpu")
    sizes = [inspect_peft_adapter(path, shapes) for path in adapters.values()]
    room = max(pool.bytes_for(s.rank, s.modules) for s in sizes)  # every one fits, not two
    scored = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=TOP, prompt_logprobs=TOP)  # fmt: skip
    prompts = first_turn_prompts(256)
    with running_engine(
        model_dir, adapters, dtype="bfloat16", lora_mode="cpu-assisted",
        adapter_cache_bytes=room, max_total_tokens=4096, max_batch_size=16,
    ) as engine:  # fmt: skip
        mixed = run(engine, prompts, scored)
        assert engine.lora.num_host_served >= 2  # two adapters' requests at least
    if native.available(torch.bfloat16):
        assert calls, "the host-served requests did not run the native host call"
    check_against_bf16_reference(ref_dir, adapters, prompts, mixed, "served on the host")
