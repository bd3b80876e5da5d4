"""An engine's parts, built in one place from its configuration and checkpoint: the model, the
node's memory (KV pool, prefix tree, host tier, adapter cache), the adapters, the chunked-prefill
step budget, the model runner and the scheduler. Each part of the configuration goes to the
modules it configures; values another part holds go explicitly."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from toppings.gpu_lora.trace import TraceRecorder
from toppings.server import native
from toppings.server.adapters.manager import AdapterManager
from toppings.server.adapters.reader import CheckpointProjections
from toppings.server.config import EngineConfig, LoraConfig, MemoryConfig, SchedulingConfig
from toppings.server.engine.model_runner import ModelRunner
from toppings.server.kv_events.publisher import Sink
from toppings.server.memory.build import build_memory
from toppings.server.memory.kv_cache import KVPool
from toppings.server.memory.manager import MemoryManager
from toppings.server.model.kernel_warmup import launch_space, warm_up_kernels
from toppings.server.model.llama import LlamaModel, free_device_bytes
from toppings.server.model.loader import Checkpoint
from toppings.server.model.step_timing import measure_steps, warm_forward
from toppings.server.requests.sequence import Sequence
from toppings.server.sampling.grammar import GrammarCompiler
from toppings.server.sched.gate_limits import GateLimits
from toppings.server.sched.policies import make_queue_policy
from toppings.server.sched.scheduler import Scheduler
from toppings.server.sched.step_budget import StepTimeModel
from toppings.server.sched.step_budget_keeper import StepBudgetKeeper


@dataclass
class EngineParts:
    """What an engine is made of (see the module docstring)."""

    max_model_len: int
    model: LlamaModel
    memory: MemoryManager
    kv: KVPool
    budget: StepBudgetKeeper | None  # chunked prefill's step budget; None: chunked prefill off
    lora: AdapterManager
    eos_ids: set[int]
    grammars: GrammarCompiler
    runner: ModelRunner
    scheduler: Scheduler


def compose_engine(
    config: EngineConfig,
    checkpoint: Checkpoint,
    on_end: Callable[[Sequence], None],
    trace: TraceRecorder | None = None,
    step_model: StepTimeModel | None = None,
    kv_sink: Sink | None = None,
) -> EngineParts:
    """The parts of an engine of `config` on `checkpoint`; on_end: called once for each
    request when it ends, on any path; trace, step_model, kv_sink: see Engine."""
    mc = checkpoint.config
    max_model_len = min(
        config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
    )
    dtype = getattr(torch, config.dtype)
    if config.device == "cpu":
        native.keep_freed_memory()
    weights = checkpoint.weights_on(config.device, dtype)  # dummy ones drawn on the device
    model = LlamaModel(
        mc, weights, dtype, config.device, max_model_len,
        quantization=config.quantization_scheme, paged_attention=config.use_paged_attention,
    )  # fmt: skip
    lora_config, sched_config = config.part(LoraConfig), config.part(SchedulingConfig)
    # KV pool, prefix tree, host tier and adapter cache: one owner of device memory.
    memory = build_memory(
        config.part(MemoryConfig), lora_config, config.device, config.max_batch_size,
        mc, dtype, max_model_len, lambda: free_device_bytes(model.device), trace, kv_sink,
    )  # fmt: skip
    kv = memory.kv
    # Chunked prefill's tokens per step, sized from step times measured here unless given.
    budget = None
    if config.chunked_prefill:
        budget = StepBudgetKeeper(
            config.max_batch_size, config.max_prefill_tokens, config.max_num_batched_tokens,
            config.itl_target_ms, lambda: measure_steps(model, kv, config.max_batch_size),
            step_model, config.chunk_floor_tokens, mc.scored_token_weight,
        )  # fmt: skip
    step_budget = budget.budget if budget is not None else None
    # a prompt prefilled whole may share a step with the decodes
    max_step_tokens = max(
        config.max_prefill_tokens + config.max_batch_size, step_budget.tokens if budget else 0
    )
    # The only LoRA object the engine uses.
    lora = AdapterManager(
        lora_config, config.kernel, config.device, max_step_tokens,
        mc, dtype, memory.adapter_cache, memory, trace, CheckpointProjections(weights),
    )  # fmt: skip
    if config.use_warmup:  # every LoRA kernel variant compiled before the first request
        space = launch_space(
            mc, dtype, config.kernel, lora.max_lora_rank, max_step_tokens, config.device
        )
        warm_up_kernels(space, model.device)
    warm_forward(model, kv)  # the first request meets no one-time cost of a forward
    # Stop tokens: config.json's, the tokenizer's, and generation_config.json's list (where
    # chat checkpoints name their end of turn: Llama 3's <|eot_id|>, Qwen's <|im_end|>).
    eos_ids = set(mc.eos_token_ids) | set(checkpoint.generation_eos_ids)
    if checkpoint.tokenizer.eos_token_id is not None:
        eos_ids.add(checkpoint.tokenizer.eos_token_id)
    # Structured output: constraints compile before their request is queued.
    grammars = GrammarCompiler(checkpoint.tokenizer, mc.vocab_size, eos_ids)
    runner = ModelRunner.create(
        config.use_cuda_graphs, config.max_batch_size, model, kv, lora.steps, eos_ids, grammars,
        trace,
    )  # fmt: skip
    limits = GateLimits.from_config(sched_config, step_budget)
    scheduler = Scheduler(
        make_queue_policy(sched_config, config.max_total_tokens), memory, lora,
        limits, eos_ids, max_model_len, on_end=on_end,
    )  # fmt: skip
    return EngineParts(max_model_len, model, memory, kv, budget, lora, eos_ids, grammars,
                       runner, scheduler)  # fmt: skip
