"""Opening an adapter directory: the rank limit, the room it will need, then the read.

`AdapterReader.open` reads an adapter's PEFT directory only once its config and safetensors
header (no tensor read yet) passed the rank limit (`--max-lora-rank`, or with 0 the largest
power of two the adapter budget holds: `derived_max_rank`) and what it will occupy fits: in the
device pool (its real row layout), in the node's memory when adapters are charged to KV blocks,
and in the CPU workers' shared arena (adapter_host.py). A DoRA adapter's scales are computed
here, once, from the base model's projections (`CheckpointProjections`: the checkpoint's
tensors by Hugging Face name).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from toppings.gpu_lora.adapter_pool import AdapterPool
from toppings.gpu_lora.cache import AdapterCache
from toppings.gpu_lora.dora import BaseProjections, DoraScales, dora_scales
from toppings.gpu_lora.peft.adapter import (
    AdapterError,
    AdapterShape,
    LoraAdapter,
    inspect_peft_adapter,
    load_peft_adapter,
)
from toppings.gpu_lora.targets import ATTN_PROJECTIONS, LORA_TARGETS
from toppings.server.adapters.host import AdapterHost
from toppings.server.model.config import ModelConfig
from toppings.server.requests.errors import INSUFFICIENT_STORAGE
from toppings.server.requests.request import RequestError

DEFAULT_MAX_LORA_RANK = 256  # --max-lora-rank 0 when adapters have no budget
MAX_DERIVED_LORA_RANK = 512  # the most a limit derived from a budget allows


def derived_max_rank(pool: AdapterPool, budget_bytes: int | None) -> int:
    """--max-lora-rank 0: the largest power of two at which an adapter on the projection of
    smallest rows, in every layer (the least any adapter of that rank occupies), fits in
    `budget_bytes`, at most MAX_DERIVED_LORA_RANK and at least 1; DEFAULT_MAX_LORA_RANK
    without a budget."""
    if budget_bytes is None:
        return DEFAULT_MAX_LORA_RANK
    smallest = min(pool.row_bytes(m) for m in LORA_TARGETS)
    rank = 1
    while 2 * rank <= MAX_DERIVED_LORA_RANK and 2 * rank * smallest <= budget_bytes:
        rank *= 2
    return rank


class AdapterReader:
    """Checks and reads adapter directories for one engine (see the module docstring)."""

    def __init__(
        self,
        model_config: ModelConfig,
        max_lora_rank: int,
        cache: AdapterCache,
        host: AdapterHost,
        base: BaseProjections | None = None,
    ):
        """max_lora_rank: the largest rank served; cache: the device adapter cache (its pool
        and byte budget); host: where registered adapters live on the host (the workers'
        arena); base: the base model's projection weights, read when a DoRA adapter is opened
        (None: DoRA is refused)."""
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.cache = cache
        self.host = host
        self.base = base

    def open(self, path: str, name: str) -> LoraAdapter:
        """Read the adapter directory at `path` as adapter `name`, once its config and its
        safetensors header (no tensor read yet) show a rank within `max_lora_rank` and sizes
        that fit. Raises AdapterError (a bad adapter, or its rank above the limit: a 400) or
        RequestError 507 (larger than the memory it would live in)."""
        shape = inspect_peft_adapter(path, self.model_config)
        if shape.max_rank > self.max_lora_rank:
            raise AdapterError(
                f"{path}: rank {shape.max_rank} is above this server's limit of "
                f"{self.max_lora_rank} (--max-lora-rank)"
            )
        self._check_room(name, shape)
        adapter = load_peft_adapter(path, self.model_config, name=name,
                                    dtype=self.host.weights_dtype)  # fmt: skip
        if adapter.is_dora:
            adapter = dataclasses.replace(adapter, dora=self._dora_scales(adapter))
        return adapter

    def _dora_scales(self, adapter: LoraAdapter) -> DoraScales:
        """The DoRA scales of `adapter`, from the base model's weights (read here, once)."""
        if self.base is None:
            raise AdapterError(f"adapter {adapter.name!r} is a DoRA adapter; this server was "
                               "started without the base weights DoRA needs")  # fmt: skip
        return dora_scales(adapter.name, adapter.scale, adapter.weights, adapter.magnitudes,
                           self.base, self.model_config.num_layers)  # fmt: skip

    def _check_room(self, name: str, shape: AdapterShape) -> None:
        """507 when the adapter's charges exceed the whole memory it would be charged to."""
        device_bytes = self.cache.pool.bytes_for(shape.rank, shape.modules)
        limit = self.cache.max_adapter_bytes()
        if limit is not None and device_bytes > limit:
            raise RequestError(
                f"adapter {name!r} needs {device_bytes} bytes of adapter memory (rank "
                f"{shape.rank} on {', '.join(shape.modules)} in all "
                f"{self.model_config.num_layers} layers), more than the whole adapter budget "
                f"of {limit} bytes",
                507,
                INSUFFICIENT_STORAGE,
            )
        self.host.check_room(name, shape)


class CheckpointProjections:
    """`BaseProjections` over a checkpoint's tensors by Hugging Face name (server.model.weights:
    each read from its file when asked for), for DoRA's scales, on the host where those are
    computed (dummy weights of a CUDA model are drawn there: `Checkpoint.weights_on`)."""

    def __init__(self, weights: Mapping[str, torch.Tensor]):
        self.weights = weights

    def projection(self, layer: int, module: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        parent = "self_attn" if module in ATTN_PROJECTIONS else "mlp"
        prefix = f"model.layers.{layer}.{parent}.{module}."
        bias = self.weights.get(prefix + "bias")
        return self.weights[prefix + "weight"].cpu(), None if bias is None else bias.cpu()
