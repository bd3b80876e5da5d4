"""LoraBatch puts each request's delta where its layer lives, also when a load ends mid-step."""

from __future__ import annotations

import pytest
import torch

from tests.gpu_lora.test_cache import CONFIG, adapter
from toppings.gpu_lora.adapter_pool import AdapterPool
from toppings.gpu_lora.host_lora import HostLora
from toppings.gpu_lora.kernels import BACKENDS, LoraKernel
from toppings.gpu_lora.loader import LoadTicket
from toppings.gpu_lora.lora_batch import LoraBatch

MODULES = ("q_proj", "k_proj", "v_proj")


def expected(x, adapters, seg_starts, module, layer):
    """y for zero base output: every segment's delta from the host copies, float32."""
    y = torch.zeros(x.shape[0], CONFIG.projection_shape(module)[1])
    for i, a in enumerate(adapters):
        if a is not None and (layer, module) in a.weights:
            wa, wb = a.weights[(layer, module)]
            s, e = seg_starts[i], seg_starts[i + 1]
            y[s:e] = x[s:e] @ wa.T @ wb.T * a.scale
    return y


class CountingHost(HostLora):
    def __init__(self, adapters):
        super().__init__(adapters)
        self.calls = []

    def add(self, layer, x, segments, outputs):
        self.calls.append((layer, tuple(s[0] for s in segments), tuple(m for m, _ in outputs)))
        return super().add(layer, x, segments, outputs)


def cpu_backend(name: str, kernel: str):
    """The CPU backend `name` of BACKENDS for kernel, skipped where it cannot serve it here."""
    backend = BACKENDS[name](LoraKernel(kernel), torch.float32)
    if backend is None:
        pytest.skip(f"backend {name} does not serve {kernel} here")
    return backend


@pytest.mark.parametrize("is_prefill", [True, False])
@pytest.mark.parametrize(
    ("backend", "kernel"), [("cpu", "bgmv"), ("cpu", "mbgmv"), ("native", "mbgmv")]
)
def test_partly_loaded_adapter_mixes_device_and_host_layers(is_prefill, backend, kernel):
    loaded = adapter("loaded", 4, seed=1, targets=("q_proj", "v_proj"))
    loading = adapter("loading", 8, seed=2, targets=("q_proj", "k_proj"))
    pool = AdapterPool(CONFIG, torch.float32, "cpu")
    pool.add(loaded)
    pool.add(loading)  # its rows are all there; the ticket alone says which layers may be used
    host = CountingHost({loaded.id: loaded, loading.id: loading})
    ticket = LoadTicket(CONFIG.num_layers)
    ticket.mark_ready(1)
    seg_starts = [0, 3, 5, 9] if is_prefill else [0, 1, 2, 3]
    order = [loaded, None, loading]
    batch = LoraBatch(
        pool, cpu_backend(backend, kernel),
        [pool.resident[a.id] if a else None for a in order], seg_starts, is_prefill,
        tickets=[LoadTicket.resident(CONFIG.num_layers), None, ticket], host=host,
    )  # fmt: skip
    x = torch.randn(seg_starts[-1], CONFIG.hidden_size)
    for layer in range(CONFIG.num_layers):
        if layer == 2:
            ticket.mark_ready(CONFIG.num_layers)  # the load ends in the middle of the step
        outs = {m: torch.zeros(x.shape[0], CONFIG.projection_shape(m)[1]) for m in MODULES}
        batch.add(layer, x, tuple(outs.items()))
        for m in MODULES:
            torch.testing.assert_close(outs[m], expected(x, order, seg_starts, m, layer))
    # Layer 1 alone ran on the host, for the loading request, in one call for q, k and v.
    assert host.calls == [(1, (loading.id,), ("q_proj", "k_proj", "v_proj"))]
