"""PEFT LoRA adapters on disk: load adapter_model.safetensors, checked against the base model.

An adapter directory holds `adapter_config.json` (see `config`) and
`adapter_model.safetensors`, as written by `PeftModel.save_pretrained`. The weights file is
opened relative to the directory without following a symlink and checked on the opened file
(gpu_lora.peft.directory), then read (gpu_lora.peft.tensors: by groups where its layout is the
plain one, else by the safetensors library) and checked tensor by tensor against the config
and the base model's shapes.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from toppings.gpu_lora.brief import brief
from toppings.gpu_lora.dora import DoraScales
from toppings.gpu_lora.peft.config import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    adapter_dir,
    check_invocation_tokens,
    module_name,
    read_adapter_config,
    read_config_at,
    resolve_targets,
    shape_mismatch_cause,
)
from toppings.gpu_lora.peft.tensors import (
    abs_max,
    held,
    is_all_finite,
    read_header,
    read_held,
    read_weights,
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
# Ids of adapters not registered with a server (tests, benchmarks): negative, so that they never
# equal a registration's id (server/requests/adapter_ref.py counts up from 1).
_unregistered_ids = itertools.count(-1, -1)


def unregistered_id() -> int:
    """An adapter id no other adapter of this process has had, for one not registered."""
    return next(_unregistered_ids)


_KEY_RE = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(\.default)?\.weight"
)
KEY_FORMAT = "base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight"
# DoRA's magnitude vector m [out_features] of a module (PEFT 0.21 saves it without a suffix).
_MAGNITUDE_RE = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_magnitude_vector"
    r"(\.default)?(\.weight)?"
)


@dataclass(frozen=True)
class LoraAdapter:
    """One LoRA adapter in host memory (glossary: R rank, H hidden), its A and B at one dtype:
    float32, or a bfloat16 engine's bfloat16 (`load_peft_adapter`'s `dtype`; never written in
    place: at the file's own dtype they may share the read's buffers).

    `weights[(layer_idx, module)] = (A [R, in_features], B [out_features, R])`, so the delta of
    a projection is `scale * x @ A.T @ B.T`; a loaded B is the transpose of a contiguous B^T,
    the layout of the pool's rows and the kernels' (`B.T` is contiguous: no copy transposes).
    A DoRA adapter (`use_dora`) also has `magnitudes[(layer_idx, module)] = m [out_features]`
    for the same pairs, and, once the base weights were read (`AdapterReader.open`), `dora`:
    the per-channel scales (gpu_lora.dora).
    An activated LoRA has its `invocation_tokens` (gpu_lora.alora); () for any other.
    `weight_bounds[(layer_idx, module)] = (max |A|, max |B|)` as read (empty: not known), for
    the overflow check (gpu_lora.validate) without another pass over the weights.
    `id` is what the device cache and pool key it by: its registration's id (the server's
    `AdapterRef.id`, set when it is registered), else one made for it alone; never its name,
    which a later registration may hold.
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
    magnitudes: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    dora: DoraScales | None = None
    invocation_tokens: tuple[int, ...] = ()
    id: int = field(default_factory=unregistered_id)
    weight_bounds: dict[tuple[int, str], tuple[float, float]] = field(default_factory=dict)

    @property
    def is_dora(self) -> bool:
        return bool(self.magnitudes)

    def bytes_at(self, dtype: torch.dtype) -> int:
        """Bytes of all A and B when held at `dtype` (what a device copy at that dtype moves)."""
        item = torch.empty((), dtype=dtype).element_size()
        return sum(a.numel() + b.numel() for a, b in self.weights.values()) * item


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
    with adapter_dir(root) as dir_fd:  # both files from the one directory opened here
        cfg = read_config_at(dir_fd, root)
        targeted = resolve_targets(cfg, model_config, str(root / CONFIG_FILE))
        check_invocation_tokens(cfg, model_config.vocab_size, str(root / CONFIG_FILE))
        header = read_header(dir_fd, root)
    ranks = [cfg["r"]]
    for key, info in header.items():
        shape = info.get("shape") if isinstance(info, dict) else None
        half = _KEY_RE.fullmatch(key)
        if half is not None and isinstance(shape, list) and len(shape) == 2:
            ranks.append(int(shape[0] if half[4] == "A" else shape[1]))
    modules = {m for _, m in targeted}
    return AdapterShape(
        rank=cfg["r"],
        max_rank=max(ranks),
        targeted=frozenset(targeted),
        modules=tuple(m for m in LORA_TARGETS if m in modules),
    )


