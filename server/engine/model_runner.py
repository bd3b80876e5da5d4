"""The model side of a step: a scheduler's `StepPlan` in, one sampled token per request out.

One batch builder for every plan (`_forward`): request b computes its `tokens[b]` tokens from
position `starts[b]` (a prompt's next chunk, a whole prompt after its cached prefix, or a
decode's last sampled token) after the KV its row holds, each a segment of one `ForwardBatch`.
Attention reads each segment's past from the pool, exactly as a prefill over a cached prefix;
a step without prompt tokens (every count 1) reads every request's KV through the pool's decode
index instead. Only the requests the plan marks as sampling get a token. On CUDA with graphs
on (`RuntimeConfig.use_cuda_graphs`), a decode step replays the graph of its bucket
(`cuda_graphs.DecodeGraphs`); steps the graphs decline (a batch above the largest bucket, an
adapter still loading) and every step on a CPU run the model eagerly. The sampler turns the
logits into tokens.

A request whose logits hold inf or NaN (an adapter whose product overflows the dtype) is taken
out before sampling and fails alone (`StepOutcome.failed`); the others of the batch sample as if
it had not been there, which holds because nothing of the forward mixes rows of different
requests (attention reads each request's own keys, the LoRA kernels each request's own rows).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from toppings.gpu_lora.trace import StepEvent, TraceRecorder
from toppings.server.engine.adapter_step import AdapterStep
from toppings.server.engine.grammar import GrammarCompiler
from toppings.server.engine.logits_scan import scan_logits
from toppings.server.engine.sampler import Sampler, score_prompts
from toppings.server.memory.kv_cache import KVPool
from toppings.server.model.decode_path import Scanned
from toppings.server.model.graph_buckets import GraphBuckets
from toppings.server.model.llama import ForwardBatch, LlamaModel
from toppings.server.requests.sequence import Sequence
from toppings.server.sched.scheduler import StepPlan, StepResult


@dataclass(frozen=True)
class StepOutcome:
    """A plan run: `result` holds the tokens of `plan` (the plan run, less the requests that
    failed), `failed` each failed request with its error."""

    plan: StepPlan
    result: StepResult
    failed: dict[Sequence, str] = field(default_factory=dict)


def nonfinite_error(seq: Sequence) -> str:
    """The error of a request whose logits were not finite."""
    adapter = seq.request.adapter
    if adapter is None:
        return ("the base model produced non-finite logits (inf or NaN) for this request; its "
                "activations likely overflow the model's dtype")  # fmt: skip
    return (
        f"adapter {adapter.name!r} produced non-finite logits (inf or NaN) for this request; its "
        f"LoRA product likely overflows the model's dtype"
    )


class ModelRunner:
    """Runs plans on one model, its KV tensors and its adapters (lora: the LoRA side of each
    step, adapter_step.py; graphs: None where CUDA graphs are off or the device is not CUDA;
    trace: gets a StepEvent per eager forward pass, None: no tracing)."""

    def __init__(
        self,
        model: LlamaModel,
        kv: KVPool,
        lora: AdapterStep,
        sampler: Sampler,
        graphs=None,
        trace: TraceRecorder | None = None,
    ):
        self.model, self.kv, self.lora, self.sampler, self.graphs = model, kv, lora, sampler, graphs
        self._trace = trace

    @classmethod
    def create(
        cls,
        use_cuda_graphs: bool,
        max_batch_size: int,
        model: LlamaModel,
        kv: KVPool,
        lora: AdapterStep,
        eos_ids: set[int],
        grammars: GrammarCompiler | None = None,
        trace: TraceRecorder | None = None,
    ) -> ModelRunner:
        """A runner that replays decode graphs when `use_cuda_graphs` (the runtime part's), one
        per batch-size bucket up to `max_batch_size` (the scheduling part's); `grammars`
        compiles the constraints of structured-output requests; `trace` records its forward
        passes."""
        graphs = None
        if use_cuda_graphs:
            from toppings.server.model.cuda_graphs import DecodeGraphs  # the device module

            buckets = GraphBuckets.for_engine(max_batch_size, kv.max_len)
            graphs = DecodeGraphs(model, kv, lora.pool, lora.kernels.decode, buckets)
        return cls(model, kv, lora, Sampler(eos_ids, grammars), graphs, trace)

    def run(self, plan: StepPlan) -> StepOutcome:
        """Compute the plan's step and sample each request's next token; a request whose logits
        are not all finite gets no token and is in the outcome's `failed`."""
        seqs, samples = list(plan.seqs), plan.samples
        # grammar masks of the requests that sample, computed during the forward
        masks = self.sampler.start_masks(list(plan.sampled))
        slots = self._slots(plan)  # [T]
        logits = scanned = None
        if self.graphs is not None and not plan.is_prefill:  # every count 1: a graph may run it
            logits = self._replay(plan)
        if logits is None:
            logits, scanned, seconds, num_computed = self._forward(plan, slots)  # [B, V]
        else:
            seconds, num_computed = 0.0, 0
        # [B] each: finite rows, argmax (logits_scan.py; scanned: by the native step itself)
        finite, best = scanned if scanned is not None else scan_logits(logits)
        keep = [i for i, ok in enumerate(finite) if ok]
        failed = {s: nonfinite_error(s) for s, ok in zip(seqs, finite) if not ok}
        kept_plan = plan if not failed else plan.subset(keep)
        rows = [i for i in keep if samples[i]]
        sampled = [seqs[i] for i in rows]
        if len(rows) < len(seqs):
            logits = logits[rows]  # [S, V], the rows of the requests that sample
        argmax = [best[i] for i in rows]
        tokens = self.sampler.sample(sampled, logits, masks, argmax) if sampled else []
        return StepOutcome(kept_plan, StepResult(tokens, seconds, num_computed), failed)

    def _slots(self, plan: StepPlan) -> torch.Tensor:
        """The KV slots of the plan's tokens, int64 [T], in plan order: the scheduler reserved
        them (`Scheduler._reserve`); the runner only reads where they are."""
        rows = [s.kv_hold.row for s in plan.seqs]
        if not plan.is_prefill:
            return self.kv.slots_at(rows, list(plan.starts))  # [B]
        table = self.kv.req_to_slot
        return torch.cat([table[r, b : b + n] for r, b, n in zip(rows, plan.starts, plan.tokens)])

    def _replay(self, plan: StepPlan) -> torch.Tensor | None:
        """A decode step's logits [B, V] from its CUDA graph, or None where the graphs decline
        (then the step runs eagerly)."""
        seqs = plan.seqs
        entries = [s.cache_entry for s in seqs]
        if self.lora.has_dora(entries):
            return None  # the graphs' LoRA does not scale DoRA rows
        adapters = [e.resident if e else None for e in entries]
        loading = any(e is not None and not e.ticket.done for e in entries)
        ids = [s.output_ids[-1] for s in seqs]
        rows = [s.kv_hold.row for s in seqs]
        return self.graphs.run(rows, ids, list(plan.starts), adapters, loading)

    def _forward(
        self, plan: StepPlan, slots: torch.Tensor
    ) -> tuple[torch.Tensor, Scanned | None, float, int]:
        """The one `ForwardBatch` of a step and its forward pass: request b computes its
        plan.tokens[b] tokens from position plan.starts[b] (its prompt's next chunk, or its
        last sampled token) after the KV its row holds (its past). Returns the logits [B, V]
        of each request's last token (and keeps the prompt logprobs of a request that scores
        its prompt, whole in one step: see `admission.is_whole`), their scan where the model's
        native step scanned them (else None), the seconds of the forward pass and
        the prompt tokens it computed.

        A decode step (every count 1, no prompt token) reads every request's KV through the
        pool's decode index; a step with prompt tokens reads each segment's past from the
        pool, exactly as a prefill over a cached prefix."""
        seqs, device, kv = plan.seqs, self.model.device, self.kv
        is_prefill = plan.is_prefill
        ids, positions, seg_starts, rows, scores = [], [], [0], [], []
        for seq, start, n in zip(seqs, plan.starts, plan.tokens):
            if start >= seq.prompt_len:  # a decode row (n = 1): its last sampled token
                ids.append(seq.output_ids[-1])
                whole = False
            else:
                ids.extend(seq.request.prompt_ids[start : start + n])
                whole = seq.request.params.prompt_logprobs is not None
            positions.extend(range(start, start + n))
            end = seg_starts[-1] + n
            rows.extend(range(seg_starts[-1] if whole else end - 1, end))
            seg_starts.append(end)
            scores.append(whole)
        kv_index = kv_lengths = past = None
        if is_prefill:
            past = [kv.req_to_slot[s.kv_hold.row, :b] if b else None
                    for s, b in zip(seqs, plan.starts)]  # fmt: skip
        else:
            kv_index, kv_lengths = kv.decode_index([s.kv_hold.row for s in seqs])  # [B, Lmax], [B]
        started = time.perf_counter()
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),  # [T]
            positions=torch.tensor(positions, dtype=torch.int64, device=device),  # [T]
            slots=slots,  # [T]
            seg_starts=seg_starts,
            is_prefill=is_prefill,
            kv_index=kv_index,
            kv_lengths=kv_lengths,
            past_slots=past,
            lora=self.lora.step(
                [s.cache_entry for s in seqs],
                seg_starts,
                is_prefill,
                list(plan.starts),
                [s.lora_start for s in seqs],
            ),  # fmt: skip
            logit_rows=None if not any(scores) else torch.tensor(rows, device=device),
        )
        logits, scanned = self.model.forward(batch, kv)  # [R, V]
        seconds = time.perf_counter() - started
        if self._trace is not None:
            self._trace.step(StepEvent(is_prefill, len(ids), started, started + seconds))
        if any(scores):  # [R, V] -> [B, V]
            last, offset = [], 0
            for seq, n, whole in zip(seqs, plan.tokens, scores):
                if whole:
                    score_prompts([seq], logits[offset : offset + n], [0, n])
                    offset += n
                else:
                    offset += 1
                last.append(offset - 1)
            logits = logits[last]
        num_prompt = sum(max(0, min(s.prompt_len, b + n) - b)
                         for s, b, n in zip(seqs, plan.starts, plan.tokens))  # fmt: skip
        return logits, scanned, seconds, num_prompt
