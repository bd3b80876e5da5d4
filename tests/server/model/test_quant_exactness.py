"""int8 / int4 base weights (`--quantization`) with LoRA adapters in full precision give, in
mixed-adapter batches, the tokens and logprobs of transformers + PEFT run on the same
dequantized weights.

The reference checkpoint is the family's tiny checkpoint (tests/server/model/tiny_families.py)
with every projection weight replaced by dequant(quant(W)) as the engine multiplies by it
(q/k/v/o/gate/up/down in the scheme, lm_head in int8; a tied lm_head is untied, since the
embedding lookup stays float), saved as an ordinary Hugging Face directory; the engine serves the
original float checkpoint with `quantization` set and quantizes at load. The checks are
test_family_exactness.py's: the mixed batch's prompt and output logprobs within TOL of the
reference (fp32, the same tolerance as the float path: torch's int8/int4 CPU kernels accumulate
in float32, so only the summation order differs), and greedy tokens teacher-forced equal (near
ties aside), for the first turns and for follow-up turns that reuse cached KV. Llama 3 runs every
kernel x LoRA mode in int8 and int4; every other family runs one pair per scheme, CPU worker
processes included.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import running_engine
from tests.server.engine.test_family_exactness import (
    NEW_TOKENS,
    TOP,
    check_greedy_teacher_forced,
    first_turn_prompts,
    run,
)
from tests.server.engine.test_logprobs_exactness import check_against_reference
from tests.server.model.family_checkpoints import quantized_checkpoints
from toppings.server.config import Quantization
from toppings.server.model.decode_structs import GemvKind
from toppings.server.requests.request import SamplingParams

LORA_MODES = ("cached", "on-demand", "cpu-assisted")
KERNELS = ("mbgmv", "bgmv")

# (checkpoint, kernel, lora mode, CPU worker processes)
ALL_PAIRS = [("llama3", k, m, 0) for k in KERNELS for m in LORA_MODES]
ONE_PAIR_EACH = [
    ("llama-bias", "bgmv", "cpu-assisted", 0),
    ("mistral", "mbgmv", "on-demand", 0),
    ("qwen2", "mbgmv", "cpu-assisted", 2),
    ("qwen3", "bgmv", "cached", 0),
]
CASES = [(s, *case) for s in ("int8", "int4") for case in ALL_PAIRS + ONE_PAIR_EACH]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(name, scheme) -> (model dir, reference dir, {adapter: path}), made once per module."""
    return quantized_checkpoints(tmp_path_factory, torch.float32)


