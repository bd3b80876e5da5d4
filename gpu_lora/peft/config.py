"""adapter_config.json of a PEFT LoRA adapter: parse, reject unsupported features, resolve targets.

Plain LoRA, DoRA (`use_dora`, gpu_lora/dora.py) and activated LoRA (`alora_invocation_tokens`,
gpu_lora/alora.py) on the seven Llama projections are served;
every other PEFT feature that would change the math (per-module ranks, biases, ...) is rejected
by name, so an adapter either loads exactly or fails with a message a client can act on.

A regex `target_modules` (or `exclude_modules`) is the adapter author's code run on this server:
it is refused over MAX_PATTERN_CHARS, and matched with the `regex` package (the semantics of
PEFT's `re`) under a time budget of REGEX_BUDGET_S for all matches of one adapter, with the GIL
released while it runs (`concurrent=True`), so a catastrophically backtracking pattern fails
the load with an AdapterError instead of stalling the server.

The config is read through gpu_lora.peft.directory: opened relative to the directory without
following a symlink, and checked on the opened file.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import regex

from toppings.gpu_lora.brief import brief
from toppings.gpu_lora.peft.directory import UnsafeFile, open_dir, open_file
from toppings.gpu_lora.targets import ATTN_PROJECTIONS, LORA_TARGETS, ModelShapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
MAX_CONFIG_BYTES = 1 << 20  # a PEFT config is a few kB; a larger one is refused unread
MAX_WEIGHTS_BYTES = 8 << 30  # a rank-256 adapter of a 70B model on every projection is < 8 GiB
MAX_FILE_BYTES = {CONFIG_FILE: MAX_CONFIG_BYTES, WEIGHTS_FILE: MAX_WEIGHTS_BYTES}  # by file
MAX_PATTERN_CHARS = 1000  # a PEFT target regex is a line; a longer one is refused uncompiled
# All regex matches of one adapter together. The GIL is released while a match runs, so the
# budget bounds only the loading thread; an 80-layer model's 560 names match a plain pattern in
# a small fraction of it, so a legitimate pattern stays far below it even on a busy host.
REGEX_BUDGET_S = 0.25
# An invocation sequence is a chat template's role marker, a few tokens (PEFT's examples use
# "<|start_of_role|>assistant<|end_of_role|>"). 256 leaves room for any such marker and bounds
# what each request's activation search compares and what an error about the sequence shows.
MAX_INVOCATION_TOKENS = 256

# Config fields that must stay at their neutral (falsy) value: each changes the forward pass.
_UNSUPPORTED = {
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
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
    "megatron_config": "Megatron-parallel layers",
}
# `init_lora_weights` values with which PEFT, loading the adapter, changes the base model's
# weights too (the principal part taken out of W for PiSSA, ...): served over the unchanged base
# their outputs would be wrong from the first token. PEFT's `save_pretrained(...,
# path_initial_model_for_weight_conversion=...)` saves such an adapter as a plain LoRA.
_BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")  # (prefixes)
# Modules PEFT could wrap in a Llama that this server cannot serve a delta for.
_UNSERVED_MODULES = ("lm_head", "model.embed_tokens")


class AdapterError(ValueError):
    """An adapter directory that cannot be served; the message names the file or field at fault."""


def module_name(layer_idx: int, module: str) -> str:
    """Full name of a projection inside LlamaForCausalLM, as PEFT matches target_modules."""
    parent = "self_attn" if module in ATTN_PROJECTIONS else "mlp"
    return f"model.layers.{layer_idx}.{parent}.{module}"


@contextmanager
def adapter_dir(path: str | os.PathLike) -> Iterator[int]:
    """A descriptor of the adapter directory `path`, for read_config_at and the weights' reader
    (one directory for both files); raises AdapterError when it is missing or not a directory."""
    try:
        dir_fd = open_dir(path)
    except FileNotFoundError:
        raise AdapterError(f"adapter path {os.fspath(path)!r} does not exist") from None
    except NotADirectoryError:
        raise AdapterError(f"adapter path {os.fspath(path)!r} is not a directory") from None
    except OSError as exc:
        raise AdapterError(f"adapter path {os.fspath(path)!r} cannot be opened: {exc}") from None
    try:
        yield dir_fd
    finally:
        os.close(dir_fd)


def read_adapter_config(path: str | os.PathLike) -> dict:
    """Parse adapter_config.json of an adapter directory and check what needs no base model.

    Cheap (no tensors read); returns the parsed dict unchanged. Raises AdapterError.
    """
    with adapter_dir(path) as dir_fd:
        return read_config_at(dir_fd, Path(path))


def read_config_at(dir_fd: int, root: Path) -> dict:
    """read_adapter_config of the directory `dir_fd` (`root` names it in messages)."""
    cfg_path = root / CONFIG_FILE
    try:
        with open_file(dir_fd, CONFIG_FILE, MAX_CONFIG_BYTES) as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:  # grew after the check of the opened file
            raise AdapterError(f"{cfg_path} is larger than {MAX_CONFIG_BYTES} bytes")
        cfg = json.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise AdapterError(f"{CONFIG_FILE} missing in {str(root)!r}") from None
    except UnsafeFile as exc:
        raise AdapterError(f"{root}: {exc}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{cfg_path} is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise AdapterError(f"{cfg_path} nests its JSON too deeply") from exc
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_path} must hold a JSON object")
    _check_fields(cfg, cfg_path)
    return cfg


def _check_base_untouched(cfg: dict, cfg_path: Path) -> None:
    """Refuse what would make PEFT change the base model itself (its initialisation); a bias
    setting is checked here, the biases it saved with the tensors."""
    if cfg.get("bias", "none") not in (None, "none", "all", "lora_only"):
        raise AdapterError(f"{cfg_path}: bias={brief(cfg['bias'])} is not a PEFT bias setting")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise AdapterError(
            f"{cfg_path}: init_lora_weights={brief(init)} changes the base model's weights when "
            "PEFT loads the adapter, which this server does not; save it as a plain LoRA (PEFT's "
            "save_pretrained with path_initial_model_for_weight_conversion)"
        )


def _check_fields(cfg: dict, cfg_path: Path) -> None:
    if cfg.get("peft_type") != "LORA":
        raise AdapterError(
            f"{cfg_path}: peft_type is {brief(cfg.get('peft_type'))}, only 'LORA' is served"
        )
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise AdapterError(f"{cfg_path}: r must be a positive integer, got {brief(r)}")
    alpha = cfg.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"{cfg_path}: lora_alpha must be a number, got {brief(alpha)}")
    if alpha <= 0:
        raise AdapterError(f"{cfg_path}: lora_alpha must be positive, got {brief(alpha)}")
    _check_base_untouched(cfg, cfg_path)
    for field, feature in _UNSUPPORTED.items():
        if cfg.get(field):
            raise AdapterError(
                f"{cfg_path}: {feature} is not supported ({field}={brief(cfg[field])})"
            )
    tokens = cfg.get("alora_invocation_tokens")
    if tokens is not None:
        if (
            not isinstance(tokens, list)
            or not tokens
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)
        ):
            raise AdapterError(
                f"{cfg_path}: alora_invocation_tokens must be a non-empty list of token ids, "
                f"got {brief(tokens)}"
            )
        if len(tokens) > MAX_INVOCATION_TOKENS:
            raise AdapterError(
                f"{cfg_path}: alora_invocation_tokens holds {len(tokens)} token ids; at most "
                f"{MAX_INVOCATION_TOKENS} are accepted"
            )
        if cfg.get("use_dora"):
            raise AdapterError(f"{cfg_path}: activated LoRA with DoRA is not supported")
    if cfg.get("layers_pattern") not in (None, "", [], "layers", ["layers"]):
        raise AdapterError(
            f"{cfg_path}: layers_pattern={brief(cfg['layers_pattern'])} is not supported"
        )
    layers = cfg.get("layers_to_transform")
    layer_list = [layers] if isinstance(layers, int) else layers
    if layers is not None and (
        not isinstance(layer_list, list)
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layer_list)
    ):
        raise AdapterError(
            f"{cfg_path}: layers_to_transform must be layer indices, got {brief(layers)}"
        )
    for field in ("target_modules", "exclude_modules"):
        spec = cfg.get(field)
        if spec is None and field == "exclude_modules":
            continue
        if isinstance(spec, str):
            if len(spec) > MAX_PATTERN_CHARS:
                raise AdapterError(
                    f"{cfg_path}: {field} regex is {len(spec)} characters; at most "
                    f"{MAX_PATTERN_CHARS} are accepted"
                )
            try:
                regex.compile(spec)
            except regex.error as exc:
                raise AdapterError(
                    f"{cfg_path}: {field} regex {brief(spec)} is invalid: {exc}"
                ) from exc
        elif not isinstance(spec, list) or not all(isinstance(t, str) for t in spec):
            raise AdapterError(f"{cfg_path}: {field} must be a list of names or a regex string")
        elif field == "target_modules" and not spec:
            raise AdapterError(f"{cfg_path}: target_modules is empty")
        elif field == "target_modules":
            for entry in spec:
                if entry.rsplit(".", 1)[-1] not in LORA_TARGETS:
                    raise AdapterError(
                        f"{cfg_path}: target_modules names unknown module {brief(entry)}; only "
                        f"{', '.join(LORA_TARGETS)} can carry LoRA here"
                    )


class _Matcher:
    """PEFT's rule for a `target_modules` or `exclude_modules` value, under one time budget.

    A string is a regex over the full module name, a list entry is a name suffix. Every regex
    match of one adapter shares REGEX_BUDGET_S; past it, the load fails naming the field.
    """

    def __init__(self, where: str):
        self.where = where
        self.deadline = time.monotonic() + REGEX_BUDGET_S

    def __call__(self, spec: str | list[str], key: str, field: str = "target_modules") -> bool:
        if not isinstance(spec, str):
            return any(key == t or key.endswith("." + t) for t in spec)
        left_s = self.deadline - time.monotonic()
        try:
            if left_s <= 0:
                raise TimeoutError
            return regex.fullmatch(spec, key, timeout=left_s, concurrent=True) is not None
        except TimeoutError:
            raise AdapterError(
                f"{self.where}: {field} regex {spec[:100]!r} takes too long to match module "
                f"names (over {REGEX_BUDGET_S * 1000:.0f} ms); simplify it or list the modules"
            ) from None


def check_invocation_tokens(cfg: dict, vocab_size: int, where: str) -> None:
    """Refuse an activated LoRA whose invocation tokens are not all ids of the base model's
    vocabulary (`vocab_size`): no prompt could hold them, so the adapter could never apply."""
    tokens = cfg.get("alora_invocation_tokens") or ()
    beyond = [t for t in tokens if t >= vocab_size]
    if beyond:
        raise AdapterError(
            f"{where}: alora_invocation_tokens holds token id {beyond[0]}, past the base "
            f"model's vocabulary of {vocab_size} ids ({len(beyond)} such ids in all)"
        )


def resolve_targets(cfg: dict, model_config: ModelShapes, where: str) -> set[tuple[int, str]]:
    """The (layer_idx, module) pairs an adapter config targets on this model, as PEFT decides."""
    names = {
        module_name(i, m): (i, m) for i in range(model_config.num_layers) for m in LORA_TARGETS
    }
    matches = _Matcher(where)
    spec = cfg["target_modules"]
    if isinstance(spec, str) and spec.lower() == "all-linear":
        spec = list(LORA_TARGETS)
    entries = [spec] if isinstance(spec, str) else spec
    for entry in entries:
        one = entry if isinstance(spec, str) else [entry]
        unserved = [n for n in _UNSERVED_MODULES if matches(one, n)]
        if unserved:
            raise AdapterError(
                f"{where}: target_modules {brief(entry)} selects {unserved[0]}; only "
                f"{', '.join(LORA_TARGETS)} can carry LoRA here"
            )
        if not isinstance(spec, str) and not any(matches(one, n) for n in names):
            raise AdapterError(
                f"{where}: target_modules entry {brief(entry)} is not a projection of this "
                f"{model_config.num_layers}-layer model (known: {', '.join(LORA_TARGETS)})"
            )
    targeted = {pair for name, pair in names.items() if matches(spec, name)}
    exclude = cfg.get("exclude_modules")
    if exclude:
        targeted = {p for p in targeted if not matches(exclude, module_name(*p), "exclude_modules")}
    layers = cfg.get("layers_to_transform")
    if layers not in (None, []) and not isinstance(spec, str):  # PEFT ignores it for a regex
        layer_set = {layers} if isinstance(layers, int) else set(layers)
        beyond = sorted(i for i in layer_set if i >= model_config.num_layers)
        if beyond:
            raise AdapterError(
                f"{where}: layers_to_transform names layer {beyond[0]}, but the base model has "
                f"{model_config.num_layers} layers"
            )
        named = set(spec)  # PEFT takes a module named in full whatever its layer
        targeted = {p for p in targeted if p[0] in layer_set or module_name(*p) in named}
    if not targeted:
        raise AdapterError(
            f"{where}: target_modules {brief(cfg['target_modules'])} selects no projection"
        )
    return targeted


# What each side of a projection measures, for naming the base an adapter was trained on.
_IN_WIDTH = {"o_proj": "attention width (heads x head_dim)", "down_proj": "intermediate size"}
_OUT_WIDTH = {
    "q_proj": "attention width (heads x head_dim)",
    "k_proj": "key/value width (kv heads x head_dim)",
    "v_proj": "key/value width (kv heads x head_dim)",
    "gate_proj": "intermediate size",
    "up_proj": "intermediate size",
}


def shape_mismatch_cause(
    module: str, half: str, found: tuple[int, ...], want: tuple[int, int]
) -> str:
    """The likely cause of a lora_A [R, in] or lora_B [out, R] that does not fit the base."""
    if len(found) != 2:
        return f"a LoRA matrix is 2-D, this one is {len(found)}-D"
    rank_dim, width_dim = (0, 1) if half == "A" else (1, 0)
    if found[width_dim] != want[width_dim]:
        widths = _IN_WIDTH if half == "A" else _OUT_WIDTH
        width = widths.get(module, "hidden size")
        return (
            f"the adapter was likely trained on a base with {width} {found[width_dim]}, "
            f"not {want[width_dim]}"
        )
    return f"its rank {found[rank_dim]} differs from r={want[rank_dim]} in {CONFIG_FILE}"
