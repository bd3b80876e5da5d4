"""Write small PEFT LoRA directories by hand (any rank, any (layer, projection) pairs), for the
tests of adapter limits: no PEFT model is built, so a large rank costs only its tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from toppings.gpu_lora.peft.config import CONFIG_FILE, WEIGHTS_FILE, module_name
from toppings.gpu_lora.targets import ModelShapes


def write_peft_adapter(
    out_dir: str | Path,
    model: ModelShapes,
    rank: int,
    modules: tuple[str, ...] = ("q_proj",),
    layers: tuple[int, ...] | None = None,
    seed: int = 0,
) -> Path:
    """A PEFT dir of rank `rank` on `modules` of `layers` (None: every layer); returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layer_list = list(range(model.num_layers)) if layers is None else list(layers)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(modules),
        "bias": "none",
        "base_model_name_or_path": model.name,
    }
    if layers is not None:
        config["layers_to_transform"] = layer_list
    (out / CONFIG_FILE).write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layer_list:
        for module in modules:
            h_in, h_out = model.projection_shape(module)
            key = f"base_model.model.{module_name(layer, module)}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, h_in, generator=gen) / h_in
            tensors[f"{key}.lora_B.weight"] = torch.randn(h_out, rank, generator=gen) / rank
    save_file(tensors, str(out / WEIGHTS_FILE))
    return out