def load_peft_adapter(
    path: str | os.PathLike,
    model_config: ModelShapes,
    name: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> LoraAdapter:
    """Load a PEFT LoRA dir, checked against the base model's shapes. Raises AdapterError.

    dtype: what A and B are held at, float32 or bfloat16 (a bfloat16 engine's: the copies it
    computes from, device rows and the CPU workers' arena, are bfloat16 anyway; held so, they
    take half the memory, and a device load is a plain copy of half the bytes). A DoRA adapter
    is held at float32 whatever `dtype` says: its scales are computed from it.
    """
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"adapters are held at float32 or bfloat16, not {dtype}")
    root = Path(path)
    with adapter_dir(root) as dir_fd:  # both files from the one directory opened here
        cfg = read_config_at(dir_fd, root)
        targeted = resolve_targets(cfg, model_config, str(root / CONFIG_FILE))
        check_invocation_tokens(cfg, model_config.vocab_size, str(root / CONFIG_FILE))
        hold = torch.float32 if cfg.get("use_dora") else dtype
        fast = None if cfg.get("use_dora") else _read_grouped(dir_fd, root, cfg, targeted,
                                                                model_config, hold)  # fmt: skip
        tensors = read_weights(dir_fd, root) if fast is None else {}
    weights_path = root / WEIGHTS_FILE
    rank = cfg["r"]
    magnitudes = _magnitudes(tensors, cfg, targeted, model_config, weights_path)
    if fast is None:
        halves, bounds = _check_each(tensors, magnitudes, rank, targeted, model_config,
                                     weights_path, hold)  # fmt: skip
    else:
        halves, bounds = fast

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
    num_bytes = sum(t.numel() * t.element_size() for pair in weights.values() for t in pair)
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
        magnitudes={pair: m for pair, m in magnitudes.values()},
        invocation_tokens=tuple(cfg.get("alora_invocation_tokens") or ()),
        weight_bounds={pair: (bounds[pair]["A"], bounds[pair]["B"]) for pair in weights},
    )


def _read_grouped(
    dir_fd: int, root: Path, cfg: dict, targeted: set, model_config: ModelShapes, hold
) -> tuple[dict, dict] | None:
    """Each targeted pair's held A and B and their bounds ({pair: {"A": ..., "B": ...}} each)
    by the grouped reader (tensors.read_held), every check of `_check_each` passed; None where
    that reader does not take the file or a check fails (the library's path then names it)."""
    rank, halves_of, seen = cfg["r"], {}, set()

    def want(key: str) -> tuple[str, tuple[int, int]] | None:
        try:
            pair, half = _parse_key(key, targeted, model_config, root)
        except AdapterError:
            return None
        if (pair, half) in seen:
            return None
        seen.add((pair, half))
        halves_of[key] = (pair, half)
        in_f, out_f = model_config.projection_shape(pair[1])
        return half, ((rank, in_f) if half == "A" else (out_f, rank))

    read = read_held(dir_fd, root, want, hold)
    if read is None or len(seen) != 2 * len(targeted):  # a pair's half missing
        return None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    bounds: dict[tuple[int, str], dict[str, float]] = {}
    for key, (tensor, bound) in read.items():
        if not math.isfinite(bound):
            return None
        pair, half = halves_of[key]
        halves.setdefault(pair, {})[half] = tensor
        bounds.setdefault(pair, {})[half] = bound
    return halves, bounds


