"""Decode steps through `cuda_graphs.DecodeGraphs` give the tokens eager decode gives.

On CUDA (marked `cuda`) the graphs are captured and replayed for real. On a CPU the same runner
fills the same fixed buffers and runs the same padded forward, but its "graph" calls that
forward instead of replaying a capture: the buckets, padding rows, scratch slot, LoRA row
buffers, eager fallbacks and pool-growth invalidation are checked in CI without a GPU.
Greedy tokens must be identical, except at or after a near tie of the PEFT reference
(test_exactness's rule).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import running_engine
from tests.server.engine.test_exactness import MARGIN, make_adapters, reference_greedy
from toppings.gpu_lora.loader import LoadTicket
from toppings.server.engine.engine import Engine
from toppings.server.model.cuda_graphs import DecodeGraphs
from toppings.server.model.graph_buckets import GraphBuckets, GraphKey
from toppings.server.requests.request import GenerationRequest, SamplingParams

# (prompt length, adapter, new tokens): the batch shrinks 7, 6, ..., 1 as requests end, so it
# pads to buckets 8, 4 and 2 on the way (odd sizes 7, 5, 3 included).
JOBS = [(5, "r8", 4), (17, "r16", 7), (9, None, 10), (33, "r32", 13), (12, "r64", 16),
        (3, "r8", 19), (21, None, 22)]  # fmt: skip
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ]),
]  # fmt: skip


class EagerReplay(DecodeGraphs):
    """CPU stand-in: a 'graph' runs the bucket's padded forward instead of a capture."""

    def _record(self, key):
        graph = SimpleNamespace(replay=lambda: self._forward(key))
        self._graphs[key] = graph
        return graph


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    return make_adapters(tmp_path_factory.mktemp("graph_adapters"), tiny_model_dir)


@contextlib.contextmanager
def start(model_dir, adapters, device: str, graphs: bool, **changes) -> Iterator[Engine]:
    """A running engine with decode graphs or without (on the CPU, EagerReplay stands in for
    them); it shuts down when the `with` block ends."""
    on_gpu = device == "cuda"  # there the pool's default budget is 40% of the free memory
    changes = {"lora_mode": "cached", **changes}  # steps counted from the first: no loads
    with running_engine(
        model_dir, adapters, device=device, max_total_tokens=4096, max_batch_size=16,
        memory_bytes=(256 << 20) if on_gpu else 0, cuda_graphs=graphs if on_gpu else None,
        **changes,
    ) as engine:  # fmt: skip
        if device == "cpu" and graphs:
            buckets = GraphBuckets.for_engine(engine.config.max_batch_size, engine.kv.max_len)
            lora = engine.lora
            engine.runner.graphs = EagerReplay(engine.model, engine.kv, lora.pool,
                                               lora.steps.kernels.decode, buckets)  # fmt: skip
        assert (engine.runner.graphs is not None) == graphs
        yield engine


def generate(engine, jobs, seed: int = 1) -> list[list[int]]:
    """Submitted together (one prefill, shared decode steps); greedy."""
    requests = [
        GenerationRequest(prompt, SamplingParams(max_new_tokens=k, temperature=0.0,
                                                 ignore_eos=True),
                          engine.resolve_adapter(adapter))
        for prompt, (_, adapter, k) in zip(prompts(jobs, seed), jobs)
    ]  # fmt: skip
    return [h.result(timeout_s=300).new_token_ids for h in engine.submit_all(requests)]


def prompts(jobs, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 200, (n,), generator=gen).tolist() for n, _, _ in jobs]


def assert_same(model_dir, adapters, jobs, got, want, seed: int = 1) -> None:
    """got == want per request, unless they part at or after a near tie of the reference."""
    for (_, name, _), prompt, a, b in zip(jobs, prompts(jobs, seed), got, want):
        if a == b:
            continue
        ref, margins = reference_greedy(model_dir, adapters, prompt, name)
        pos = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        assert min(margins[: pos + 1]) < MARGIN, f"adapter {name}: token {pos} differs"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", ["mbgmv", "bgmv"])
