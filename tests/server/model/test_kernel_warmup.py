"""The start-up warm-up covers what a served burst launches; nothing compiles after it (cuda).

On a CPU the engine runs the model op by op as on a GPU (no native decode path), with the Triton
LoRA kernels instead of the CPU ones, and its decode steps through the CUDA graphs' forward
(EagerReplay); KernelSpy records what every launch would compile, by Triton's own rules, and
each must be something the warm-up of the engine's `launch_space` launched. This checks
`lora_operands` against llama.py's real layout. On CUDA (marked `cuda`) the engine warms up at
start-up, then a burst of requests of every rank must leave Triton's kernel caches as they were.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu_lora.kernel_spy import KERNELS, KernelSpy
from tests.server.model.test_cuda_graphs import EagerReplay, generate, start
from toppings.gpu_lora.kernels import LoraBackend, get_kernels, triton_decode, triton_prefill
from toppings.gpu_lora.kernels.warmup import warm_up
from toppings.server.adapters import manager as adapter_manager
from toppings.server.config import EngineConfig
from toppings.server.model.graph_buckets import GraphBuckets
from toppings.server.model.kernel_warmup import launch_space

# (prompt length, adapter, new tokens): ranks 8-64 alone and mixed, prompts of 1 to 70 tokens
JOBS = [(1, "r8", 3), (70, "r64", 5), (9, None, 4), (33, "r32", 6), (12, "r16", 7),
        (3, "r8", 2), (40, "r64", 3), (17, None, 2), (5, "r16", 8)]  # fmt: skip
MAX_STEP_TOKENS = 512  # above the burst's total prompt tokens


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    from tests.server.engine.test_exactness import make_adapters

    return make_adapters(tmp_path_factory.mktemp("warmup_adapters"), tiny_model_dir)


def _triton_backend(kernel: str, device: str, dtype: torch.dtype) -> LoraBackend:
    table = get_kernels("triton").table
    return LoraBackend("triton", table[(kernel, "decode")], table[(kernel, "prefill")],
                       padded=kernel == "bgmv")  # fmt: skip


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("kernel", ["bgmv", "mbgmv"])
def test_a_served_burst_launches_only_warmed_variants(
    tiny_model_dir, adapters, kernel, graphs, monkeypatch
):
    monkeypatch.setattr(adapter_manager, "select_lora_backend", _triton_backend)
    served = KernelSpy()
    with served.installed(monkeypatch), start(tiny_model_dir, adapters, "cpu", False,
                                               kernel=kernel) as engine:  # fmt: skip
        monkeypatch.setattr(engine.model, "decode_path", None)  # the GPU's op-by-op forward
        if graphs:
            buckets = GraphBuckets.for_engine(engine.config.max_batch_size, engine.kv.max_len)
            replay = EagerReplay(engine.model, engine.kv, engine.lora.pool,
                                 engine.lora.steps.kernels.decode, buckets)  # fmt: skip
            monkeypatch.setattr(engine.runner, "graphs", replay)
        outputs = generate(engine, JOBS)
        space = launch_space(engine.model_config, engine.model.dtype, kernel,
                             engine.lora.max_lora_rank, MAX_STEP_TOKENS, "cpu")  # fmt: skip
        if graphs:
            assert engine.runner.graphs.counters.replays > 0
    assert [len(t) for t in outputs] == [n for _, _, n in JOBS]
    warmed = KernelSpy()
    with warmed.installed(monkeypatch):
        warm_up(space, "cpu")
    labels = {label for label, _ in served.seen}
    assert {"triton_decode._shrink_kernel", "triton_prefill._expand_kernel"} <= labels
    missing = served.seen - warmed.seen
    assert not missing, f"{len(missing)} launches would compile on the request path: {missing}"


def test_warmup_is_on_with_cuda_and_refused_on_a_cpu():
    assert EngineConfig(device="cuda").use_warmup
    assert not EngineConfig(device="cuda", warmup=False).use_warmup
    assert not EngineConfig(device="cpu").use_warmup
    with pytest.raises(ValueError, match="--warmup on needs --device cuda"):
        EngineConfig(device="cpu", warmup=True)


def _compiled() -> int:
    """Binaries in the kernels' caches, every device (JITFunction.device_caches: the kernel
    cache first)."""
    return sum(
        len(caches[0])
        for module in (triton_decode, triton_prefill)
        for name in KERNELS
        for caches in getattr(module, name).device_caches.values()
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernel", ["bgmv", "mbgmv"])
def test_nothing_compiles_after_the_warm_up(tiny_model_dir, adapters, kernel):
    """A burst of every rank, prefill and decode (graphs on), after a start-up warm-up."""
    with start(tiny_model_dir, adapters, "cuda", True, kernel=kernel, dtype="bfloat16",
               max_num_batched_tokens=MAX_STEP_TOKENS, warmup=True) as engine:  # fmt: skip
        before = _compiled()
        assert before > 0  # the warm-up compiled (or loaded) the variants
        generate(engine, JOBS)
        generate(engine, JOBS[::-1], seed=2)
        assert engine.runner.graphs.counters.replays > 0
        assert _compiled() == before


def _attention_compiled() -> int:
    """Binaries in the paged attention kernels' caches, every device."""
    from toppings.server.model.paged import decode, prefill

    kernels = (decode._split_kernel, decode._merge_kernel, prefill._prefill_kernel)
    return sum(len(caches[0]) for k in kernels for caches in k.device_caches.values())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_attention_kernels_compile_before_the_first_request(tiny_model_dir):
    """The forward run at start-up (step_timing.warm_forward) compiles the paged attention
    kernels; a burst of prompts of 1 to 70 tokens and their decode steps (graphs on) compiles
    none of them again."""
    with start(tiny_model_dir, {}, "cuda", True, dtype="bfloat16",
               max_num_batched_tokens=MAX_STEP_TOKENS) as engine:  # fmt: skip
        before = _attention_compiled()
        assert before > 0
        generate(engine, [(n, None, k) for n, _, k in JOBS])
        assert engine.runner.graphs.counters.replays > 0
        assert _attention_compiled() == before
