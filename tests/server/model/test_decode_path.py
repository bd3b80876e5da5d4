"""The native decode path (server/model/decode_path.py) gives, step for step, the per-op path's
logits bit for bit, in one call a step (its LoRA called from C, and from the embedding rows to
lm_head's logits) and layer by layer (its LoRA from Python): every decode step of mixed base /
adapter batches of 1-4 requests (and of 21 where the GEMV takes that many: AMX's tiles) runs the
three on the same batch and KV (the KV write is the same bytes every way). Against transformers +
PEFT the path is checked by the family exactness tests, which run it by default."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import running_engine
from tests.server.model.family_checkpoints import ALL_TARGETS
from tests.server.model.tiny_families import make_tiny_family
from toppings.gpu_lora.adapter_pool import AdapterPool
from toppings.scripts.make_adapters import make_random_adapter
from toppings.server import native
from toppings.server.model.loader import load_checkpoint
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.sampling.logits_scan import scan_logits

# (family, dtype, base weights): biases on every projection, tied embeddings, each GEMV kind
CASES = [
    ("llama3", "float32", "none"),
    ("llama3", "bfloat16", "none"),
    ("llama-bias", "bfloat16", "none"),
    ("qwen2", "float32", "int8"),
    ("llama-bias", "bfloat16", "int8"),
    ("llama3", "float32", "int4"),
    ("llama3", "bfloat16", "int4"),  # the AVX512_BF16 int4 GEMV (skipped where it does not run)
]


# Wide enough that every projection's GEMV runs on two threads (csrc/common.h's threads_for), so
# that an adapter's LoRA is shared between them (csrc/decode_proj.c, gpu_lora's lora_parts.c).
WIDE = {"hidden_size": 256, "intermediate_size": 512}
WIDE_CASES = [
    ("llama3", "bfloat16", "none"),
    ("llama-bias", "float32", "int8"),
    ("llama3", "bfloat16", "int4"),
]


@pytest.mark.parametrize(("family", "dtype", "quantization"), CASES)
def test_decode_path_equals_the_per_op_path(tmp_path, family, dtype, quantization):
    check_decode_path(tmp_path, family, dtype, quantization)


@pytest.mark.parametrize(("family", "dtype", "quantization"), WIDE_CASES)
def test_decode_path_with_lora_in_the_gemv_threads(tmp_path, family, dtype, quantization):
    check_decode_path(tmp_path, family, dtype, quantization, num_threads=2, shape=WIDE)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_path_runs_host_served_adapters_in_one_call(tmp_path, dtype):
    """Under cpu-assisted with device room for one adapter, a request whose adapter finds no
    room is served on the host (its LoRA from the adapter's host copy): its decode steps run in
    one call too, that LoRA called from C (`LoraHost`), bit for bit the per-op path's; three
    or more served so at once put more projections on q, k, v's input than one C call takes
    (decode_proj.c's HOST_BATCH), at 4 rows too (the float32 GEMV's most)."""
    shapes = load_checkpoint(str(make_tiny_family(tmp_path / "shapes", "llama3")), "dummy").config
    room = AdapterPool(shapes, getattr(torch, dtype), "cpu").bytes_for(8, ALL_TARGETS)
    ranks = {**RANKS, **{f"h{i}": 8 for i in range(6)}}
    batches = (*BATCHES, list(ranks), list(ranks)[-4:])
    hosted = check_decode_path(
        tmp_path, "llama3", dtype, "none", ranks=ranks, batches=batches,
        lora_mode="cpu-assisted", memory_layout="static", adapter_cache_bytes=room,
    )  # fmt: skip
    assert any(hosted), "no decode step had a request served on the host"


RANKS = {"a4": 4, "a8": 8}
# the batches each check submits: past 4 rows, the tiles' GEMV where it runs (AMX)
BATCHES = ([None], ["a4"], [None, "a4", "a8", "a4"], ["a8", None, None], [None, "a4", "a8"] * 7)


def check_decode_path(
    tmp_path, family, dtype, quantization, num_threads=0, shape=None, ranks=RANKS,
    batches=BATCHES, **config,
) -> list[bool]:  # fmt: skip
    """Every decode step's logits, per op, layer by layer and in one call, are equal; returns,
    per one-call step with an adapter, whether runs of it were served from the host."""
    model_dir = make_tiny_family(tmp_path / family, family, **(shape or {}))
    adapters = {
        name: str(
            make_random_adapter(
                tmp_path / name, model_dir, rank=rank, seed=i, target_modules=ALL_TARGETS
            )
        )  # fmt: skip
        for i, (name, rank) in enumerate(ranks.items())
    }
    with running_engine(
        model_dir, adapters, dtype=dtype, quantization=quantization, num_threads=num_threads,
        **config,
    ) as engine:  # fmt: skip
        model = engine.model
        path = model.decode_path
        if path is None:
            pytest.skip("no native GEMV for these weights here")
        forward, compared, layered = model.forward, [], []
        layer_by_layer = path._layer_by_layer

        def spy(*args):
            layered.append(path._one_call)
            layer_by_layer(*args)

        path._layer_by_layer = spy
        to_logits, whole = path.run_to_logits, []

        def whole_step(*args):
            logits = to_logits(*args)
            whole.append((path._one_call, logits is not None))
            return logits

        path.run_to_logits = whole_step
        lora_step, hosted = path._lora_step, []

        def lora_spy(*args):
            step = lora_step(*args)
            hosted.append(step is not None and bool(step.host.procs))
            return step

        path._lora_step = lora_spy

        def all_three(batch, kv):
            if batch.is_prefill or not path.fits(model, batch, kv):
                return forward(batch, kv)
            model.decode_path = None
            per_op = forward(batch, kv)[0]
            model.decode_path = path
            path._one_call = False
            by_layer = forward(batch, kv)[0]
            path._one_call = True
            native, scanned = forward(batch, kv)
            equal = torch.equal(per_op, native) and torch.equal(per_op, by_layer)
            if scanned is not None:  # the one-call step's own scan: scan_logits' answers
                equal &= scanned == scan_logits(per_op)
            compared.append((batch.input_ids.shape[0], equal, scanned is not None))
            return native, scanned

        model.forward = all_three
        params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
        for names in batches:
            requests = [
                GenerationRequest(
                    [3 + i, 9, 27, 5 + 2 * i] * (i + 1), params, engine.resolve_adapter(name)
                )  # fmt: skip
                for i, name in enumerate(names)
            ]
            for handle in engine.submit_all(requests):
                handle.result(timeout_s=120)
        model.forward = forward
    assert {rows for rows, _, _ in compared} >= {1, 3}
    if path.max_rows > 4:
        assert max(rows for rows, _, _ in compared) > 16  # the tiles' 17-32 rows too
    assert all(equal for _, equal, _ in compared), compared
    # every step ran layer by layer when asked, and in one call (its LoRA from C included)
    # otherwise, wherever the native silu runs (AVX-512, or AVX2 + FMA)
    assert path._one_call == silu_runs_natively()
    assert not any(layered)  # never layer by layer for a step's LoRA
    # in one call, the embedding rows to the logits too (run_to_logits) where lm_head has a
    # native GEMV: every tiny family's here
    assert path.whole_step or not path._one_call
    assert whole and all(ran == one_call for one_call, ran in whole), whole
    assert all(was_scanned == path._one_call for _, _, was_scanned in compared)
    assert len(layered) == len(compared) * (1 if path._one_call else 2)
    return hosted


def silu_runs_natively() -> bool:
    """Whether the native silu_mul (which decode_layers needs) runs in this build."""
    gate_up, out = torch.zeros(1, 32), torch.empty(1, 16)
    lib = native.library()
    return lib.silu_mul(gate_up.data_ptr(), 32, out.data_ptr(), 1, 16, 0, 1) == 0


@pytest.mark.skipif(os.environ.get("TOPPINGS_NATIVE_CFLAGS") is not None, reason="the inner run")
def test_the_avx2_build_runs_the_step_in_one_call_and_exactly(tmp_path):
    """The library as an AVX2-only CPU builds it (-mno-avx512f: the AVX2 GEMVs, the AVX2 silu,
    the LoRA kernel's scalar path, no lora_parts.c) runs the exactness tests above, one call a
    step included: the wide case's LoRA then runs after each GEMV instead of within it."""
    flags = set(open("/proc/cpuinfo").read().split())
    if not {"avx2", "fma"} <= flags:
        pytest.skip("this CPU cannot run the AVX2 build")
    env = dict(os.environ, TOPPINGS_NATIVE_CFLAGS="-mno-avx512f", TOPPINGS_CACHE_DIR=str(tmp_path))
    cases = "llama3-bfloat16-none or qwen2-float32-int8"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", cases],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "3 passed" in result.stdout  # the two cases, and the wide bfloat16 one


def test_a_token_id_or_position_outside_the_tables_is_refused_not_read(tmp_path):
    """The one-call step gathers the embedding and RoPE rows in C: an id or position past their
    tables raises IndexError as the per-op path's indexing does, instead of reading past them."""
    from dataclasses import replace

    model_dir = make_tiny_family(tmp_path / "llama3", "llama3")
    with running_engine(model_dir, {}, dtype="bfloat16") as engine:
        model = engine.model
        if model.decode_path is None or not model.decode_path.whole_step:
            pytest.skip("no whole-step native call here")
        forward, refused = model.forward, []

        def bad_first(batch, kv):
            if not refused and not batch.is_prefill:
                vocab, positions = model.embed.shape[0], model.cos.shape[0]
                for bad in (replace(batch, input_ids=batch.input_ids + vocab),
                            replace(batch, positions=batch.positions + positions)):  # fmt: skip
                    with pytest.raises(IndexError):
                        forward(bad, kv)
                    refused.append(True)
            return forward(batch, kv)

        model.forward = bad_first
        params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
        out = engine.submit(GenerationRequest([3, 9, 27], params, None)).result(timeout_s=120)
        model.forward = forward
    assert refused == [True, True] and len(out.new_token_ids) == 3
