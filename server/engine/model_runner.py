"""The model side of a step: a scheduler's `StepPlan` in, one sampled token per request out.

A prefill plan computes each prompt from the end of its cached prefix (the KV row's length so
far); a decode plan gives each running request its next KV slot and feeds its last token. Both
become one `ForwardBatch` (`_forward`). A mixed plan (chunked prefill) is one prefill-style
batch whose segments each continue their request's KV row: a prompt chunk after its earlier
chunks (and any reused prefix), a decode row as a segment of one token after its whole past;
attention reads each segment's past from the pool, exactly as a prefill over a cached prefix.
Only the requests the plan marks as sampling get a token. On CUDA with graphs on
(`RuntimeConfig.use_cuda_graphs`), a decode step (never a mixed one) replays the graph of
its bucket (`cuda_graphs.DecodeGraphs`); steps the graphs decline (a batch above the largest
bucket, an adapter still loading) and every step on a CPU run the model eagerly. The
sampler turns the logits into tokens.

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
from toppings.server.engine.adapters import AdapterManager
from toppings.server.engine.grammar import GrammarCompiler
from toppings.server.engine.sampler import Sampler, logit_rows, score_prompts
from toppings.server.memory.kv_cache import KVPool
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
    who = "the base model" if seq.request.adapter is None else f"adapter {seq.request.adapter!r}"
    return (
        f"{who} produced non-finite logits (inf or NaN) for this request; its LoRA product "
        f"likely overflows the model's dtype"
    )


class ModelRunner:
    """Runs plans on one model, its KV tensors and its adapters (graphs: None where CUDA graphs
    are off or the device is not CUDA; trace: gets a StepEvent per eager forward pass, None: no
    tracing)."""

    def __init__(
        self,
        model: LlamaModel,
        kv: KVPool,
        lora: AdapterManager,
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
        lora: AdapterManager,
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
        seqs = list(plan.seqs)
        samples = plan.samples or (True,) * len(seqs)
        # grammar masks of the requests that sample, computed during the forward
        masks = self.sampler.start_masks([s for s, ok in zip(seqs, samples) if ok])
        if plan.is_mixed:
            logits, seconds, num_computed = self._mixed(seqs, list(plan.chunks))  # [B, V]
        elif plan.is_prefill:
            logits, seconds, num_computed = self._prefill(seqs)  # [B, V]
        else:
            logits, seconds, num_computed = self._decode(seqs), 0.0, 0  # [B, V]
        # A row is finite iff its max and min are (both propagate NaN): two reductions, where
        # isfinite would write and scan a [B, V] bool tensor every step (measured ~18x slower).
        finite = (logits.amax(dim=1).isfinite() & logits.amin(dim=1).isfinite()).tolist()  # [B]
        keep = [i for i, ok in enumerate(finite) if ok]
        failed = {s: nonfinite_error(s) for s, ok in zip(seqs, finite) if not ok}
        kept_plan = plan if not failed else plan.subset(keep)
        rows = [i for i in keep if samples[i]]
        sampled = [seqs[i] for i in rows]
        if len(rows) < len(seqs):
            logits = logits[rows]  # [S, V], the rows of the requests that sample
        tokens = self.sampler.sample(sampled, logits, masks) if sampled else []
        return StepOutcome(kept_plan, StepResult(tokens, seconds, num_computed), failed)

    def _prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, float, int]:
        """The prompts' last tokens' logits [B, V] (and the prompt logprobs asked for, kept by
        each sequence); the seconds of the forward pass and the prompt tokens it computed."""
        kv = self.kv
        starts = [kv.lengths[s.kv_hold.row] for s in seqs]
        past = [kv.req_to_slot[s.kv_hold.row, :n] if n else None for s, n in zip(seqs, starts)]
        slots = torch.cat([kv.extend(s.kv_hold.row, s.prompt_len - n)
                           for s, n in zip(seqs, starts)])  # fmt: skip
        ids = [t for s, n in zip(seqs, starts) for t in s.request.prompt_ids[n:]]
        positions = [p for s, n in zip(seqs, starts) for p in range(n, s.prompt_len)]
        seg_starts = [0]
        for s, n in zip(seqs, starts):
            seg_starts.append(seg_starts[-1] + s.prompt_len - n)
        rows = logit_rows(seqs, seg_starts)
        started = time.perf_counter()
        logits = self._forward(seqs, ids, positions, slots, seg_starts, past=past, rows=rows)
        logits = score_prompts(seqs, logits, seg_starts)  # [R, V] -> [B, V]
        return logits, time.perf_counter() - started, len(ids)

    def _mixed(self, seqs: list[Sequence], chunks: list[int]) -> tuple[torch.Tensor, float, int]:
        """Logits [B, V] of each segment's last token for a mixed step: request b computes the
        chunks[b] tokens of its prompt and output after the KV its row holds (its past); the
        prompt logprobs of a request that scores its prompt (whole in one chunk, see
        `admission._whole`); the seconds of the forward pass and the prompt tokens computed."""
        kv = self.kv
        starts = [kv.lengths[s.kv_hold.row] for s in seqs]
        past = [kv.req_to_slot[s.kv_hold.row, :n] if n else None for s, n in zip(seqs, starts)]
        slots = torch.cat([kv.extend(s.kv_hold.row, n) for s, n in zip(seqs, chunks)])  # [T]
        scores = [s.request.params.prompt_logprobs is not None and n == s.prompt_len
                  for s, n in zip(seqs, chunks)]  # fmt: skip
        ids, positions, seg_starts, rows = [], [], [0], []
        for seq, start, n, whole in zip(seqs, starts, chunks, scores):
            if start >= seq.prompt_len:  # a decode row (n = 1): its last sampled token
                ids.append(seq.output_ids[-1])
            else:
                ids.extend(seq.request.prompt_ids[start : start + n])
            positions.extend(range(start, start + n))
            end = seg_starts[-1] + n
            rows.extend(range(seg_starts[-1] if whole else end - 1, end))
            seg_starts.append(end)
        started = time.perf_counter()
        logits = self._forward(seqs, ids, positions, slots, seg_starts, past=past, rows=rows)
        last, offset = [], 0  # [R, V] -> [B, V]
        for seq, n, whole in zip(seqs, chunks, scores):
            if whole:
                score_prompts([seq], logits[offset : offset + n], [0, n])
                offset += n
            else:
                offset += 1
            last.append(offset - 1)
        num_prompt = sum(max(0, min(s.prompt_len, b + n) - b)
                         for s, b, n in zip(seqs, starts, chunks))  # fmt: skip
        return logits[last], time.perf_counter() - started, num_prompt

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits [B, V] float32 of each request's next token; takes each one's next KV slot."""
        kv = self.kv
        rows = [s.kv_hold.row for s in seqs]
        positions = [kv.lengths[r] for r in rows]
        slots = kv.extend_each(rows)  # [B] int64; also written into req_to_slot
        ids = [s.output_ids[-1] for s in seqs]
        if self.graphs is not None:
            entries = [s.cache_entry for s in seqs]
            adapters = [e.resident if e else None for e in entries]
            loading = any(e is not None and not e.ticket.done for e in entries)
            logits = self.graphs.run(rows, ids, positions, adapters, loading)
            if logits is not None:
                return logits
        return self._forward(seqs, ids, positions, slots, list(range(len(seqs) + 1)))

    def _forward(
        self,
        seqs: list[Sequence],
        ids: list[int],
        positions: list[int],
        slots: torch.Tensor,
        seg_starts: list[int],
        past: list[torch.Tensor | None] | None = None,
        rows: list[int] | None = None,
    ) -> torch.Tensor:
        """The one `ForwardBatch` of a step and its forward pass: T = len(ids) tokens of B =
        len(seqs) requests, segment b = tokens [seg_starts[b], seg_starts[b+1]). A prefill has
        `past` (each request's cached prefix slots, or None); a decode step (one token each)
        reads every request's KV through the pool's decode index. Returns logits [R, V] of
        `rows` (None: each segment's last token, R = B)."""
        started = time.perf_counter() if self._trace is not None else 0.0
        device = self.model.device
        is_prefill = past is not None
        kv_index = kv_lengths = None
        if not is_prefill:
            rows_kv = [s.kv_hold.row for s in seqs]
            kv_index, kv_lengths = self.kv.decode_index(rows_kv)  # [B, Lmax], [B]
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),  # [T]
            positions=torch.tensor(positions, dtype=torch.int64, device=device),  # [T]
            slots=slots,  # [T]
            seg_starts=seg_starts,
            is_prefill=is_prefill,
            kv_index=kv_index,
            kv_lengths=kv_lengths,
            past_slots=past,
            lora=self.lora.step([s.cache_entry for s in seqs], seg_starts, is_prefill),
            logit_rows=None if rows is None else torch.tensor(rows, device=device),
        )
        logits = self.model.forward(batch, self.kv)
        if self._trace is not None:
            self._trace.step(StepEvent(is_prefill, len(ids), started, time.perf_counter()))
        return logits
