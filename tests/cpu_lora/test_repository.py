"""HostRepository: layout round trip, slot and space reuse, errors, attach by name; adapters
keyed by id."""

from __future__ import annotations

import pytest
import torch
from cpu_lora_helpers import make_adapter, tiny_config

from tests.helpers import adapter_id
from toppings.cpu_lora import LORA_TARGETS, HostRepository, RepositoryFullError, shm


def _assert_holds(repo: HostRepository, adapter, slot: int) -> None:
    for layer in range(repo.num_layers):
        for module in LORA_TARGETS:
            if (layer, module) not in adapter.weights:
                with pytest.raises(KeyError):
                    repo.tensors(slot, layer, module)
                continue
            a, bt = repo.tensors(slot, layer, module)
            want_a, want_b = adapter.weights[(layer, module)]
            assert torch.equal(a, want_a) and torch.equal(bt, want_b.T)


def test_round_trip_and_reuse_after_remove(adapters):
    repo = HostRepository.create(tiny_config(), capacity_bytes=1 << 20, max_adapters=4)
    try:
        slots = [repo.add(a) for a in adapters]
        assert slots == [0, 1, 2, 3] and repo.ids() == [a.id for a in adapters]
        for adapter, slot in zip(adapters, slots):
            _assert_holds(repo, adapter, slot)
            entry = repo.entry(slot)
            assert (entry["rank"], entry["scale"]) == (adapter.rank, adapter.scale)
        free_before = repo.free_bytes
        repo.remove(adapter_id("b8"))
        assert repo.lookup(adapter_id("b8")) is None and repo.free_bytes > free_before
        newcomer = make_adapter("d8", 8, ("q_proj", "down_proj"), seed=9)
        assert repo.add(newcomer) == slots[1]  # the freed slot, and first fit reuses its range
        assert (
            repo.entry(slots[1])["data_offset"]
            == repo.entry(0)["data_offset"] + repo.entry(0)["data_bytes"]
        )
        _assert_holds(repo, newcomer, slots[1])
        for adapter, slot in zip(adapters, slots):  # the others were not disturbed
            if adapter.name != "b8":
                _assert_holds(repo, adapter, slot)
        with pytest.raises(ValueError, match="already"):
            repo.add(newcomer)
    finally:
        repo.close()
    assert repo.name.lstrip("/") not in shm.leftovers()


def test_full_arena_and_table_raise():
    small = make_adapter("s", 4, ("q_proj",))
    repo = HostRepository.create(tiny_config(), capacity_bytes=16384, max_adapters=8)
    try:
        assert repo.block_bytes(small) <= 16384 < 2 * repo.block_bytes(small)
        repo.add(small)
        with pytest.raises(RepositoryFullError, match="no room"):
            repo.add(make_adapter("big", 64, LORA_TARGETS))
    finally:
        repo.close()
    repo = HostRepository.create(tiny_config(), capacity_bytes=1 << 20, max_adapters=1)
    try:
        repo.add(small)
        with pytest.raises(RepositoryFullError, match="slots"):
            repo.add(make_adapter("t", 4, ("q_proj",)))
    finally:
        repo.close()


def test_rejects_wrong_shapes(repo):
    bad = make_adapter("bad", 4, ("q_proj",))
    a, b = bad.weights[(0, "q_proj")]
    bad.weights[(0, "q_proj")] = (a[:, :-1], b)
    with pytest.raises(ValueError, match="expected"):
        repo.add(bad)


def test_attach_reads_the_same_bytes(repo, adapters):
    other = HostRepository.attach(repo.name)
    try:
        c16 = adapter_id("c16")
        assert other.lookup(c16) == repo.lookup(c16) and other.lookup(adapter_id("nope")) is None
        _assert_holds(other, adapters[2], other.lookup(c16))
        with pytest.raises(PermissionError):
            other.remove(c16)
    finally:
        other.close()
    assert repo.lookup(c16) is not None  # attaching and closing leaves the owner's adapter


def test_bfloat16_arena(adapters):
    repo = HostRepository.create(tiny_config(), 1 << 20, dtype=torch.bfloat16)
    try:
        slot = repo.add(adapters[1])
        a, bt = repo.tensors(slot, 1, "gate_proj")
        want_a, want_b = adapters[1].weights[(1, "gate_proj")]
        assert a.dtype == torch.bfloat16
        assert torch.equal(a, want_a.to(torch.bfloat16)) and torch.equal(bt, want_b.T.bfloat16())
    finally:
        repo.close()
