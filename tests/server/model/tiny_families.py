"""Tiny random checkpoints of every served family, made offline with transformers.

`<Family>Config(...)` -> `<Family>ForCausalLM` -> `save_pretrained`, with the tiny ChatML
tokenizer of scripts/make_tiny_llama.py, so the engine loads them as it loads any checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

# Shapes shared by every family: 2 layers, H 64, 4 heads of D 16, 2 kv heads, vocab 256.
SHAPES = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    initializer_range=0.2,
)  # fmt: skip
# llama3 with a pre-training context of 16: prompts and replies of the exactness tests run
# well past it, through every frequency band (D 16: wavelengths from 6 to ~20000).
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
}  # fmt: skip

# name -> (model_type, config overrides)
CHECKPOINTS = {
    "llama3": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.5}}),
    # dynamic: transformers keeps the unscaled base up to max_position_embeddings (80 here,
    # which the longest test request, 33 + 32 tokens, stays under).
    "llama-dynamic": (
        "llama",
        {
            "rope_parameters": {"rope_type": "dynamic", "factor": 4.0},
            "max_position_embeddings": 80,
        },
    ),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 24}),  # head_dim != H / N, as in real Qwen3 checkpoints
}


def make_tiny_family(out_dir: str | Path, name: str, seed: int = 0, **overrides) -> Path:
    """Save the tiny random checkpoint CHECKPOINTS[name] (plus `overrides`) to out_dir."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from toppings.scripts.make_tiny_llama import make_tokenizer

    model_type, changes = CHECKPOINTS[name]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fields = {**SHAPES, **changes, **overrides}
    tokenizer = make_tokenizer(fields["vocab_size"], fields["max_position_embeddings"])
    config = AutoConfig.for_model(
        model_type,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **fields,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float().eval()
        with torch.no_grad():  # biases and norms start at 0 and 1: make them matter
            for param_name, param in model.named_parameters():
                if param_name.endswith(".bias"):
                    param.normal_(0.0, 0.5)
                elif param_name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.uniform_(0.5, 1.5)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
