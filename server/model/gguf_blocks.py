"""A GGUF's Q4_0 / Q4_1 projections as int4 weights, taken from their blocks as they are.

llama.cpp's Q4_0 block is 32 consecutive inputs of one output row: an fp16 scale d and 16 bytes
of 4-bit values q (byte j holds input j in its low nibble and input j + 16 in its high one),
`w = d * (q - 8)`; Q4_1 adds an fp16 minimum m, `w = d * q + m`. Both are quant.py's int4
groups of 32, `(q - 8) * scale + zero`, with scale d and zero 0 (Q4_0) or m + 8 d (Q4_1): the
4-bit values and scales are copied, never rounded again. Every other tensor (embeddings, norms,
biases, and projections of other types: Q8_0, K-quants, F16) comes from the float checkpoint
transformers converted the GGUF into (server.model.loader); quant.quantize requantizes those.

llama.cpp stores a `llama`-architecture q/k projection with each head's rotary halves
interleaved by rows; the rows are put back in Hugging Face order, as transformers' GGUF loader
does (blocks run along a row's inputs, so whole rows move with their blocks).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from toppings.server.model.quant import INT4_GROUP, Int4Weight

log = logging.getLogger(__name__)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# GGML type name -> (bytes of a block, whether it has a minimum m)
INT4_BLOCKS = {"Q4_0": (18, False), "Q4_1": (20, True)}


def int4_from_blocks(data: np.ndarray, type_name: str) -> Int4Weight:
    """Q4_0 / Q4_1 rows (uint8 [out, in / 32 * block bytes], as gguf's reader maps them) as an
    Int4Weight [out, in]."""
    block_bytes, has_min = INT4_BLOCKS[type_name]
    out_features = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(out_features, -1, block_bytes)  # [out, G, bytes]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [out, G]
    packed = blocks[..., 4 if has_min else 2 :]  # [out, G, 16]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # [out, G, 32]
    scales = torch.from_numpy(d)
    if has_min:
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        zeros = m + 8 * scales
    else:
        zeros = torch.zeros_like(scales)
    q_rows = torch.from_numpy(q.reshape(out_features, -1).astype(np.uint8))
    return Int4Weight(q_rows, scales, zeros)


def unpermute_rows(weight: Int4Weight, num_heads: int) -> Int4Weight:
    """Undo llama.cpp's interleaving of each head's rotary halves (rows of q or k)."""

    def rows(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0]
        return t.reshape(num_heads, n // num_heads // 2, 2, -1).transpose(1, 2).reshape(n, -1)

    return Int4Weight(rows(weight.q), rows(weight.scales), rows(weight.zeros))


class GgufInt4Weights(Mapping[str, "torch.Tensor | Int4Weight"]):
    """The checkpoint's tensors by Hugging Face name, where each Q4_0 / Q4_1 projection of the
    GGUF is an Int4Weight of its blocks and every other tensor the converted float one."""

    def __init__(self, gguf_path: Path, floats: Mapping[str, torch.Tensor], hf_config):
        """floats: the converted checkpoint's tensors; hf_config: its transformers config."""
        import gguf

        self.floats = floats
        self.reader = gguf.GGUFReader(str(gguf_path))
        arch = str(self.reader.fields["general.architecture"].contents())
        arch_ids = {name: arch_id for arch_id, name in gguf.MODEL_ARCH_NAMES.items()}
        names = gguf.get_tensor_name_map(arch_ids[arch], hf_config.num_hidden_layers)
        tensors = {t.name: t for t in self.reader.tensors}
        self.permuted = arch == "llama"  # llama.cpp's converter permutes q/k of llama only
        self.heads = {
            "q_proj": hf_config.num_attention_heads,
            "k_proj": hf_config.num_key_value_heads,
        }
        self.blocks = {}  # HF name -> the GGUF tensor holding its blocks
        kinds: Counter[str] = Counter()
        for name in floats:
            parts = name.split(".")
            if len(parts) < 2 or parts[-1] != "weight" or parts[-2] not in PROJECTIONS:
                continue
            tensor = tensors.get(names.get_name(name, try_suffixes=(".weight",)) or "")
            kind = tensor.tensor_type.name if tensor is not None else "missing"
            if tensor is not None and kind in INT4_BLOCKS and tensor.shape[0] % INT4_GROUP == 0:
                self.blocks[name] = tensor
                kinds[f"{kind} blocks as they are"] += 1
            else:
                kinds[f"{kind} through float"] += 1
        log.info(
            "int4 from %s: %s", gguf_path.name, ", ".join(f"{n} {k}" for k, n in kinds.items())
        )

    def __getitem__(self, name: str) -> torch.Tensor | Int4Weight:
        tensor = self.blocks.get(name)
        if tensor is None:
            return self.floats[name]
        weight = int4_from_blocks(np.asarray(tensor.data), tensor.tensor_type.name)
        module = name.split(".")[-2]
        if self.permuted and module in self.heads:
            weight = unpermute_rows(weight, self.heads[module])
        return weight

    def __iter__(self) -> Iterator[str]:
        return iter(self.floats)

    def __len__(self) -> int:
        return len(self.floats)

    def __contains__(self, name: object) -> bool:
        return name in self.floats
