"""Make random PEFT LoRA adapters for a base checkpoint, with the peft library itself.

Each adapter is rescaled so that, on random inputs, every LoRA delta has about `delta_ratio`
times the norm of its projection's base output: large enough to change the model's tokens,
small enough that the base model still shapes them.

    python -m toppings.scripts.make_adapters --base MODEL --out ROOT --ranks 8,16,32,64 \
        [--targets q_proj,v_proj] [--count N] [--seed S] [--rslora] [--delta-ratio 0.2]

MODEL is what `toppings-serve --model` takes: a Hugging Face checkpoint directory, a .gguf file
or the alias smollm2; it is never looked up on the Hugging Face hub.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from toppings.server.model.config import LORA_TARGETS
from toppings.server.model.loader import resolve_model_dir

log = logging.getLogger(__name__)

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj")
NUM_PROBE_ROWS = 64  # random input rows used to measure base and delta output norms


def load_base(base: str | Path) -> PreTrainedModel:
    """The base model in float32, from what toppings-serve --model takes (never from the hub;
    FileNotFoundError when it is missing); adapters record its absolute directory as their base.
    """
    model_dir = resolve_model_dir(str(base)).resolve()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def base_from_config(
    hf_config: PretrainedConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> PreTrainedModel:
    """transformers' model of `hf_config` in `dtype`, every parameter copied from `weights`
    (Hugging Face names; a tied lm_head is the embedding), in eval mode.

    The model is built without transformers' random init, so its memory is one copy of the
    weights: `weights` may be `DummyWeights`, drawing each tensor as it is copied. Raises
    ValueError when the names of `weights` are not the model's parameters.
    """
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.tie_weights()  # skipped with the init: a tied lm_head would be a tensor of its own
    params = dict(model.named_parameters())  # a tied lm_head is listed once, as the embedding
    if sorted(params) != sorted(weights):
        missing, extra = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
        raise ValueError(f"weights do not match the config: missing {missing}, extra {extra}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(weights[name])
    return model.eval()


def make_random_adapter(
    out_dir: str | Path,
    base_dir: str | Path | PreTrainedModel,
    *,
    rank: int,
    alpha: float | None = None,
    target_modules: Sequence[str] = DEFAULT_TARGETS,
    seed: int = 0,
    use_rslora: bool = False,
    init_std: float | None = None,
    delta_ratio: float = 0.2,
    use_dora: bool = False,
) -> Path:
    """Save a random LoRA adapter (PEFT format) for the checkpoint at `base_dir`; returns out_dir.

    `alpha` defaults to 2 * rank. With `init_std` set, A and B are drawn from N(0, init_std) and
    kept as drawn; otherwise PEFT's random init is rescaled to `delta_ratio` (see module doc).
    `base_dir` may also be a model from `load_base`, which is left as it was. With `use_dora`
    the adapter is DoRA's: each module's magnitude vector is PEFT's (the row norms of the adapted
    weight) times a random factor in [0.75, 1.25] per channel, so the scales matter.
    """
    unknown = [m for m in target_modules if m not in LORA_TARGETS]
    if rank <= 0 or not target_modules or unknown:
        raise ValueError(f"need rank > 0 and targets among {LORA_TARGETS}, got {rank}, {unknown}")
    base = base_dir if isinstance(base_dir, PreTrainedModel) else load_base(base_dir)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank if alpha is None else alpha,
        target_modules=list(target_modules),
        use_rslora=use_rslora,
        init_lora_weights=False,
        use_dora=use_dora,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream untouched
        torch.manual_seed(seed)
        peft_model = get_peft_model(base, config)
        with torch.no_grad():
            for module in peft_model.modules():
                if hasattr(module, "lora_A") and "default" in module.lora_A:
                    _set_weights(module, init_std, delta_ratio)
                    if use_dora:
                        m = module.lora_magnitude_vector["default"].weight  # [out]
                        m.mul_(0.75 + 0.5 * torch.rand(m.shape))
    out = Path(out_dir)
    peft_model.save_pretrained(out)
    peft_model.unload()  # strips the LoRA layers so a loaded base can serve the next adapter
    log.info("adapter r=%d targets=%s saved to %s", rank, ",".join(target_modules), out)
    return out


def _set_weights(layer: torch.nn.Module, init_std: float | None, delta_ratio: float) -> None:
    """Draw or rescale A and B of one PEFT LoRA layer, in place."""
    a = layer.lora_A["default"].weight  # [R, in]
    b = layer.lora_B["default"].weight  # [out, R]
    if init_std is not None:
        a.normal_(0.0, init_std)
        b.normal_(0.0, init_std)
        return
    # Norms are measured in float32 whatever the base's dtype (PEFT keeps A and B in float32).
    weight = layer.get_base_layer().weight.float()  # [out, in]
    x = torch.randn(NUM_PROBE_ROWS, weight.shape[1])  # [T, in]
    base_norm = (x @ weight.T).norm()
    delta_norm = (layer.scaling["default"] * (x @ a.T) @ b.T).norm()
    # Split the factor evenly between A and B so neither ends up tiny or huge.
    factor = math.sqrt(delta_ratio * base_norm.item() / max(delta_norm.item(), 1e-30))
    a.mul_(factor)
    b.mul_(factor)


def make_random_adapters(
    out_root: str | Path,
    base_dir: str | Path,
    ranks: Sequence[int],
    targets: Sequence[str] = DEFAULT_TARGETS,
    seed: int = 0,
    *,
    count: int = 1,
    use_rslora: bool = False,
    delta_ratio: float = 0.2,
) -> list[Path]:
    """`count` adapters per rank in out_root, named `lora-r{rank}-{i}`, each with its own seed."""
    base = load_base(base_dir)
    paths = []
    for rank in ranks:
        for i in range(count):
            paths.append(
                make_random_adapter(
                    Path(out_root) / f"lora-r{rank}-{i}",
                    base,
                    rank=rank,
                    target_modules=targets,
                    seed=seed + len(paths),
                    use_rslora=use_rslora,
                    delta_ratio=delta_ratio,
                )
            )
    return paths


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(r) for r in text.split(",")]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 8,16,64, got {text!r}")
    return ranks


def _targets(text: str) -> tuple[str, ...]:
    targets = tuple(text.split(","))
    if unknown := [t for t in targets if t not in LORA_TARGETS]:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {','.join(LORA_TARGETS)}")
    return targets


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m toppings.scripts.make_adapters", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--base",
        required=True,
        metavar="MODEL",
        help="Hugging Face checkpoint directory, .gguf file, or the alias smollm2",
    )
    parser.add_argument("--out", required=True, type=Path, help="folder for the adapters")
    parser.add_argument(
        "--ranks", required=True, type=_ranks, help="comma-separated, e.g. 8,16,32,64"
    )
    parser.add_argument("--targets", type=_targets, default=DEFAULT_TARGETS)
    parser.add_argument("--count", type=int, default=1, help="adapters per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rslora", action="store_true", help="scale by alpha / sqrt(r)")
    parser.add_argument("--delta-ratio", type=float, default=0.2, help="||delta|| / ||base out||")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    try:
        base_dir = resolve_model_dir(args.base)
    except FileNotFoundError as e:  # one line, as argparse says it: never a hub lookup
        print(f"{parser.prog}: error: --base: {e}", file=sys.stderr)
        sys.exit(2)
    paths = make_random_adapters(
        args.out,
        base_dir,
        args.ranks,
        args.targets,
        args.seed,
        count=args.count,
        use_rslora=args.rslora,
        delta_ratio=args.delta_ratio,
    )
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
