"""HostLora.add: the native call over the adapters' host tensors adds what the reference does."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.gpu_lora.test_cache import CONFIG, adapter
from toppings.gpu_lora.host_lora import HostLora
from toppings.gpu_lora.kernels import native
from toppings.gpu_lora.peft.adapter import LoraAdapter

MODULES = ("q_proj", "k_proj", "v_proj")


def as_loaded(lora: LoraAdapter, dtype: torch.dtype) -> LoraAdapter:
    """`lora` as load_peft_adapter holds it: at `dtype`, each B over a contiguous B^T."""
    for key, (a, b) in lora.weights.items():
        lora.weights[key] = (a.to(dtype).contiguous(), b.T.to(dtype).contiguous().T)
    return lora


def reference(x, adapters, segments, module, layer) -> torch.Tensor:
    """The deltas in float64 from the held weights: zero outside every segment."""
    y = torch.zeros(x.shape[0], CONFIG.projection_shape(module)[1], dtype=torch.float64)
    for adapter_id, start, end in segments:
        a = adapters[adapter_id]
        if (layer, module) in a.weights:
            wa, wb = (t.double() for t in a.weights[(layer, module)])
            y[start:end] = x[start:end].double() @ wa.T @ wb.T * a.scale
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_matches_the_reference_across_gaps_missing_layers_and_layouts(dtype, monkeypatch):
    """Segments out of order with gaps between them, an adapter on q alone, one without layer
    1, one whose B is a plain [H_out, R] tensor (the general path): every row gets its own
    adapter's delta, the rows between segments none; the native call serves the others."""
    one = as_loaded(adapter("one", 4, seed=1, targets=MODULES), dtype)
    two = as_loaded(adapter("two", 8, seed=2, targets=("q_proj",)), dtype)
    holed = as_loaded(adapter("holed", 2, seed=3, targets=("q_proj", "v_proj")), dtype)
    for module in ("q_proj", "v_proj"):
        del holed.weights[(1, module)]
    plain = adapter("plain", 4, seed=4, targets=MODULES)  # float32, B contiguous
    for key, (a, b) in plain.weights.items():
        plain.weights[key] = (a.to(dtype), b.to(dtype))
    adapters = {a.id: a for a in (one, two, holed, plain)}
    host = HostLora(adapters)
    calls = []
    call_runs = native.call_runs
    monkeypatch.setattr(native, "call_runs", lambda *a: calls.append(1) or call_runs(*a))
    segments = [(two.id, 6, 9), (one.id, 0, 3), (plain.id, 10, 12), (holed.id, 3, 5)]
    x = torch.randn(13, CONFIG.hidden_size).to(dtype)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    for layer in range(CONFIG.num_layers):
        base = {m: torch.randn(13, CONFIG.projection_shape(m)[1]).to(dtype) for m in MODULES}
        outs = {m: y.clone() for m, y in base.items()}
        host.add(layer, x, segments, tuple(outs.items()))
        for m in MODULES:
            want = base[m].double() + reference(x, adapters, segments, m, layer)
            torch.testing.assert_close(outs[m].double(), want, **tol)
            for gap in (5, 9, 12):  # rows of no segment: as they were
                assert torch.equal(outs[m][gap], base[m][gap])
    assert len(calls) == (CONFIG.num_layers if native.available(dtype) else 0)


def test_forget_lets_go_of_an_adapter_its_calls_held():
    """After `forget`, nothing the runner keeps holds the adapter (its host memory is free)."""
    lora = as_loaded(adapter("gone", 4, seed=5, targets=MODULES), torch.float32)
    adapters = {lora.id: lora}
    host = HostLora(adapters)
    x = torch.randn(3, CONFIG.hidden_size)
    outs = tuple((m, torch.zeros(3, CONFIG.projection_shape(m)[1])) for m in MODULES)
    host.add(0, x, [(lora.id, 0, 3)], outs)
    held = weakref.ref(lora)
    adapter_id = lora.id
    del adapters[adapter_id], lora
    host.forget(adapter_id)
    gc.collect()
    assert held() is None
