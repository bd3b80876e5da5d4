"""The decoder families served, as one table of what differs between them.

Every family here is a Llama-shaped decoder (RMSNorm, rotate-half RoPE, SwiGLU MLP, grouped
query attention); what differs is a few switches, read once from the checkpoint's config by
`ModelConfig.from_hf` into plain fields that the model code consults. Chat templates and stop
tokens are not switches: every family takes them from its own tokenizer and generation config.
Sources for each row: transformers' `models/<family>/modeling_<family>.py` (which projections
have a bias, where q_norm/k_norm apply) and `modeling_rope_utils.py` (the RoPE types).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from toppings.gpu_lora.targets import LORA_TARGETS


class RopeType(enum.Enum):
    """The RoPE variants served (transformers' `rope_parameters["rope_type"]`)."""

    DEFAULT = "default"
    LINEAR = "linear"  # positions divided by `factor`
    DYNAMIC = "dynamic"  # NTK-aware base, grows past max_position_embeddings
    LLAMA3 = "llama3"  # Llama 3.1's per-frequency-band rescaling


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling parameters of a checkpoint; DEFAULT ignores the numbers."""

    rope_type: RopeType = RopeType.DEFAULT
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3: the pre-training context


@dataclass(frozen=True)
class Family:
    """What one decoder family does differently from plain Llama.

    qkv_bias: q/k/v always carry a bias (Qwen2), whatever the config says;
    attention_bias_key / mlp_bias_key: the config attribute that, when true, puts a bias on
    q/k/v/o (resp. gate/up/down), or None where the family has no such switch;
    has_qk_norm: an RMSNorm over each head of q and k (weights [D]) before RoPE (Qwen3).
    """

    name: str
    qkv_bias: bool = False
    attention_bias_key: str | None = None
    mlp_bias_key: str | None = None
    has_qk_norm: bool = False
    rope_types: frozenset[RopeType] = frozenset(RopeType)
    lora_targets: tuple[str, ...] = LORA_TARGETS


# Keyed by the checkpoint's `model_type`. Sliding windows are not a row here: transformers sets
# `sliding_window` only where one applies (Mistral; Qwen with use_sliding_window), and
# ModelConfig.from_hf reads it the same way for every family.
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", attention_bias_key="attention_bias", mlp_bias_key="mlp_bias"),
    "mistral": Family("mistral"),
    "qwen2": Family("qwen2", qkv_bias=True),
    "qwen3": Family("qwen3", attention_bias_key="attention_bias", has_qk_norm=True),
}


def family_of(model_type: str) -> Family:
    """The family row of a checkpoint's model_type; ValueError (one line) naming those served."""
    family = FAMILIES.get(model_type)
    if family is None:
        served = ", ".join(FAMILIES)
        raise ValueError(f"model_type {model_type!r} is not supported; served families: {served}")
    return family


def rope_type_of(name: str, family: Family) -> RopeType:
    """The RopeType called `name`; ValueError (one line) naming the family's served types."""
    served = [t for t in RopeType if t in family.rope_types]
    for rope_type in served:
        if rope_type.value == name:
            return rope_type
    names = ", ".join(t.value for t in served)
    raise ValueError(
        f"rope type {name!r} is not supported for {family.name}; served rope types: {names}"
    )
