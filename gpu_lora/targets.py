"""The projections a LoRA adapter may target, and the model shapes the adapter side needs.

The bottom of the adapter side: gpu_lora and cpu_lora take their projection names and the shape
interface from here, and the server's ModelConfig satisfies `ModelShapes`, so neither package
imports the server.
"""

from __future__ import annotations

from typing import Protocol

# Projections a LoRA adapter may target, with the sub-module that holds them. Bit i of a module
# bitmask (cpu_lora) is LORA_TARGETS[i]; every layout lists modules in this order.
ATTN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
LORA_TARGETS = ATTN_PROJECTIONS + MLP_PROJECTIONS


class ModelShapes(Protocol):
    """What the adapter side reads of a base model (the server's ModelConfig fits)."""

    name: str
    num_layers: int  # L
    vocab_size: int  # a prompt's token ids are below it

    def projection_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a targetable projection, as nn.Linear would have it."""
        ...
