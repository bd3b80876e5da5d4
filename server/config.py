"""Engine settings, built once from the command line."""

from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
KERNELS = ("bgmv", "mbgmv")
LORA_MODES = ("cached", "on-demand", "cpu-assisted")


@dataclass(frozen=True)
class EngineConfig:
    """How one inference server runs its engine.

    max_total_tokens bounds the KV cache (token slots over all requests); a request is admitted
    only when its prompt plus max_new_tokens fit in the slots not yet reserved.
    """

    device: str = "cpu"
    dtype: str = "bfloat16"
    kernel: str = "mbgmv"
    lora_mode: str = "cached"
    max_total_tokens: int = 32768
    max_batch_size: int = 128
    max_prefill_tokens: int = 8192
    max_model_len: int = 0  # 0: the model's max_position_embeddings

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("device", self.device, DEVICES),
            ("dtype", self.dtype, DTYPES),
            ("kernel", self.kernel, KERNELS),
            ("lora_mode", self.lora_mode, LORA_MODES),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
        for name in ("max_total_tokens", "max_batch_size", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.max_model_len < 0:
            raise ValueError("max_model_len must be >= 0")
