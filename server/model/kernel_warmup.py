"""The LoRA kernel variants a model can launch, compiled at start-up (`--warmup`, on with cuda).

A Triton kernel compiles per specialization of its operands (gpu_lora/kernels/variants.py), and
the model decides them: q, k and v add into column slices of the fused qkv output [T, (N+2K)*D]
(row stride (N+2K)*D, k and v starting N*D and (N+K)*D columns in), gate and up into the two
halves of gate_up [T, 2I], o and down into fresh [T, H] outputs; each input x is a fresh
[T, H_in] tensor; each pool tensor is one layer of [L, C, H_in]. `lora_operands` lists them (a
change of llama.py's fused layout changes this table; tests/server/model/test_kernel_warmup.py
runs the model and checks that its launches are among them), and `warm_up_kernels` launches every
variant of the engine's `LaunchSpace` once before the server answers /health, so that no request
waits for a compile. It logs one line: how many variants, in how many seconds.
"""

from __future__ import annotations

import logging

import torch

from toppings.gpu_lora.kernels.variants import ALIGN_BYTES, LaunchSpace, Operands
from toppings.gpu_lora.kernels.warmup import WarmupResult, warm_up
from toppings.server.model.config import ModelConfig

log = logging.getLogger(__name__)


def _layout(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Per projection: (row stride of y, column of y's first element in the tensor it slices)."""
    q_width = config.num_heads * config.head_dim  # N*D
    kv_width = config.num_kv_heads * config.head_dim  # K*D
    qkv, inter = q_width + 2 * kv_width, config.intermediate_size
    return {
        "q_proj": (qkv, 0),
        "k_proj": (qkv, q_width),
        "v_proj": (qkv, q_width + kv_width),
        "o_proj": (config.hidden_size, 0),
        "gate_proj": (2 * inter, 0),
        "up_proj": (2 * inter, inter),
        "down_proj": (config.hidden_size, 0),
    }


def lora_operands(config: ModelConfig, dtype: torch.dtype) -> tuple[Operands, ...]:
    """Every `Operands` a step of this model can launch the LoRA kernels with, in `dtype`.

    Both row strides of a slice appear (a one-row launch passes its width, `row_stride`), and
    both alignments of a pool layer whose rows are not a multiple of 16 bytes (where a layer
    starts then depends on the pool's row count)."""
    item = torch.empty((), dtype=dtype).element_size()
    found: dict[Operands, None] = {}
    for module, (stride_y, column) in _layout(config).items():
        h_in, h_out = config.projection_shape(module)
        y_aligned = column * item % ALIGN_BYTES == 0
        a_options = (True,) if h_in * item % ALIGN_BYTES == 0 else (True, False)
        b_options = (True,) if h_out * item % ALIGN_BYTES == 0 else (True, False)
        for sy in dict.fromkeys((stride_y, h_out)):
            for a_ok in a_options:
                for b_ok in b_options:
                    aligned = (True, y_aligned, a_ok, b_ok)
                    found[Operands(dtype, h_in, h_out, h_in, sy, h_in, h_out, aligned)] = None
    return tuple(found)


def launch_space(
    config: ModelConfig, dtype: torch.dtype, kernel: str, max_lora_rank: int,
    max_step_tokens: int, device: str,
) -> LaunchSpace:  # fmt: skip
    """What an engine's LoRA launches range over: kernel "bgmv"/"mbgmv", adapters up to rank
    `max_lora_rank`, steps of at most `max_step_tokens` tokens, on `device` ("cuda"/"cpu")."""
    return LaunchSpace(
        kernel == "bgmv", max_lora_rank, lora_operands(config, dtype), max_step_tokens,
        device=device,
    )  # fmt: skip


def warm_up_kernels(space: LaunchSpace, device: torch.device | str) -> WarmupResult:
    """Compile (or load from Triton's disk cache) every variant of `space`, and log it."""
    result = warm_up(space, device)
    log.info(
        "warm-up: %d Triton LoRA kernel variants (%d decode, %d prefill; %s up to rank %d) "
        "compiled or loaded from the Triton cache in %.2f s",
        result.num_variants, result.decode_variants, result.prefill_variants,
        "bgmv" if space.padded else "mbgmv", space.max_rank, result.seconds,
    )  # fmt: skip
    return result
