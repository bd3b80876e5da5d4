"""Every Triton LoRA launch a server makes is a variant its start-up warm-up compiles.

A workload of launches through the kernels' public functions (the launch code a step runs), on
the operands of a Llama-3-8B-shaped model (GQA: q, k and v are slices of the fused qkv output),
for BGMV and MBGMV: mixed ranks, decode batches of 1 to 300 requests, prefill steps of up to the
step budget in 1 to 40 segments. Each launch's `plan` key must be one that `variants` lists, and
what Triton would compile for it (KernelSpy: Triton's own specialization of the real arguments)
one that the warm-up launched. A bucket missing from the enumeration fails here.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.gpu_lora.kernel_spy import KernelSpy
from toppings.gpu_lora.kernels import triton_decode, triton_prefill
from toppings.gpu_lora.kernels.variants import LaunchSpace
from toppings.gpu_lora.kernels.warmup import warm_up
from toppings.server.model.config import ModelConfig
from toppings.server.model.kernel_warmup import launch_space

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a CPU: TRITON_INTERPRET=1
DTYPE = torch.bfloat16
MAX_RANK, BUDGET, LAYERS, POOL_ROWS = 64, 2048, 2, 203
ADAPTERS = (  # (rank, targets); None: a base-model request
    (8, ("q_proj", "v_proj")),
    (16, ("q_proj", "k_proj", "v_proj", "o_proj")),
    (32, ("gate_proj", "up_proj", "down_proj")),
    (64, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    (3, ("down_proj",)),
    (1, ("k_proj",)),  # a rank bound of 1: Triton would make it a constant, were it specialized
    None,
)


def llama3_8b(**changes) -> ModelConfig:
    fields = dict(
        name="llama-3-8b-shapes", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=LAYERS, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=5e5, max_position_embeddings=8192, tie_word_embeddings=False,
        eos_token_ids=(0,),
    )  # fmt: skip
    return ModelConfig(**(fields | changes))


class ModelTensors:
    """Inputs, outputs and pool as LlamaModel hands them to the kernels, for up to BUDGET
    tokens: y slices of the fused qkv and gate_up outputs, one layer of each [L, C, H] pool."""

    def __init__(self, config: ModelConfig):
        h, inter = config.hidden_size, config.intermediate_size
        q = config.num_heads * config.head_dim
        kv = config.num_kv_heads * config.head_dim
        self.split = {"qkv": [q, kv, kv], "gate_up": [inter, inter]}
        self.fused = {
            "qkv": torch.empty(BUDGET, q + 2 * kv, dtype=DTYPE, device=DEVICE),
            "gate_up": torch.empty(BUDGET, 2 * inter, dtype=DTYPE, device=DEVICE),
        }
        self.plain = {w: torch.empty(BUDGET, w, dtype=DTYPE, device=DEVICE) for w in {h, q, inter}}
        self.config = config
        self.pool = {}
        for module in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            h_in, h_out = config.projection_shape(module)
            self.pool[module] = tuple(
                torch.zeros(LAYERS, POOL_ROWS, w, dtype=DTYPE, device=DEVICE)[1]
                for w in (h_in, h_out)
            )

    def projections(self, t: int):
        """(module, y [t, H_out], x [t, H_in], lora_a, lora_b) as one layer's LoRA adds them."""
        q, k, v = self.fused["qkv"][:t].split(self.split["qkv"], dim=-1)
        gate, up = self.fused["gate_up"][:t].chunk(2, dim=-1)
        out = {"q_proj": q, "k_proj": k, "v_proj": v, "gate_proj": gate, "up_proj": up}
        for module in ("o_proj", "down_proj"):
            out[module] = self.plain[self.config.hidden_size][:t]
        for module, y in out.items():
            h_in = self.config.projection_shape(module)[0]
            yield module, y, self.plain[h_in][:t], *self.pool[module]


def _unit_args(units, module):
    """offsets, ranks, scales of a step's units for one module, and the step's rank bound."""
    ranks = [a[0] if a is not None and module in a[1] else 0 for a in units]
    offsets = [7 * i for i in range(len(units))]
    to = {"dtype": torch.int32, "device": DEVICE}
    scales = torch.ones(len(units), dtype=torch.float32, device=DEVICE)
    return torch.tensor(offsets, **to), torch.tensor(ranks, **to), scales, max(ranks)


