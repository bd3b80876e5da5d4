"""What bench_memory compares: the adapters, the memory sizes, and the three engine configs.

One total device budget (BUDGET bytes) for every config:
- `static`: today's split. FastLibra's vLLM baseline gives adapters 20% of the budget, so
  ADAPTER_BYTES = 0.2 * BUDGET and the KV cache gets KV_TOKENS = (BUDGET - ADAPTER_BYTES) /
  slot_bytes, slot_bytes = 2 (K and V) * L * K * D * 4 (float32) bytes per token.
- `pool`: one pool of BUDGET bytes for KV and adapters, no prefix reuse.
- `pool_prefix`: the same pool with KV prefix reuse per adapter and a host tier of HOST bytes.
All three use lora mode cpu-assisted (adapters are loaded on a miss, the layers not loaded yet
run their LoRA on the host) and the same emulated link for adapter loads and, in `pool_prefix`,
KV swaps.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from toppings.gpu_lora.peft.adapter import load_peft_adapter
from toppings.scripts.make_adapters import load_base, make_random_adapter
from toppings.server.config import EngineConfig
from toppings.server.memory.layout import kv_slot_bytes
from toppings.server.model.config import ModelConfig

log = logging.getLogger("bench_memory")
CONFIGS = ("static", "pool", "pool_prefix")
STATIC_ADAPTER_SHARE = 0.2  # FastLibra's vLLM baseline: 20% of the memory for adapters
TARGETS = ("q_proj", "k_proj", "v_proj")
DTYPE = "float32"


def make_adapters(root: Path, model_dir: Path, ranks: list[int], num: int) -> dict[str, str]:
    """`num` adapters, ranks in turn (one made per rank, the others copies of it)."""
    paths, base = {}, None
    for i in range(num):
        rank = ranks[i % len(ranks)]
        name, path, first = f"r{rank}-{i}", root / f"r{rank}-{i}", root / f"r{rank}-first"
        if not (first / "adapter_model.safetensors").is_file():
            base = base or load_base(model_dir)
            make_random_adapter(first, base, rank=rank, target_modules=TARGETS, seed=rank)
        if not (path / "adapter_model.safetensors").is_file():
            shutil.copytree(first, path, dirs_exist_ok=True)
        paths[name] = str(path)
    return paths


@dataclass(frozen=True)
class Sizes:
    """The memory every config gets, in bytes unless named otherwise."""

    budget_bytes: int
    host_bytes: int
    slot_bytes: int  # K and V of one token over all layers
    static_adapter_bytes: int
    static_kv_tokens: int
    pool_kv_tokens: int  # the whole budget as KV
    adapter_bytes_by_rank: dict[int, int]
    total_adapter_bytes: int

    @classmethod
    def of(cls, mc: ModelConfig, adapters: dict[str, str], budget: int, host: int) -> Sizes:
        item = torch.empty((), dtype=getattr(torch, DTYPE)).element_size()
        slot = kv_slot_bytes(mc, item)
        by_name = {n: load_peft_adapter(p, mc) for n, p in adapters.items()}
        by_rank = {a.rank: a.bytes_at(getattr(torch, DTYPE)) for a in by_name.values()}
        total = sum(by_rank[a.rank] for a in by_name.values())
        adapter_bytes = int(STATIC_ADAPTER_SHARE * budget)
        return cls(budget, host, slot, adapter_bytes, (budget - adapter_bytes) // slot,
                   budget // slot, dict(sorted(by_rank.items())), total)  # fmt: skip

    def check(self, max_context: int) -> None:
        """Refuse sizes under which some request of the trace could never run."""
        if max_context > self.static_kv_tokens:
            raise SystemExit(f"a turn may need {max_context} KV tokens; the static split has "
                             f"{self.static_kv_tokens}: raise --budget-mb")  # fmt: skip
        if max(self.adapter_bytes_by_rank.values()) > self.static_adapter_bytes:
            raise SystemExit("the largest adapter does not fit the static split's adapter share")
        if self.total_adapter_bytes <= self.static_adapter_bytes:
            log.warning("every adapter fits the static adapter share: memory does not bind")


def engine_config(**fields) -> tuple[EngineConfig, list[str]]:
    """EngineConfig of the fields it knows, and the names of those it does not (dropped)."""
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    dropped = sorted(set(fields) - known)
    return EngineConfig(**{k: v for k, v in fields.items() if k in known}), dropped


def configs_for(names: list[str], sizes: Sizes, link_gbps: float, max_batch_size: int) -> dict:
    """name -> (EngineConfig, dropped fields). Only `static` may run without the pool's fields
    (today's engine is the static split); the pool configs refuse to."""
    common = dict(dtype=DTYPE, lora_mode="cpu-assisted", link_gbps=link_gbps,
                  max_batch_size=max_batch_size)  # fmt: skip
    fields = {
        "static": dict(memory_layout="static", max_total_tokens=sizes.static_kv_tokens,
                       adapter_cache_bytes=sizes.static_adapter_bytes, prefix_cache=False),
        "pool": dict(memory_layout="pool", memory_bytes=sizes.budget_bytes, prefix_cache=False),
        "pool_prefix": dict(memory_layout="pool", memory_bytes=sizes.budget_bytes,
                            prefix_cache=True, host_memory_bytes=sizes.host_bytes),
    }  # fmt: skip
    configs = {}
    for name in names:
        config, dropped = engine_config(**common, **fields[name])
        if dropped:
            if name != "static":
                raise SystemExit(
                    f"config {name} needs EngineConfig fields {dropped}, which this engine "
                    "lacks (issue 13 not merged): run --configs static"
                )
            log.warning("EngineConfig lacks %s: static runs as today's engine", dropped)
        configs[name] = (config, dropped)
    return configs
