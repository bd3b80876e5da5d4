"""bench_throughput's workload: the model served, the adapters, the prompts.

The model is a checkpoint (`--model`) or a real-size shape with dummy weights (`--model-preset`,
`--dummy CONFIG`): config.json and SmolLM2's tokenizer, written once under the toppings cache.
Adapters are made once per model and target set, on transformers' model of the same weights
(`bench.hf_peft_peer.load_base`), so their scale suits the weights both sides serve.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from bench.hf_peft_peer import load_base
from toppings.scripts.make_adapters import make_random_adapter
from toppings.scripts.make_dummy_model import PRESETS, make_dummy_model
from toppings.server.config import LoadFormat
from toppings.server.model.loader import cache_dir, resolve_model_dir

RANKS = (8, 16, 32, 64)
TARGETS = ("q_proj", "k_proj", "v_proj")
DUMMY_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # the real-size runs' adapters


@dataclasses.dataclass(frozen=True)
class Model:
    """The checkpoint directory served and how its weights are loaded."""

    path: Path
    load_format: LoadFormat


def dummy_model_dir(config: dict, label: str) -> Path:
    """A dummy checkpoint (config.json + SmolLM2's tokenizer) for `config`, written once under
    the toppings cache in a directory named by `label` and the config's hash."""
    text = json.dumps(config, sort_keys=True)
    out = cache_dir() / "dummy" / f"{label}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"
    if not (out / "config.json").is_file():
        make_dummy_model(out, config)
    return out


def pick_model(args) -> Model:
    """The model of --model-preset, --dummy or --model, in that order. --dummy names a
    config.json (served from a dummy checkpoint made for it) or a directory holding config.json
    and a tokenizer (served as it is, with dummy weights)."""
    if args.model_preset:
        return Model(
            dummy_model_dir(PRESETS[args.model_preset], args.model_preset), LoadFormat.DUMMY
        )
    if args.dummy:
        path = Path(args.dummy)
        if path.is_dir():
            return Model(resolve_model_dir(str(path)), LoadFormat.DUMMY)
        return Model(dummy_model_dir(json.loads(path.read_text()), path.stem), LoadFormat.DUMMY)
    return Model(resolve_model_dir(args.model), LoadFormat.AUTO)


def make_workload(args, model: Model, vocab: int, targets: tuple[str, ...]):
    """Adapters (made once per model and targets, on transformers' model of the same weights),
    the first round's prompts, and the adapter of each request."""
    root = Path(args.adapter_dir) / f"{model.path.name}-{'-'.join(targets)}"
    adapters, missing = {}, []
    for i in range(args.num_adapters):
        rank = RANKS[i % len(RANKS)]
        path = root / f"bench-r{rank}-{i}"
        adapters[f"a{i}"] = str(path)
        if not (path / "adapter_config.json").is_file():
            missing.append((path, rank, i))
    if missing:
        base = load_base(model.path, getattr(torch, args.dtype), model.load_format)
        for path, rank, i in missing:
            make_random_adapter(path, base, rank=rank, target_modules=targets, seed=i)
        del base
    prompts = random_prompts(args, vocab, seed=0)
    names = [f"a{i % args.num_adapters}" for i in range(args.num_requests)]
    return adapters, prompts, names


def random_prompts(args, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(100, vocab, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.num_requests)
    ]
