"""Fixtures: random adapters of mixed ranks and targets, their repository, a 2-worker pool."""

from __future__ import annotations

import pytest
from cpu_lora_helpers import QKV, make_adapter, tiny_config

from toppings.cpu_lora import CpuLoraPool, HostRepository


@pytest.fixture(scope="session")
def adapters():
    """Three ranks, three target sets; "late" has LoRA on layer 2 only."""
    return [
        make_adapter("a4", 4, ("q_proj", "k_proj", "v_proj", "o_proj"), seed=1),
        make_adapter(
            "b8",
            8,
            ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
            seed=2,
        ),
        make_adapter("c16", 16, ("q_proj", "v_proj"), seed=3),
        make_adapter("late", 8, QKV, layers=[2], seed=4),
    ]


@pytest.fixture(scope="session")
def repo(adapters):
    repository = HostRepository.create(tiny_config(), capacity_bytes=4 << 20, max_adapters=8)
    for adapter in adapters:
        repository.add(adapter)
    yield repository
    repository.close()


@pytest.fixture(scope="session")
def pool2(repo):
    """Two workers; tests set tokens_per_core to choose how many a call uses."""
    pool = CpuLoraPool(repo, tiny_config(), num_workers=2, max_tokens=128, tokens_per_core=1)
    yield pool
    pool.close()
