"""PEFT LoRA adapters on disk: load adapter_model.safetensors, checked against the base model.

An adapter directory holds `adapter_config.json` (see peft_config) and
`adapter_model.safetensors`, as written by `PeftModel.save_pretrained`.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from toppings.gpu_lora.peft_config import (
    CONFIG_FILE,
    PICKLE_FILE,
    WEIGHTS_FILE,
    AdapterError,
    module_name,
    read_adapter_config,
    resolve_targets,
)
from toppings.gpu_lora.targets import ATTN_PROJECTIONS, LORA_TARGETS, ModelShapes

__all__ = [
    "AdapterError",
    "AdapterShape",
    "LoraAdapter",
    "inspect_peft_adapter",
    "load_peft_adapter",
    "read_adapter_config",
]


# PEFT's names for the tensors it saves; `.default` appears when the adapter name was kept.
_KEY_RE = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(\.default)?\.weight"
)
KEY_FORMAT = "base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight"


@dataclass(frozen=True)
class LoraAdapter:
    """One LoRA adapter in host memory, float32 (glossary: R rank, H hidden).

    `weights[(layer_idx, module)] = (A [R, in_features], B [out_features, R])`, so the delta of
    a projection is `scale * x @ A.T @ B.T`.
    """

    name: str
    path: str
    rank: int
    alpha: float
    scale: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    num_bytes: int
    base_model: str | None

    def bytes_at(self, dtype: torch.dtype) -> int:
        """Bytes of all A and B when held at `dtype` (what a device copy at that dtype moves)."""
        item = torch.empty((), dtype=dtype).element_size()
        return self.num_bytes // 4 * item


@dataclass(frozen=True)
class AdapterShape:
    """What an adapter directory will hold once loaded, read without reading any tensor.

    rank: adapter_config.json's r; max_rank: the largest rank anywhere, r or the rank dimension
    of any tensor the safetensors header declares (A [R, in], B [out, R]); targeted: the
    (layer_idx, module) pairs it adapts; modules: those projections in LORA_TARGETS order.
    """

    rank: int
    max_rank: int
    targeted: frozenset[tuple[int, str]]
    modules: tuple[str, ...]


def inspect_peft_adapter(path: str | os.PathLike, model_config: ModelShapes) -> AdapterShape:
    """The shape of a PEFT LoRA dir from its config and the safetensors header alone (the
    tensor data is not read), so that limits and charges can be checked before loading.
    Raises AdapterError."""
    root = Path(path)
    cfg = read_adapter_config(root)
    targeted = resolve_targets(cfg, model_config, str(root / CONFIG_FILE))
    weights_path = _weights_path(root)
    ranks = [cfg["r"]]
    try:
        with safe_open(weights_path, framework="pt") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                half = _KEY_RE.fullmatch(key)
                if half is not None and len(shape) == 2:
                    ranks.append(shape[0] if half[4] == "A" else shape[1])
    except Exception as exc:  # the Rust reader raises its own error type for corrupt files
        raise AdapterError(f"{weights_path} is not a readable safetensors file: {exc}") from exc
    modules = {m for _, m in targeted}
    return AdapterShape(
        rank=cfg["r"],
        max_rank=max(ranks),
        targeted=frozenset(targeted),
        modules=tuple(m for m in LORA_TARGETS if m in modules),
    )


def _weights_path(root: Path) -> Path:
    """adapter_model.safetensors of an adapter dir; raises AdapterError naming what is there."""
    weights_path = root / WEIGHTS_FILE
    if not weights_path.is_file():
        if (root / PICKLE_FILE).is_file():
            raise AdapterError(
                f"{str(root)!r} has only {PICKLE_FILE} (a pickle); safetensors only: save the "
                f"adapter with safe_serialization=True to get {WEIGHTS_FILE}"
            )
        raise AdapterError(f"{WEIGHTS_FILE} missing in {str(root)!r}")
    return weights_path


def load_peft_adapter(
    path: str | os.PathLike, model_config: ModelShapes, name: str | None = None
) -> LoraAdapter:
    """Load a PEFT LoRA dir, checked against the base model's shapes. Raises AdapterError."""
    root = Path(path)
    cfg = read_adapter_config(root)
    cfg_where = str(root / CONFIG_FILE)
    targeted = resolve_targets(cfg, model_config, cfg_where)
    weights_path = _weights_path(root)
    try:
        tensors = load_file(weights_path)
    except Exception as exc:  # the Rust reader raises its own error type for corrupt files
        raise AdapterError(f"{weights_path} is not a readable safetensors file: {exc}") from exc

    rank = cfg["r"]
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        pair, half = _parse_key(key, targeted, model_config, weights_path)
        if half in halves.setdefault(pair, {}):
            raise AdapterError(f"{weights_path}: lora_{half} of {module_name(*pair)} appears twice")
        in_f, out_f = model_config.projection_shape(pair[1])
        want = (rank, in_f) if half == "A" else (out_f, rank)
        if tuple(tensor.shape) != want:
            raise AdapterError(
                f"{weights_path}: tensor {key!r} has shape {list(tensor.shape)}, expected "
                f"{list(want)} (r={rank}, base model {model_config.name!r})"
            )
        if not tensor.is_floating_point():
            raise AdapterError(f"{weights_path}: tensor {key!r} has dtype {tensor.dtype}")
        tensor = tensor.to(torch.float32).contiguous()
        if not torch.isfinite(tensor).all():
            raise AdapterError(f"{weights_path}: tensor {key!r} holds NaN or inf")
        halves[pair][half] = tensor

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for pair in sorted(targeted, key=lambda p: (p[0], LORA_TARGETS.index(p[1]))):
        found = halves.get(pair, {})
        for half in "AB":
            if half not in found:
                raise AdapterError(
                    f"{weights_path}: lora_{half} of {module_name(*pair)} is missing "
                    f"(target_modules selects it)"
                )
        weights[pair] = (found["A"], found["B"])

    alpha = float(cfg["lora_alpha"])
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    modules = {m for _, m in targeted}
    num_bytes = sum(4 * (a.numel() + b.numel()) for a, b in weights.values())
    return LoraAdapter(
        name=name or root.resolve().name,
        path=str(root),
        rank=rank,
        alpha=alpha,
        scale=scale,
        target_modules=tuple(m for m in LORA_TARGETS if m in modules),
        weights=weights,
        num_bytes=num_bytes,
        base_model=cfg.get("base_model_name_or_path"),
    )


def _parse_key(
    key: str, targeted: set[tuple[int, str]], model_config: ModelShapes, where: Path
) -> tuple[tuple[int, str], str]:
    """Map a saved tensor name to ((layer_idx, module), "A" | "B"), or raise naming it."""
    match = _KEY_RE.fullmatch(key)
    if match is None:
        raise AdapterError(f"{where}: unexpected tensor {key!r} (expected {KEY_FORMAT})")
    layer_idx, parent, module, half = int(match[1]), match[2], match[3], match[4]
    if module not in LORA_TARGETS or (parent == "self_attn") != (module in ATTN_PROJECTIONS):
        raise AdapterError(f"{where}: tensor {key!r} is for unknown module {parent}.{module}")
    if layer_idx >= model_config.num_layers:
        raise AdapterError(
            f"{where}: tensor {key!r} is for layer {layer_idx}, but the base model has "
            f"{model_config.num_layers} layers"
        )
    if (layer_idx, module) not in targeted:
        raise AdapterError(
            f"{where}: tensor {key!r} is for {module_name(layer_idx, module)}, which "
            f"target_modules does not select"
        )
    return (layer_idx, module), half
