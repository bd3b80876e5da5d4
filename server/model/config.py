"""Shape facts of a Llama-family checkpoint, read once from its Hugging Face config."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from toppings.gpu_lora.targets import LORA_TARGETS
from toppings.server.model.family import RopeScaling, RopeType, family_of, rope_type_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of a Llama-family decoder (H hidden, N heads, K kv heads, D head dim) and the
    switches of its family (server/model/family.py) that the forward pass consults.

    max_position_embeddings is the longest context served: the checkpoint's, capped by its
    sliding window (attention within the window is full causal attention, so capping keeps
    every served position exact without a windowed kernel).
    """

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
    family: str = "llama"
    qkv_bias: bool = False  # q/k/v projections carry a bias
    o_bias: bool = False
    mlp_bias: bool = False  # gate/up/down carry a bias
    has_qk_norm: bool = False  # RMSNorm over each q and k head before RoPE
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    sliding_window: int | None = None  # the checkpoint's, where it has one (informational)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads are not a multiple of {self.num_kv_heads}")
        for dim in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, dim) <= 0:
                raise ValueError(f"{dim} must be positive")

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

    @property
    def scored_token_weight(self) -> float:
        """What a prompt token's row through the LM head (a request scoring its prompt) adds to
        its cost in the layers: the head's multiply-adds over the seven projections' of every
        layer (attention over the past is priced apart)."""
        layer = sum(i * o for i, o in map(self.projection_shape, LORA_TARGETS))
        return self.hidden_size * self.vocab_size / (self.num_layers * layer)

    @classmethod
    def from_hf(cls, hf_config, name: str) -> ModelConfig:
        """Build from a transformers config of a served family (server/model/family.py).

        Raises a one-line ValueError for a model_type, RoPE type or MLP activation that is not
        served, before any weight is read.
        """
        family = family_of(getattr(hf_config, "model_type", "llama"))
        rope = getattr(hf_config, "rope_parameters", None) or getattr(
            hf_config, "rope_scaling", None
        )
        rope = dict(rope or {})
        rope_type = rope_type_of(rope.get("rope_type", rope.get("type", "default")), family)
        theta = rope.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor is not supported; RoPE must cover head_dim")
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "swish"):  # (transformers' two names of one function)
            raise ValueError(f"hidden_act {act!r} is not supported; the MLP runs SiLU (silu)")
        max_positions = hf_config.max_position_embeddings
        scaling = RopeScaling()
        if rope_type is not RopeType.DEFAULT:
            scaling = RopeScaling(
                rope_type=rope_type,
                factor=float(rope["factor"]),
                low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(
                    rope.get("original_max_position_embeddings") or max_positions
                ),
            )
        attention_bias = bool(
            family.attention_bias_key and getattr(hf_config, family.attention_bias_key, False)
        )
        mlp_bias = bool(family.mlp_bias_key and getattr(hf_config, family.mlp_bias_key, False))
        window = _sliding_window(hf_config)
        if window is not None and window < max_positions:
            log.warning(
                "%s: sliding window of %d tokens; serving contexts of at most %d tokens "
                "(max_position_embeddings %d), where the window changes nothing",
                name, window, window, max_positions,
            )  # fmt: skip
            max_positions = window
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
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            family=family.name,
            qkv_bias=family.qkv_bias or attention_bias,
            o_bias=attention_bias,
            mlp_bias=mlp_bias,
            has_qk_norm=family.has_qk_norm,
            rope_scaling=scaling,
            sliding_window=window,
        )


def _sliding_window(hf_config) -> int | None:
    """The attention window a transformers config applies, or None. transformers sets
    `sliding_window` to None where the family switches it off (Qwen's use_sliding_window), and
    where the config lists `layer_types`, only "sliding_attention" layers use it."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)
