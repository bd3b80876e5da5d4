"""Shape facts of a Llama-family checkpoint, read once from its Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass

from toppings.gpu_lora.targets import LORA_TARGETS


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of a Llama-family decoder (H hidden, N heads, K kv heads, D head dim)."""

    name: str
    vocab_size: int
    hidden_size: int  # H
    intermediate_size: int
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # D
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads are not a multiple of {self.num_kv_heads}")
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive")

    def projection_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a targetable projection, as nn.Linear would have it."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        if module not in shapes:
            raise KeyError(f"unknown projection {module!r}; targets are {', '.join(LORA_TARGETS)}")
        return shapes[module]

    @classmethod
    def from_hf(cls, hf_config, name: str) -> ModelConfig:
        """Build from a transformers LlamaConfig (or any config with the same fields)."""
        model_type = getattr(hf_config, "model_type", "llama")
        if model_type != "llama":
            raise ValueError(f"model_type {model_type!r} is not a Llama-family decoder")
        if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
            raise ValueError("projection biases are not supported")
        rope = getattr(hf_config, "rope_parameters", None) or getattr(
            hf_config, "rope_scaling", None
        )
        rope = rope or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope type {rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            name=name,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=float(theta),
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
        )
