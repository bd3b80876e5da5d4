"""ContentKey: the host ledger's identity of an adapter's content (gpu_lora/host_memory.py).

Equal contents must share one copy; different contents never, even where the cheap probe cannot
tell them apart; and the full digest is computed only then."""

from __future__ import annotations

import torch

import toppings.gpu_lora.host_memory as host_memory
from toppings.gpu_lora.host_memory import ContentKey, HostAdapterMemory, content_digest
from toppings.gpu_lora.peft.adapter import LoraAdapter

LAYERS, MODULES, RANK, WIDTH = 3, ("q_proj", "v_proj"), 4, 200


def _adapter(seed: int = 0, name: str = "a") -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    weights = {
        (layer, module): (torch.randn(RANK, WIDTH, generator=gen),
                          torch.randn(WIDTH, RANK, generator=gen))
        for layer in range(LAYERS) for module in MODULES
    }  # fmt: skip
    num_bytes = sum(4 * (a.numel() + b.numel()) for a, b in weights.values())
    return LoraAdapter(name, f"/x/{name}", RANK, 8.0, 2.0, MODULES, weights, num_bytes, None)


def _copy(adapter: LoraAdapter, name: str) -> LoraAdapter:
    """The same content in tensors of its own, under another name."""
    weights = {p: (a.clone(), b.clone()) for p, (a, b) in adapter.weights.items()}
    return LoraAdapter(name, f"/x/{name}", adapter.rank, adapter.alpha, adapter.scale,
                       adapter.target_modules, weights, adapter.num_bytes, None)  # fmt: skip


class _Counted:
    """content_digest, counting its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, adapter: LoraAdapter) -> str:
        self.calls += 1
        return content_digest(adapter)


def test_equal_contents_are_equal_keys(monkeypatch):
    counted = _Counted()
    monkeypatch.setattr(host_memory, "content_digest", counted)
    first, second = _adapter(), _copy(_adapter(), "b")
    assert ContentKey(first) == ContentKey(second)
    assert hash(ContentKey(first)) == hash(ContentKey(second))
    assert ContentKey(first).digest == content_digest(second)
    assert counted.calls == 3  # both compared keys, and the digest asked for


def test_contents_the_probe_tells_apart_compute_no_digest(monkeypatch):
    counted = _Counted()
    monkeypatch.setattr(host_memory, "content_digest", counted)
    first, other = _adapter(), _copy(_adapter(), "b")
    other.weights[(0, "q_proj")][0][0, 0] += 1.0  # the first bytes of the first tensor
    assert ContentKey(first) != ContentKey(other)
    other = _copy(_adapter(), "c")
    other.weights[(0, "q_proj")][0][RANK - 1, WIDTH - 1] += 1.0  # its last bytes
    assert ContentKey(first) != ContentKey(other)
    assert ContentKey(_adapter()) != ContentKey(_adapter(seed=1))
    assert counted.calls == 0


def test_a_difference_the_probe_misses_is_found_by_the_digest():
    first, other = _adapter(), _copy(_adapter(), "b")
    other.weights[(1, "v_proj")][1][WIDTH // 2, 1] += 1.0  # a middle module, mid-tensor
    a, b = ContentKey(first), ContentKey(other)
    assert a.probe == b.probe  # the probe cannot tell them apart ...
    assert a != b  # ... the digest does
    assert a.digest == content_digest(first) != content_digest(other) == b.digest


def test_the_ledger_shares_equal_contents_only():
    memory = HostAdapterMemory(1 << 30)
    first = _adapter()
    held, key = memory.shared(first)
    assert memory.charge(1, held, key, first.num_bytes)
    twin, twin_key = memory.shared(_copy(first, "twin"))
    assert twin.weights is first.weights and twin_key is key  # the copy's tensors and key
    assert not memory.charge(2, twin, twin_key, first.num_bytes)
    near = _copy(first, "near")
    near.weights[(1, "v_proj")][1][WIDTH // 2, 1] += 1.0  # same probe, other content
    held_near, near_key = memory.shared(near)
    assert held_near.weights is near.weights
    assert memory.charge(3, held_near, near_key, near.num_bytes)
    assert memory.view()["copies"] == 2 and memory.view()["names"] == 3
    assert not memory.release(1) and memory.release(2) and memory.release(3)
    assert memory.view()["copies"] == 0