def _check_each(
    tensors: dict[str, torch.Tensor],
    magnitudes: dict,
    rank: int,
    targeted: set,
    model_config: ModelShapes,
    weights_path: Path,
    hold: torch.dtype,
) -> tuple[dict, dict]:
    """Each pair's held A and B and their bounds from the library's tensors, each checked
    (a known, targeted name once, its shape, a float dtype, finite values); raises AdapterError
    naming the first that fails."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    bounds: dict[tuple[int, str], dict[str, float]] = {}  # max |A|, max |B| of each pair
    for key, tensor in tensors.items():
        if key in magnitudes:
            continue
        pair, half = _parse_key(key, targeted, model_config, weights_path)
        if half in halves.setdefault(pair, {}):
            raise AdapterError(f"{weights_path}: lora_{half} of {module_name(*pair)} appears twice")
        in_f, out_f = model_config.projection_shape(pair[1])
        want = (rank, in_f) if half == "A" else (out_f, rank)
        if tuple(tensor.shape) != want:
            raise AdapterError(
                f"{weights_path}: tensor {brief(key)} has shape {list(tensor.shape)}, expected "
                f"{list(want)} (r={rank}, base model {model_config.name!r}): "
                f"{shape_mismatch_cause(pair[1], half, tensor.shape, want)}"
            )
        if not tensor.is_floating_point():
            raise AdapterError(f"{weights_path}: tensor {brief(key)} has dtype {tensor.dtype}")
        tensor = held(tensor, half, hold)
        bound = abs_max(tensor)
        if not math.isfinite(bound):
            raise AdapterError(f"{weights_path}: tensor {brief(key)} holds NaN or inf")
        halves[pair][half] = tensor
        bounds.setdefault(pair, {})[half] = bound
    return halves, bounds


def _magnitudes(
    tensors: dict[str, torch.Tensor],
    cfg: dict,
    targeted: set[tuple[int, str]],
    model_config: ModelShapes,
    where: Path,
) -> dict[str, tuple[tuple[int, str], torch.Tensor]]:
    """DoRA's magnitude vectors by saved name: key -> ((layer_idx, module), m float32
    [out_features]); one for every targeted module when use_dora, none otherwise."""
    found: dict[str, tuple[tuple[int, str], torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _MAGNITUDE_RE.fullmatch(key)
        if match is None:
            continue
        if not cfg.get("use_dora"):
            raise AdapterError(
                f"{where}: tensor {brief(key)} is a DoRA magnitude, but {CONFIG_FILE} does not set "
                f"use_dora"
            )
        lora_key = f"{key[: match.start(3)]}{match[3]}.lora_A.weight"
        pair, _ = _parse_key(lora_key, targeted, model_config, where)
        want = (model_config.projection_shape(pair[1])[1],)
        if tuple(tensor.shape) != want:
            raise AdapterError(
                f"{where}: tensor {brief(key)} has shape {list(tensor.shape)}, expected "
                f"{list(want)} (the out_features of {pair[1]})"
            )
        if not tensor.is_floating_point():
            raise AdapterError(f"{where}: tensor {brief(key)} has dtype {tensor.dtype}")
        tensor = tensor.to(torch.float32).contiguous()
        if not is_all_finite(tensor):
            raise AdapterError(f"{where}: tensor {brief(key)} holds NaN or inf")
        if any(pair == p for p, _ in found.values()):
            raise AdapterError(f"{where}: the DoRA magnitude of {module_name(*pair)} appears twice")
        found[key] = (pair, tensor)
    if cfg.get("use_dora"):
        have = {pair for pair, _ in found.values()}
        for pair in sorted(targeted, key=lambda p: (p[0], LORA_TARGETS.index(p[1]))):
            if pair not in have:
                raise AdapterError(
                    f"{where}: use_dora is set but the DoRA magnitude (lora_magnitude_vector) "
                    f"of {module_name(*pair)} is missing"
                )
    return found


def _parse_key(
    key: str, targeted: set[tuple[int, str]], model_config: ModelShapes, where: Path
) -> tuple[tuple[int, str], str]:
    """Map a saved tensor name to ((layer_idx, module), "A" | "B"), or raise naming it."""
    match = _KEY_RE.fullmatch(key)
    if match is None and key.endswith(".bias"):  # bias "all" / "lora_only" on a base with biases
        raise AdapterError(f"{where}: tensor {brief(key)} is a trained bias, which is not "
                           "supported (only LoRA's A and B: PEFT's bias='none')")  # fmt: skip
    if match is None:
        raise AdapterError(f"{where}: unexpected tensor {brief(key)} (expected {KEY_FORMAT})")
    layer_idx, parent, module, half = int(match[1]), match[2], match[3], match[4]
    if module not in LORA_TARGETS or (parent == "self_attn") != (module in ATTN_PROJECTIONS):
        raise AdapterError(f"{where}: tensor {brief(key)} is for unknown module {parent}.{module}")
    if layer_idx >= model_config.num_layers:
        raise AdapterError(
            f"{where}: tensor {brief(key)} is for layer {layer_idx}, but the base model has "
            f"{model_config.num_layers} layers"
        )
    if (layer_idx, module) not in targeted:
        raise AdapterError(
            f"{where}: tensor {brief(key)} is for {module_name(layer_idx, module)}, which "
            f"target_modules does not select"
        )
    return (layer_idx, module), half