@pytest.mark.parametrize(("scheme", "name", "kernel", "lora_mode", "num_cpu_workers"), CASES)
def test_quantized_family_matches_peft_on_dequantized_weights(
    checkpoints, scheme, name, kernel, lora_mode, num_cpu_workers
):
    model_dir, ref_dir, adapters = checkpoints(name, scheme)
    link = 7 * 200 * 4 * 7 * 2 * 8 / 1.0 / 1e9 if lora_mode != "cached" else 0.0
    scored = SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP,
        prompt_logprobs=TOP,
    )  # fmt: skip
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    with running_engine(
        model_dir, adapters, kernel=kernel, lora_mode=lora_mode, max_total_tokens=4096,
        max_batch_size=16, link_gbps=link, num_cpu_workers=num_cpu_workers, prefix_cache=True,
        quantization=scheme,
    ) as engine:  # fmt: skip
        assert engine.model.quantization is Quantization(scheme)
        prompts = first_turn_prompts(engine.model_config.vocab_size)
        first = run(engine, prompts, scored)
        if lora_mode == "cpu-assisted":
            assert engine.lora.host_stats.calls > 0, "no layer ran on the host"
        follow = [(p + out.new_token_ids + [7, 8, 9], a) for (p, a), out in zip(prompts, first)]
        second = run(engine, follow, greedy)
    check_against_reference(ref_dir, adapters, prompts, first)
    for (prompt, a), out in zip(prompts, first):
        check_greedy_teacher_forced(ref_dir, adapters, prompt, out, a, f"{scheme} {name}, {a}")
    for (prompt, a), out in zip(follow, second):
        what = f"{scheme} {name}, {a}, follow-up of {len(prompt)} tokens"
        check_greedy_teacher_forced(ref_dir, adapters, prompt, out, a, what)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_quantized_model_is_not_the_float_model(checkpoints, scheme):
    """The reference above differs from the float checkpoint by more than the tolerance, so the
    test compares against the quantized weights, not by luck against the float ones."""
    from tests.server.engine.test_logprobs_exactness import TOL, reference_logprobs

    model_dir, ref_dir, adapters = checkpoints("llama3", scheme)
    ids = first_turn_prompts(256)[0][0]
    diff = reference_logprobs(ref_dir, adapters, ids, "a3") - reference_logprobs(
        model_dir, adapters, ids, "a3"
    )
    assert diff.abs().max() > 100 * TOL


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_one_stream_through_the_packed_kernel_matches_peft(checkpoints, scheme, monkeypatch):
    """One request at a time, each decode step's one row through torch's packed kernel (float32
    int8 runs every row dequantized unless told otherwise: quant.kernel_max_rows), base and
    adapter rows alike."""
    from toppings.server.model import quant

    monkeypatch.setattr(quant, "kernel_max_rows", lambda dtype, scheme: 1)
    monkeypatch.setattr(quant, "gemv_rows", lambda *args: 0)  # torch's kernel, not the GEMV
    model_dir, ref_dir, adapters = checkpoints("llama3", scheme)
    scored = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=TOP, prompt_logprobs=TOP)  # fmt: skip
    prompts = first_turn_prompts(256)[:3] + first_turn_prompts(256)[-1:]  # a3, a5, a7rs, base
    with running_engine(model_dir, adapters, quantization=scheme, max_total_tokens=4096) as engine:
        assert engine.model.layers[0].gate_up.max_kernel_rows == 1
        assert engine.model.layers[0].gate_up.gemv_rows == 0
        results = [run(engine, [p], scored)[0] for p in prompts]
    check_against_reference(ref_dir, adapters, prompts, results)
    for (prompt, a), out in zip(prompts, results):
        check_greedy_teacher_forced(ref_dir, adapters, prompt, out, a, f"{scheme} one stream, {a}")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_one_stream_through_the_native_gemv_matches_peft(checkpoints, scheme, monkeypatch):
    """float32, one request at a time: each decode step's projections (through the native
    decode path, server/model/decode_path.py) and lm_head (in the same call) run the native
    int8 / int4 GEMV (csrc/gemv_int8.c), base and adapter rows alike; the tokens and logprobs
    are PEFT's on the dequantized weights. (bfloat16 activations: test_gemv_int8.py, per op.)"""
    from toppings.server.model import quant
    from toppings.server.model.decode_path import DecodePath

    if not quant.int8_gemv_works(torch.float32) or not quant.int4_gemv_works(torch.float32):
        pytest.skip("the native GEMVs do not run here")
    rows = []
    run_path = DecodePath.run

    def counted_path(self, model, batch, kv, h, cos, sin):
        rows.append(h.shape[0])
        return run_path(self, model, batch, kv, h, cos, sin)

    to_logits = DecodePath.run_to_logits

    def counted_whole(self, model, batch, kv):
        logits = to_logits(self, model, batch, kv)
        if logits is not None:  # the whole step in one call, lm_head's GEMV included
            rows.append(batch.input_ids.shape[0])
        return logits

    monkeypatch.setattr(DecodePath, "run", counted_path)
    monkeypatch.setattr(DecodePath, "run_to_logits", counted_whole)
    model_dir, ref_dir, adapters = checkpoints("llama3", scheme)
    scored = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=TOP, prompt_logprobs=TOP)  # fmt: skip
    prompts = first_turn_prompts(256)[:3] + first_turn_prompts(256)[-1:]  # a3, a5, a7rs, base
    with running_engine(model_dir, adapters, quantization=scheme, max_total_tokens=4096) as engine:
        assert engine.model.layers[0].gate_up.gemv_rows == quant.GEMV_ROWS
        path = engine.model.decode_path
        kinds = {s.kind for layer in path._layers for s in layer.structs}
        assert kinds == {GemvKind.INT8 if scheme == "int8" else GemvKind.INT4}
        assert path._head.kind == GemvKind.INT8  # lm_head is int8 in both schemes, in the same call
        results = [run(engine, [p], scored)[0] for p in prompts]
    assert rows and set(rows) == {1}, "the decode steps did not run the native decode path"
    check_against_reference(ref_dir, adapters, prompts, results)
    for (prompt, a), out in zip(prompts, results):
        check_greedy_teacher_forced(ref_dir, adapters, prompt, out, a, f"{scheme} GEMV, {a}")