def run_workload(kernel: str, tensors: ModelTensors) -> None:
    """Decode steps of 1..300 requests and prefill steps of up to BUDGET tokens, LoraBatch's
    calls (the rank bound: the step's largest rank of the module; modules no unit adapts skip)."""
    rng = random.Random(63)
    decode = getattr(triton_decode, f"{kernel}_decode")
    prefill = getattr(triton_prefill, f"{kernel}_prefill")
    for batch in range(1, 301):
        if batch <= 2 * len(ADAPTERS):  # one adapter alone: every rank is a step's bound
            units = [ADAPTERS[batch % len(ADAPTERS)]] * batch
        else:
            units = [rng.choice(ADAPTERS) for _ in range(batch)]
        for module, y, x, a, b in tensors.projections(batch):
            offsets, ranks, scales, bound = _unit_args(units, module)
            if bound:
                decode(y, x, a, b, offsets, ranks, scales, bound)
    counts = [*range(1, 70), 100, 127, 128, 129, 255, 256, 257, 511, 1000, 1024, 2047, BUDGET]
    for tokens in counts:
        for segments in sorted({1, 2, 3, 7, min(tokens, 40)}):
            if segments > tokens:
                continue
            cuts = sorted(rng.sample(range(1, tokens), segments - 1)) if segments > 1 else []
            starts = torch.tensor([0, *cuts, tokens], dtype=torch.int32, device=DEVICE)
            units = [rng.choice(ADAPTERS) for _ in range(segments)]
            for module, y, x, a, b in tensors.projections(tokens):
                offsets, ranks, scales, bound = _unit_args(units, module)
                if bound:
                    prefill(y, x, a, b, starts, offsets, ranks, scales, bound)


@pytest.fixture(scope="module")
def model_tensors():
    return ModelTensors(llama3_8b())


@pytest.mark.parametrize("kernel", ["bgmv", "mbgmv"])
def test_every_launch_is_a_variant_the_warm_up_compiles(kernel, model_tensors, monkeypatch):
    config = model_tensors.config
    space = launch_space(config, DTYPE, kernel, MAX_RANK, BUDGET, DEVICE)
    listed = set(triton_decode.variants(space)) | set(triton_prefill.variants(space))
    warmed = KernelSpy()
    with warmed.installed(monkeypatch):
        result = warm_up(space, DEVICE)
    assert result.num_variants == len(listed)

    planned = set()
    for module in (triton_decode, triton_prefill):

        def spied_plan(*args, _plan=module.plan):
            made = _plan(*args)
            planned.add(made.key)
            return made

        monkeypatch.setattr(module, "plan", spied_plan)
    launched = KernelSpy()
    with launched.installed(monkeypatch):
        run_workload(kernel, model_tensors)

    assert planned - listed == set(), "launches planned variants the enumeration does not list"
    missing = launched.seen - warmed.seen
    assert not missing, f"{len(missing)} launches would compile on the request path: {missing}"
    # The workload reaches most of what is listed: the enumeration is not a blanket superset.
    assert {k.kernel for k in planned} == {"decode", "prefill"}
    assert {k.block_m for k in planned if k.kernel == "prefill"} == {16, 32, 64}
    if kernel == "bgmv":
        assert {k.block_r for k in planned if k.kernel == "decode"} == {1, 4, 8, 16, 32, 64}


def test_a_step_varying_value_makes_no_variant():
    """The rank bound, the token count and the split count change from step to step; with the
    same operands they leave the key alone (one variant per rank bucket in BGMV, one in all
    for MBGMV)."""
    space = launch_space(llama3_8b(), DTYPE, "bgmv", MAX_RANK, BUDGET, DEVICE)
    ops = space.operands[0]
    keys = {
        triton_decode.plan(ops, (torch.int32,) * 2, bound, padded, tokens).key
        for padded, bound in [(True, 33), (True, 40), (True, 64), (False, 1), (False, 64)]
        for tokens in (1, 2, 15, 16, 17, 64, 255, 256, 300)
    }
    assert len(keys) == 2  # BGMV's tile of 64 rows, and MBGMV's chunks


def test_the_warm_up_runs_every_variant():
    """Every variant of a small model's space launched for real (the interpreter on a CPU)."""
    config = llama3_8b(hidden_size=64, intermediate_size=176, num_heads=4, num_kv_heads=2,
                       head_dim=16)  # fmt: skip
    for kernel in ("bgmv", "mbgmv"):
        space = launch_space(config, DTYPE, kernel, 32, 128, DEVICE)
        ran = KernelSpy(run=True)
        with pytest.MonkeyPatch.context() as monkeypatch, ran.installed(monkeypatch):
            result = warm_up(space, DEVICE)
        assert result.decode_variants == len(triton_decode.variants(space))
        assert result.prefill_variants == len(triton_prefill.variants(space))
        assert len({label for label, _ in ran.seen}) == 4  # both kernels of both modules


def test_rank_buckets_reach_the_top_of_the_rank_bound():
    space = LaunchSpace(True, 48, (), 40)
    assert space.rank_bounds() == [1, 2, 4, 8, 16, 32, 48]
    assert space.tokens_per_segment() == [1, 2, 4, 8, 16, 32, 40]
