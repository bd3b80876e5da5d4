"""Make a weightless checkpoint directory for `--load-format dummy`: config.json and a tokenizer.

A benchmark runs a real-size shape (Llama-3.2-1B, Qwen2.5-1.5B, Llama-3.1-8B, Llama-2-7B)
without downloading its weights: the server draws random weights of the config's shapes at
start-up. The tokenizer is copied from another checkpoint (by default SmolLM2's, which
`toppings-serve --model smollm2` fetches and converts once), so text prompts tokenize; its ids
all lie inside these vocabularies.

    python -m toppings.scripts.make_dummy_model OUT --preset llama-3.2-1b
    python -m toppings.scripts.make_dummy_model OUT --config path/to/config.json [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The files a Hugging Face tokenizer directory may hold (the ones present are copied).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

# The published configs' shape fields (what a dummy model needs: no weights, no tokenizer).
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    "qwen2.5-1.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "torch_dtype": "bfloat16",
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    "llama-2-7b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float16",
    },
}


def make_dummy_model(
    out_dir: str | Path,
    config: Mapping[str, Any],
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write `config` as out_dir/config.json next to a copy of `tokenizer_dir`'s tokenizer
    files (None: SmolLM2's, converted once under the toppings cache); returns out_dir."""
    if "model_type" not in config:
        raise ValueError("the config needs a model_type (llama, qwen2, ...)")
    if tokenizer_dir is None:
        from toppings.server.model.loader import resolve_model_dir

        tokenizer_dir = resolve_model_dir("smollm2")
    source = Path(tokenizer_dir)
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if "tokenizer.json" not in copied:
        raise FileNotFoundError(f"{source} has no tokenizer.json to copy")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in copied:
        shutil.copyfile(source / name, out / name)
    (out / "config.json").write_text(json.dumps(dict(config), indent=2))
    log.info("dummy model (%s) written to %s, tokenizer from %s", config["model_type"], out, source)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=sorted(PRESETS), help="a published model's shapes")
    source.add_argument("--config", type=Path, help="a Hugging Face config.json")
    parser.add_argument(
        "--tokenizer", type=Path, help="a checkpoint directory to copy the tokenizer from "
        "(default: SmolLM2's)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    config = PRESETS[args.preset] if args.preset else json.loads(args.config.read_text())
    print(make_dummy_model(args.out, config, args.tokenizer))


if __name__ == "__main__":
    main()