def test_graphs_give_the_eager_tokens(tiny_model_dir, adapters, device, kernel):
    outputs, counters = {}, None
    for graphs in (False, True):
        # One step takes every prompt: a budget derived from the measured step times (on a GPU
        # a launch-bound tiny model's are noise) could split them, and a shorter prompt that
        # finishes first would decode once in a mixed step (seen on an H100: 20 replays).
        with start(tiny_model_dir, adapters, device, graphs, kernel=kernel,
                   max_num_batched_tokens=4096) as engine:  # fmt: skip
            outputs[graphs] = generate(engine, JOBS)
            if graphs:
                counters = engine.runner.graphs.counters.copy()
                keys = engine.runner.graphs.keys
    assert [len(t) for t in outputs[True]] == [n for _, _, n in JOBS]
    assert_same(tiny_model_dir, adapters, JOBS, outputs[True], outputs[False])
    # Decode batches 7, 6, 5 pad to 8; 4, 3 to 4; then 2 (r8 and the base model) and 1 (the
    # base model alone: no LoRA calls). Contexts stay under 128 positions.
    assert keys == {GraphKey(8, 128, 64), GraphKey(4, 128, 64), GraphKey(2, 128, 8),
                    GraphKey(1, 128, 0)}, keys  # fmt: skip
    assert counters.replays == max(n for _, _, n in JOBS) - 1, counters  # every decode step
    assert counters.captures == len(keys) and not counters.invalidations, counters


@pytest.mark.parametrize("device", DEVICES)
def test_an_adapter_still_loading_runs_eagerly(tiny_model_dir, adapters, device, monkeypatch):
    """cpu-assisted: while a ticket says layers are missing, steps go eager (host LoRA); once
    every adapter of the batch is resident, the graphs take over."""
    held: dict[int, int] = {}
    ready = LoadTicket.layers_ready

    def slow(ticket):  # the first 150 looks at a ticket see nothing resident
        held[id(ticket)] = held.get(id(ticket), 0) + 1
        return 0 if held[id(ticket)] <= 150 else ready(ticket)

    monkeypatch.setattr(LoadTicket, "layers_ready", slow)
    jobs = [(n, name, 24) for n, name, _ in JOBS[:5]]
    with start(tiny_model_dir, adapters, device, True, lora_mode="cpu-assisted") as engine:
        got = generate(engine, jobs, seed=2)
        counters = engine.runner.graphs.counters.copy()
        assert engine.lora.host_stats.calls > 0
    assert counters.eager["loading"] > 0 and counters.replays > 0, counters
    for (_, name, _), prompt, ours in zip(jobs, prompts(jobs, seed=2), got):
        ref, margins = reference_greedy(tiny_model_dir, adapters, prompt, name)
        assert_same(tiny_model_dir, adapters, [(0, name, 0)], [ours], [ref[: len(ours)]])


@pytest.mark.parametrize("device", DEVICES)
def test_a_growing_adapter_pool_drops_the_graphs(tmp_path, tiny_model_dir, adapters, device):
    """The four adapters fill 120 of the pool's 128 rows; a fifth makes it reallocate its
    tensors, which the captured graphs point into: they must be captured again."""
    from toppings.scripts.make_adapters import make_random_adapter

    with start(tiny_model_dir, adapters, device, True) as engine:
        first = generate(engine, JOBS[:3])
        graphs = engine.runner.graphs
        assert graphs.keys and not graphs.counters.invalidations
        path = make_random_adapter(tmp_path / "big", tiny_model_dir, rank=64, seed=9)
        engine.add_adapter("big", str(path))  # cached mode: resident at once, the pool grew
        again = generate(engine, [(n, "big" if a else None, k) for n, a, k in JOBS[:3]], seed=3)
        assert graphs.counters.invalidations == 1, graphs.counters
        later = generate(engine, JOBS[:3])  # the old adapters' rows, through new graphs
        assert graphs.counters.invalidations == 1 and graphs.counters.replays > 0
    assert [len(t) for t in again] == [k for _, _, k in JOBS[:3]]
    assert_same(tiny_model_dir, adapters, JOBS[:3], later, first)
