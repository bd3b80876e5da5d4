"""Llama-family forward pass over a flat batch of tokens from many requests.

One step is either a prefill (each request contributes its prompt, a segment of tokens) or a
decode (each request contributes one token). Keys and values go to the token-level KV pool; LoRA
deltas are added per projection by the step's `LoraBatch` (gpu_lora), where each request's
adapter lives.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from toppings.server.config import Quantization
from toppings.server.memory.kv_cache import KVPool
from toppings.server.model.attention import (
    decode_attention,
    plan_prefill,
    prefill_attention,
    sdpa_min_len,
)
from toppings.server.model.config import ModelConfig
from toppings.server.model.decode_path import DecodePath, Scanned
from toppings.server.model.family import RopeType
from toppings.server.model.fused import add_rms_norm, rms_norm_heads_, rope_, silu_mul
from toppings.server.model.linear import Linear, plain_copy_affordable
from toppings.server.model.quant import QuantizedLinear, concat, quantize

if TYPE_CHECKING:
    from toppings.gpu_lora.kernels.native import RunsLayout

log = logging.getLogger(__name__)


class StepLora(Protocol):
    """The LoRA side of one step, as the model calls it (gpu_lora.lora_batch.LoraBatch, or the
    CUDA graphs' StaticLora)."""

    # the same int while the same batch serves several steps (what is made from it may be
    # kept); None: it serves this step alone
    version: int | None

    def add(self, layer: int, x: torch.Tensor, outputs) -> None:
        """y += every request's LoRA delta for each (module, y) of outputs; x [T, H_in], y
        [T, H_out], in place."""

    def native_runs(self) -> RunsLayout | None:
        """The step's runs for the native decode path to add itself (decode_path.py); None:
        it calls `add` layer by layer."""


@dataclass
class ForwardBatch:
    """The tokens of one engine step (T tokens, B requests)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64, KV slot each token is written to
    seg_starts: list[int]  # B+1 boundaries; decode: [0, 1, ..., B]
    is_prefill: bool
    kv_index: torch.Tensor | None = None  # decode: [B, Lmax] slots of every position
    kv_lengths: torch.Tensor | None = None  # decode: [B] int64, valid positions per request
    # prefill: per request, the slots [P] of its cached prefix (its segment holds the tokens
    # after it), or None when the whole prompt is computed
    past_slots: Sequence[torch.Tensor | None] | None = None  # a list, or a PastTable
    lora: StepLora | None = None  # None: no adapter in the batch
    # [R] int64 rows of the T tokens whose logits forward returns; None: each segment's last
    # token (R = B). Prefill asks for every prompt row of a request that scores its prompt.
    logit_rows: torch.Tensor | None = None


Projection = Linear | QuantizedLinear


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Projection  # [(N+2K)*D, H], with the bias [(N+2K)*D] where the family has one
    o: Projection  # [H, N*D]
    post_norm: torch.Tensor  # [H]
    gate_up: Projection  # [2*I, H]
    down: Projection  # [H, I]
    q_norm: torch.Tensor | None = None  # [D], families with q/k norm (ModelConfig.has_qk_norm)
    k_norm: torch.Tensor | None = None  # [D]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] float32 of the checkpoint's RoPE, as transformers computes them
    (transformers/modeling_rope_utils.py, `_compute_*_parameters`; every type served has an
    attention factor of 1, so cos and sin are not rescaled).

    DYNAMIC (NTK) gives transformers a base that depends on the longest position of each forward
    call, `theta * (factor * seq_len / max_position_embeddings - (factor - 1)) ** (D / (D - 2))`
    with seq_len at least max_position_embeddings: up to max_position_embeddings it is theta
    itself. This server attends at most max_position_embeddings positions (the engine's
    max_model_len), so the unscaled frequencies are the exact ones for every position served;
    past them transformers' keys would depend on the length of the call that cached them.
    """
    d, scaling = config.head_dim, config.rope_scaling
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    if scaling.rope_type is RopeType.LINEAR:
        return inv_freq / scaling.factor
    if scaling.rope_type is RopeType.LLAMA3:
        # Wavelengths longer than the pre-training context / low_freq_factor slow down by
        # `factor`, those shorter than context / high_freq_factor stay, the band between is
        # interpolated linearly in context / wavelength.
        context = scaling.original_max_position_embeddings
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > context / low, inv_freq / scaling.factor, inv_freq)
        smooth = (context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = ~(wavelen < context / high) * ~(wavelen > context / low)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq  # DEFAULT, and DYNAMIC within max_position_embeddings (see above)


def projection_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of every projection weight of the model (lm_head included) in `dtype`."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    per_layer = h * (2 * config.num_heads + 2 * config.num_kv_heads) * d + 3 * h * i
    return (config.num_layers * per_layer + config.vocab_size * h) * dtype.itemsize


def free_device_bytes(device: torch.device) -> int:
    """Free memory of a CUDA device now (what the memory pool's default is sized from)."""
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


class WeightReader:
    """Takes a checkpoint's tensors as the model holds them: on its device in its dtype, the
    projections stacked along their outputs (q, k, v as one; gate and up as one) and packed or
    quantized as the model runs them (pack: oneDNN's packing on a CPU; plain_gemv: a plain copy
    for the native GEMV; quantization: int8 / int4 from the checkpoint's own weight)."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        pack: bool,
        plain_gemv: bool,
        quantization: Quantization,
    ):
        self.weights, self.dtype, self.device = weights, dtype, device
        self.pack, self.plain_gemv, self.quantization = pack, plain_gemv, quantization

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return self.weights[name].to(device=self.device, dtype=self.dtype).contiguous()

    def projection(
        self, names: list[str], bias: torch.Tensor | None = None, scheme: Quantization | None = None
    ) -> Projection:
        """The projection of these weights stacked along their outputs."""
        scheme = self.quantization if scheme is None else scheme
        if scheme is not Quantization.NONE:
            parts = [quantize(self.weights[n], scheme) for n in names]
            return QuantizedLinear(concat(parts), self.dtype, bias)
        parts = [self.tensor(n) for n in names]
        weight = torch.cat(parts) if len(parts) > 1 else parts[0]
        return Linear(weight, self.pack, self.plain_gemv, bias)

    def _stacked(self, prefix: str, modules: tuple[str, ...], has_bias: bool) -> Projection:
        """The modules' projection with their biases, one after another, where the family has
        them."""
        bias = None
        if has_bias:
            bias = torch.cat([self.tensor(prefix + m + ".bias") for m in modules])
        return self.projection([prefix + m + ".weight" for m in modules], bias)

    def layer(self, config: ModelConfig, i: int) -> LayerWeights:
        """Layer i's weights."""
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        return LayerWeights(
            input_norm=self.tensor(p + "input_layernorm.weight"),
            qkv=self._stacked(attn, ("q_proj", "k_proj", "v_proj"), config.qkv_bias),
            o=self._stacked(attn, ("o_proj",), config.o_bias),
            post_norm=self.tensor(p + "post_attention_layernorm.weight"),
            gate_up=self._stacked(mlp, ("gate_proj", "up_proj"), config.mlp_bias),
            down=self._stacked(mlp, ("down_proj",), config.mlp_bias),
            q_norm=self.tensor(attn + "q_norm.weight") if config.has_qk_norm else None,
            k_norm=self.tensor(attn + "k_norm.weight") if config.has_qk_norm else None,
        )


class LlamaModel:
    """Weights on one device and the forward pass; holds no per-request state."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: str | torch.device,
        max_len: int,
        pack_cpu_weights: bool = True,
        plain_gemv: bool | None = None,
        quantization: Quantization = Quantization.NONE,
        paged_attention: bool = True,
    ):
        """pack_cpu_weights: on a CPU, run the projections through oneDNN (linear.py);
        plain_gemv: where linear.py's GEMV (bf16 or float32) runs here, keep a plain copy of
        each weight for steps of 1-4 rows (twice the projections' memory; a tied lm_head shares
        the embedding); None: where that copy is affordable (`linear.plain_copy_affordable`);
        quantization: int8 / int4 projections (quant.py; lm_head int8 in both), each quantized
        from the checkpoint's own weight (a float tensor, or a GGUF's blocks) at load;
        paged_attention: on a GPU, attention by the Triton kernels over the paged KV (else the
        torch path, which gathers it)."""
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.quantization = quantization
        self.paged_attention = paged_attention
        self.sdpa_from = sdpa_min_len(dtype, self.device)  # long prompt segments to SDPA
        quantized = quantization is not Quantization.NONE
        if quantized and self.device.type != "cpu":
            raise ValueError(f"quantization {quantization.value} runs on a cpu only")
        if plain_gemv is None and not quantized:
            plain_gemv = plain_copy_affordable(projection_bytes(config, dtype))
            if self.device.type == "cpu" and not plain_gemv:
                log.info("no plain weight copy for the GEMV: it would not fit in memory")
        read = WeightReader(weights, dtype, self.device, pack_cpu_weights, bool(plain_gemv),
                            quantization)  # fmt: skip
        self.embed = read.tensor("model.embed_tokens.weight")  # [V, H]
        self.norm = read.tensor("model.norm.weight")
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        # [V, H]; int8 in int4 models too: the logits are the most sensitive product
        if quantized:
            head = "model.embed_tokens.weight" if tied else "lm_head.weight"
            self.lm_head = read.projection([head], scheme=Quantization.INT8)
        else:
            head_weight = self.embed if tied else read.tensor("lm_head.weight")
            self.lm_head = Linear(head_weight, pack_cpu_weights, plain_gemv)
            plain = self.lm_head.gemv_weight if not self.lm_head.gemv_tiled else None
            if tied and plain is not None:  # one copy: the GEMV's placed one
                self.embed = plain
        self.layers = [read.layer(config, i) for i in range(config.num_layers)]
        inv_freq = rope_inv_freq(config)  # [D/2]
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [max_len, D]
        self.cos = angles.cos().to(self.device, dtype)
        self.sin = angles.sin().to(self.device, dtype)
        # Decode steps of a few requests in four native calls a layer where every projection
        # has a native GEMV here (decode_path.py); None: op by op.
        self.decode_path = DecodePath.build(self)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVPool) -> tuple[torch.Tensor, Scanned | None]:
        """Run one step; returns float32 logits of each request's last token, [B, V], or of
        `batch.logit_rows` when set, [R, V]; and where the whole step ran in one native call,
        each row's finiteness and argmax from that call (decode_path.py's `run_to_logits`),
        None otherwise (the caller scans the logits)."""
        native = self.decode_path is not None and self.decode_path.fits(self, batch, kv)
        if native and batch.logit_rows is None:  # the whole step in one call where it can
            made = self.decode_path.run_to_logits(self, batch, kv)  # [B, V], its scan
            if made is not None:
                return made
        return self.head(self._hidden(batch, kv, native)), None  # [R, V]

    @torch.inference_mode()
    def hidden(self, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        """Run one step as `forward` does, short of the LM head: the final norm's output [R, H]
        of the rows `forward` would return logits of. A caller scoring a long prompt takes its
        logits by chunks of rows with `head`, never [R, V] at once."""
        native = self.decode_path is not None and self.decode_path.fits(self, batch, kv)
        return self._hidden(batch, kv, native)

    @torch.inference_mode()
    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits [R, V] of final hidden states h [R, H]."""
        return self.lm_head(h).float()

    def _hidden(self, batch: ForwardBatch, kv: KVPool, native: bool) -> torch.Tensor:
        """The layers and the final norm of `batch.logit_rows` (None: each segment's last
        token), [R, H]; `native`: the decode path's four calls a layer fit the step."""
        cfg = self.config
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]  # [T, D]
        h = self.embed[batch.input_ids]  # [T, H], fresh: the residual stream, added in place
        if native:
            residual = self.decode_path.run(self, batch, kv, h, cos, sin)  # four calls a layer
        else:
            residual = self._layers(batch, kv, h, cos, sin)
        rows = batch.logit_rows
        if rows is None and len(batch.seg_starts) - 1 == h.shape[0]:  # one token a request
            return add_rms_norm(h, residual, self.norm, cfg.rms_norm_eps)  # [B, H], every row
        h += residual
        if rows is None:
            rows = torch.tensor(batch.seg_starts[1:], device=self.device) - 1
        return add_rms_norm(h[rows], None, self.norm, cfg.rms_norm_eps)  # [R, H]

    def _layers(self, batch: ForwardBatch, kv: KVPool, h: torch.Tensor, cos, sin) -> torch.Tensor:
        """Every layer, op by op, on the residual stream h [T, H] (added into in place); returns
        the last layer's output [T, H], which the caller adds into h."""
        cfg = self.config
        n, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        num_tokens = batch.input_ids.shape[0]
        lora = batch.lora
        residual = None  # the last block's output, added into h by the next norm
        plan = None
        if batch.is_prefill:  # which prompts the native kernel attends, the same in every layer
            plan = plan_prefill(
                batch.seg_starts, batch.past_slots, batch.slots, n // k, self.paged_attention,
                self.sdpa_from,
            )  # fmt: skip
        for idx, layer in enumerate(self.layers):
            x = add_rms_norm(h, residual, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(x)  # [T, (N+2K)*D]
            q, key, val = qkv.split([n * d, k * d, k * d], dim=-1)
            if lora is not None:
                lora.add(idx, x, (("q_proj", q), ("k_proj", key), ("v_proj", val)))
            if layer.q_norm is not None:  # each head of q and k, after LoRA, before RoPE
                rms_norm_heads_(q.view(num_tokens, n, d), layer.q_norm, cfg.rms_norm_eps)
                rms_norm_heads_(key.view(num_tokens, k, d), layer.k_norm, cfg.rms_norm_eps)
            # RoPE on the query and key heads together, in place in qkv.
            rope_(qkv[:, : (n + k) * d].view(num_tokens, n + k, d), cos, sin)
            q = q.view(num_tokens, n, d)  # [T, N, D]
            key, val = key.view(num_tokens, k, d), val.view(num_tokens, k, d)  # [T, K, D]
            kv.write(idx, batch.slots, key, val)
            if batch.is_prefill:
                attn = prefill_attention(
                    q, key, val, batch.seg_starts, batch.past_slots, kv.k[idx], kv.v[idx], plan
                )  # [T, N*D]
            else:
                attn = decode_attention(
                    q, kv.k[idx], kv.v[idx], batch.kv_index, batch.kv_lengths,
                    self.paged_attention,
                )  # fmt: skip
            out = layer.o(attn)  # [T, H]
            if lora is not None:
                lora.add(idx, attn, (("o_proj", out),))
            x = add_rms_norm(h, out, layer.post_norm, cfg.rms_norm_eps)
            gate_up = layer.gate_up(x)  # [T, 2I]
            if lora is not None:
                gate, up = gate_up.chunk(2, dim=-1)
                lora.add(idx, x, (("gate_proj", gate), ("up_proj", up)))
            act = silu_mul(gate_up)  # [T, I]
            residual = layer.down(act)  # [T, H]
            if lora is not None:
                lora.add(idx, act, (("down_proj", residual),))
        return residual
