"""Tiny family checkpoints with PEFT adapters of odd ranks, and the dequantized reference
checkpoints the quantized engine is compared against (shared by the exactness tests)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.server.model.tiny_families import make_tiny_family
from toppings.server.config import Quantization
from toppings.server.model.quant import quantize

# name -> (rank, use_rslora); every adapter targets all seven projections.
ADAPTERS = {"a3": (3, False), "a5": (5, False), "a7rs": (7, True)}
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def family_with_adapters(root: Path, name: str, **overrides) -> tuple[Path, dict[str, str]]:
    """The tiny checkpoint CHECKPOINTS[name] (plus `overrides`) under root/model and the
    ADAPTERS made for it: (model dir, {adapter: path})."""
    from toppings.scripts.make_adapters import load_base, make_random_adapter

    model_dir = make_tiny_family(root / "model", name, **overrides)
    base = load_base(model_dir)
    adapters = {}
    for seed, (a, (rank, rslora)) in enumerate(ADAPTERS.items()):
        path = make_random_adapter(
            root / a, base, rank=rank, target_modules=ALL_TARGETS, seed=seed, use_rslora=rslora
        )
        adapters[a] = str(path)
    return model_dir, adapters


def dequantized_reference(
    model_dir: Path, scheme: Quantization, out_dir: Path, dtype: torch.dtype = torch.float32
) -> Path:
    """A copy of the checkpoint at model_dir whose projections hold dequant(quant(W)) in `dtype`,
    the weight an engine of that dtype multiplies by (lm_head int8, untied from the embedding
    where they were tied, since the embedding lookup stays float)."""
    shutil.copytree(model_dir, out_dir)
    (path,) = out_dir.glob("*.safetensors")
    state = load_file(str(path))
    for name, weight in list(state.items()):
        if name.endswith(".weight") and name.split(".")[-2] in ALL_TARGETS:
            state[name] = quantize(weight, scheme).dequantize(dtype)
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    state["lm_head.weight"] = quantize(head, Quantization.INT8).dequantize(dtype)
    save_file(state, str(path), metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def quantized_checkpoints(tmp_path_factory, dtype: torch.dtype, widths: dict | None = None):
    """(name, scheme) -> (model dir, reference dir, {adapter: path}), each made once on first
    use; the reference is the model itself for scheme "none". `widths` maps extra names to
    (family, config overrides)."""
    made: dict = {}
    bases: dict = {}

    def get(name: str, scheme: str):
        if name not in bases:
            root = tmp_path_factory.mktemp(name)
            family, overrides = (widths or {}).get(name, (name, {}))
            bases[name] = (root, *family_with_adapters(root, family, **overrides))
        if (name, scheme) not in made:
            root, model_dir, adapters = bases[name]
            ref = model_dir
            if scheme != "none":
                out = root / f"ref_{scheme}"
                ref = dequantized_reference(model_dir, Quantization(scheme), out, dtype)
            made[name, scheme] = (model_dir, ref, adapters)
        return made[name, scheme]

    return get
