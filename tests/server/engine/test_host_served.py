"""Under cpu-assisted a request whose adapter finds no device room runs at once on the host
(server/adapters/host_served.py), gives transformers + PEFT's greedy tokens there, and moves to
the device when room frees, keeping its tokens; nothing it held stays held."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_memory_balanced
from tests.server.engine.test_adapter_packing import drive
from tests.server.engine.test_chunked_prefill import build_engine
from tests.server.engine.test_exactness import NEW_TOKENS, assert_same_greedy, reference_greedy
from toppings.gpu_lora.adapter_pool import AdapterPool
from toppings.gpu_lora.peft.adapter import LoraAdapter
from toppings.scripts.make_adapters import make_random_adapter
from toppings.server.adapters.host_served import HostServed
from toppings.server.config import EngineConfig
from toppings.server.model.loader import load_checkpoint
from toppings.server.requests.request import GenerationRequest, SamplingParams

# The adapters differ in what they adapt: one served on the host may target projections the
# device pool has no tensors for yet.
TARGETS = {
    "w": ("q_proj", "v_proj"),
    "x": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "y": ("gate_proj", "up_proj", "down_proj"),
}
NAMES = tuple(TARGETS)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("host_served")
    return {name: str(make_random_adapter(root / name, tiny_model_dir, rank=8,
                                          target_modules=TARGETS[name], seed=10 + i))
            for i, name in enumerate(NAMES)}  # fmt: skip


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(7)
    return {n: torch.randint(3, 200, (4 + 3 * i,), generator=gen).tolist()
            for i, n in enumerate(NAMES)}  # fmt: skip


def _engine(model_dir, adapters, mode: str, room_for: tuple[str, ...], workers: int = 0):
    """An unstarted engine whose device adapter memory holds the adapters `room_for` at once
    (host LoRA on `workers` CPU worker processes; 0: in process)."""
    shapes = load_checkpoint(str(model_dir), "dummy").config
    pool = AdapterPool(shapes, torch.float32, "cpu")
    room = sum(pool.bytes_for(8, TARGETS[name]) for name in room_for)
    config = EngineConfig(dtype="float32", lora_mode=mode, adapter_cache_bytes=room,
                          max_total_tokens=4096, max_batch_size=8,
                          num_cpu_workers=workers)  # fmt: skip
    return build_engine(model_dir, config, adapters)


def _submit(engine, prompts, name: str, new_tokens: int = NEW_TOKENS):
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return engine.submit(GenerationRequest(prompts[name], params, engine.resolve_adapter(name)))


@pytest.mark.parametrize("workers", [0, 1])
def test_requests_past_the_device_room_start_at_once_on_the_host(
    tiny_model_dir, adapters, prompts, workers
):
    engine = _engine(tiny_model_dir, adapters, "cpu-assisted", ("y",), workers)
    try:
        # y's request takes the room; w's and x's find none while it runs, and their adapters
        # target projections the device pool has no tensors for (y adapts the MLP only)
        handles = {name: _submit(engine, prompts, name) for name in ("y", "w", "x")}
        engine.step()  # the submissions reach the queue, and are admitted together
        running = [s.request.adapter.name for s in engine.scheduler.running]
        assert running == ["y", "w", "x"], running  # none waits for adapter memory
        assert engine.lora.num_host_served == 2 and engine.lora.num_on_host == 2
        drive(engine, lambda: not engine.scheduler.has_work())
        outputs = {n: h.result(timeout_s=5).new_token_ids for n, h in handles.items()}
        assert engine.lora.num_on_host == 0 and engine.lora.references() == 0
        assert_memory_balanced(engine)
    finally:
        engine.shutdown()
    for name in NAMES:
        ref, margins = reference_greedy(tiny_model_dir, adapters, prompts[name], name)
        assert_same_greedy(outputs[name], ref, margins, f"adapter {name}")


def test_on_demand_waits_for_room_instead(tiny_model_dir, adapters, prompts):
    engine = _engine(tiny_model_dir, adapters, "on-demand", ("y",))
    try:
        handles = [_submit(engine, prompts, name, 2) for name in ("y", "w", "x")]
        engine.step()
        assert len(engine.scheduler.running) <= 1  # the others wait for adapter memory
        drive(engine, lambda: not engine.scheduler.has_work())
        assert all(h.result(timeout_s=5).finish_reason == "length" for h in handles)
        assert engine.lora.num_host_served == 0
    finally:
        engine.shutdown()


def test_a_request_served_on_the_host_moves_to_the_device_and_keeps_its_tokens(
    tiny_model_dir, adapters, prompts
):
    engine = _engine(tiny_model_dir, {n: adapters[n] for n in "wx"}, "cpu-assisted", ("x",))
    try:
        # x's short request takes the room (x is the larger); w runs on the host until it
        # ends, then moves to the device in x's place
        handles = {"x": _submit(engine, prompts, "x", 2), "w": _submit(engine, prompts, "w")}
        engine.step()
        served = next(s for s in engine.scheduler.running if s.request.adapter.name == "w")
        assert isinstance(served.cache_entry, HostServed)
        assert served.cache_entry.device is None
        drive(engine, lambda: served.cache_entry.device is not None)
        w_weights = engine.resolve_adapter("w").weights_id
        assert served.cache_entry.device is engine.lora.cache.entries[w_weights]
        assert not engine.lora.cache.holds(engine.resolve_adapter("x").weights_id)  # evicted
        assert len(served.output_ids) < NEW_TOKENS  # moved while it still decodes
        drive(engine, lambda: not engine.scheduler.has_work())
        output = handles["w"].result(timeout_s=5).new_token_ids
        assert engine.lora.num_promoted == 1
        assert engine.lora.num_on_host == 0 and engine.lora.references() == 0
        assert_memory_balanced(engine)
    finally:
        engine.shutdown()
    ref, margins = reference_greedy(tiny_model_dir, adapters, prompts["w"], "w")
    assert_same_greedy(output, ref, margins, "adapter w")


def test_host_served_reads_as_its_device_entry_once_moved():
    adapter = LoraAdapter(name="a", path="", rank=4, alpha=8.0, scale=2.0,
                          target_modules=("q_proj",), weights={}, num_bytes=0,
                          base_model=None, id=17)  # fmt: skip
    served = HostServed(adapter, num_layers=3)
    assert served.resident.id == 17 and served.resident.rank == 4
    assert served.ticket.layers_ready() == 0 and not served.ticket.done  # every layer on host

    class Entry:
        resident, ticket = object(), object()

    served.device = Entry()
    assert served.resident is Entry.resident and served.ticket is Entry.ticket
