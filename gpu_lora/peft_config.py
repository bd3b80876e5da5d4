"""adapter_config.json of a PEFT LoRA adapter: parse, reject unsupported features, resolve targets.

Only plain LoRA on the seven Llama projections is served; every PEFT feature that would change
the math (DoRA, per-module ranks, biases, ...) is rejected by name, so an adapter either loads
exactly or fails with a message a client can act on.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from toppings.gpu_lora.targets import ATTN_PROJECTIONS, LORA_TARGETS, ModelShapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
MAX_CONFIG_BYTES = 1 << 20  # a PEFT config is a few kB; a larger one is refused unread

# Config fields that must stay at their neutral (falsy) value: each changes the forward pass.
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "fan_in_fan_out": "transposed weights (fan_in_fan_out)",
    "lora_bias": "LoRA biases (lora_bias)",
    "layer_replication": "layer replication",
    "trainable_token_indices": "trainable token embeddings",
    "target_parameters": "parameter targeting (target_parameters)",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
    "megatron_config": "Megatron-parallel layers",
}
# Modules PEFT could wrap in a Llama that this server cannot serve a delta for.
_UNSERVED_MODULES = ("lm_head", "model.embed_tokens")


class AdapterError(ValueError):
    """An adapter directory that cannot be served; the message names the file or field at fault."""


def module_name(layer_idx: int, module: str) -> str:
    """Full name of a projection inside LlamaForCausalLM, as PEFT matches target_modules."""
    parent = "self_attn" if module in ATTN_PROJECTIONS else "mlp"
    return f"model.layers.{layer_idx}.{parent}.{module}"


def read_adapter_config(path: str | os.PathLike) -> dict:
    """Parse adapter_config.json of an adapter directory and check what needs no base model.

    Cheap (no tensors read); returns the parsed dict unchanged. Raises AdapterError.
    """
    root = Path(path)
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a directory"
        raise AdapterError(f"adapter path {str(root)!r} {what}")
    cfg_path = root / CONFIG_FILE
    if not cfg_path.is_file():
        raise AdapterError(f"{CONFIG_FILE} missing in {str(root)!r}")
    try:
        with open(cfg_path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise AdapterError(f"{cfg_path} is larger than {MAX_CONFIG_BYTES} bytes")
        cfg = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{cfg_path} is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise AdapterError(f"{cfg_path} nests its JSON too deeply") from exc
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_path} must hold a JSON object")
    _check_fields(cfg, cfg_path)
    return cfg


def _check_fields(cfg: dict, cfg_path: Path) -> None:
    if cfg.get("peft_type") != "LORA":
        raise AdapterError(
            f"{cfg_path}: peft_type is {cfg.get('peft_type')!r}, only 'LORA' is served"
        )
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise AdapterError(f"{cfg_path}: r must be a positive integer, got {r!r}")
    alpha = cfg.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"{cfg_path}: lora_alpha must be a number, got {alpha!r}")
    if alpha <= 0:
        raise AdapterError(f"{cfg_path}: lora_alpha must be positive, got {alpha!r}")
    if cfg.get("bias", "none") not in (None, "none"):
        raise AdapterError(f"{cfg_path}: bias={cfg['bias']!r} is not supported (only 'none')")
    for field, feature in _UNSUPPORTED.items():
        if cfg.get(field):
            raise AdapterError(f"{cfg_path}: {feature} is not supported ({field}={cfg[field]!r})")
    if cfg.get("layers_pattern") not in (None, "", [], "layers", ["layers"]):
        raise AdapterError(f"{cfg_path}: layers_pattern={cfg['layers_pattern']!r} is not supported")
    layers = cfg.get("layers_to_transform")
    layer_list = [layers] if isinstance(layers, int) else layers
    if layers is not None and (
        not isinstance(layer_list, list)
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layer_list)
    ):
        raise AdapterError(f"{cfg_path}: layers_to_transform must be layer indices, got {layers!r}")
    for field in ("target_modules", "exclude_modules"):
        spec = cfg.get(field)
        if spec is None and field == "exclude_modules":
            continue
        if isinstance(spec, str):
            try:
                re.compile(spec)
            except re.error as exc:
                raise AdapterError(f"{cfg_path}: {field} regex {spec!r} is invalid: {exc}") from exc
        elif not isinstance(spec, list) or not all(isinstance(t, str) for t in spec):
            raise AdapterError(f"{cfg_path}: {field} must be a list of names or a regex string")
        elif field == "target_modules" and not spec:
            raise AdapterError(f"{cfg_path}: target_modules is empty")
        elif field == "target_modules":
            for entry in spec:
                if entry.rsplit(".", 1)[-1] not in LORA_TARGETS:
                    raise AdapterError(
                        f"{cfg_path}: target_modules names unknown module {entry!r}; only "
                        f"{', '.join(LORA_TARGETS)} can carry LoRA here"
                    )


def _matches(spec: str | list[str], key: str) -> bool:
    """PEFT's rule: a string is a regex over the full name, a list entry is a name suffix."""
    if isinstance(spec, str):
        return re.fullmatch(spec, key) is not None
    return any(key == t or key.endswith("." + t) for t in spec)


def resolve_targets(cfg: dict, model_config: ModelShapes, where: str) -> set[tuple[int, str]]:
    """The (layer_idx, module) pairs an adapter config targets on this model, as PEFT decides."""
    names = {
        module_name(i, m): (i, m) for i in range(model_config.num_layers) for m in LORA_TARGETS
    }
    spec = cfg["target_modules"]
    if isinstance(spec, str) and spec.lower() == "all-linear":
        spec = list(LORA_TARGETS)
    entries = [spec] if isinstance(spec, str) else spec
    for entry in entries:
        one = entry if isinstance(spec, str) else [entry]
        unserved = [n for n in _UNSERVED_MODULES if _matches(one, n)]
        if unserved:
            raise AdapterError(
                f"{where}: target_modules {entry!r} selects {unserved[0]}; only "
                f"{', '.join(LORA_TARGETS)} can carry LoRA here"
            )
        if not isinstance(spec, str) and not any(_matches(one, n) for n in names):
            raise AdapterError(
                f"{where}: target_modules entry {entry!r} is not a projection of this "
                f"{model_config.num_layers}-layer model (known: {', '.join(LORA_TARGETS)})"
            )
    targeted = {pair for name, pair in names.items() if _matches(spec, name)}
    exclude = cfg.get("exclude_modules")
    if exclude:
        targeted = {p for p in targeted if not _matches(exclude, module_name(*p))}
    layers = cfg.get("layers_to_transform")
    if layers not in (None, []) and not isinstance(spec, str):  # PEFT ignores it for a regex
        layer_set = {layers} if isinstance(layers, int) else set(layers)
        beyond = sorted(i for i in layer_set if i >= model_config.num_layers)
        if beyond:
            raise AdapterError(
                f"{where}: layers_to_transform names layer {beyond[0]}, but the base model has "
                f"{model_config.num_layers} layers"
            )
        targeted = {p for p in targeted if p[0] in layer_set}
    if not targeted:
        raise AdapterError(
            f"{where}: target_modules {cfg['target_modules']!r} selects no projection"
        )
    return targeted
