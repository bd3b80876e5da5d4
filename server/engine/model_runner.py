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

A step runs in two parts (`run` is both): `prepare` reads what the step needs from the requests
on the engine thread, before the next plan moves them on; `execute` makes its tensors, reads the
KV tables, runs the forward pass and samples, on the device lane with async scheduling
(step_pipeline.py), where a decode's input may be the token the step before samples. A decode
step's rows are not rebuilt: the runner's `DecodeBatch` (decode_batch.py) keeps them from step to
step, updated from each plan's changes in `prepare` (on a CPU the KV index is read there too);
`execute` fills the continuing rows' tokens from the step before, copies the rows to the device
(one copy, none on a CPU) and runs them.

A request whose logits hold inf or NaN (an adapter whose product overflows the dtype) is taken
out before sampling and fails alone (`StepOutcome.failed`); the others of the batch sample as if
it had not been there, which holds because nothing of the forward mixes rows of different
requests (attention reads each request's own keys, the LoRA kernels each request's own rows).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy
import torch

from toppings.gpu_lora.trace import StepEvent, TraceRecorder
from toppings.server.adapters.step import AdapterStep
from toppings.server.engine.decode_batch import (
    IDS,
    KV_ROWS,
    LENGTHS,
    POSITIONS,
    SLOTS,
    DecodeBatch,
    DecodeRows,
)
from toppings.server.memory.kv_cache import KVPool
from toppings.server.memory.past_table import PastTable
from toppings.server.model.decode_path import Scanned
from toppings.server.model.graph_buckets import GraphBuckets
from toppings.server.model.llama import ForwardBatch, LlamaModel
from toppings.server.requests.sequence import Sequence
from toppings.server.sampling.grammar import GrammarCompiler
from toppings.server.sampling.logits_scan import scan_logits
from toppings.server.sampling.sampler import Sampler, score_prompt
from toppings.server.sched.plan import StepPlan, StepResult


@dataclass(frozen=True)
class StepOutcome:
    """A plan run: `result` holds the tokens of `plan` (the plan run, less the requests that
    failed), `failed` each failed request with its error."""

    plan: StepPlan
    result: StepResult
    failed: dict[Sequence, str] = field(default_factory=dict)

    def tokens_by_request(self) -> dict[Sequence, int]:
        """Each sampling request's new token."""
        return dict(zip(self.plan.sampled, self.result.tokens))


@dataclass
class PreparedStep:
    """A plan and what its forward pass reads from the requests, read on the engine thread
    before the next plan moves them on (T tokens, B requests). A decode step: its rows
    (`decode`, the runner's DecodeBatch's) and on a CPU its KV index (`kv_index` [B, Lmax]).
    A prefill or mixed step: input `ids` [T] (a token still in flight is 0 here, its index and
    request in `in_flight`), `positions` [T], `seg_starts` [B+1], the logit `rows` [R], which
    requests score their prompt chunk (`scores` [B]: each of its rows a logit row), each
    request's KV row (`kv_rows` [B])."""

    plan: StepPlan
    num_prompt: int  # the prompt tokens it computes
    has_constraint: bool  # whether a request of it is constrained (grammar masks)
    decode: DecodeRows | None = None
    kv_index: torch.Tensor | None = None
    ids: list[int] = field(default_factory=list)
    in_flight: list[tuple[int, Sequence]] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seg_starts: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    scores: list[bool] = field(default_factory=list)
    kv_rows: list[int] = field(default_factory=list)


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
    step, server/adapters/step.py; graphs: None where CUDA graphs are off or the device is not CUDA;
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
        self.rows = DecodeBatch(kv, model.device)  # the decode step's rows, step to step
        self._last: tuple[StepPlan, StepOutcome] | None = None  # execute's last plan, outcome

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
        return self.execute(self.prepare(plan))

    def prepare(self, plan: StepPlan, pending: StepPlan | None = None) -> PreparedStep:
        """What the step reads from the requests and the KV tables, read now (the engine
        thread, before the next plan reserves more slots). pending: the plan of the step still
        on the device (async scheduling), whose sampled tokens are the inputs of its requests
        here: they are taken from its result when this one executes."""
        if not plan.is_prefill:
            rows = self.rows.update(plan, pending)
            index = None
            if self.rows.on_host:  # the table is host memory: read it now, off the lane
                index = self.kv.decode_table(rows.views.array[KV_ROWS], rows.max_length)
            return PreparedStep(plan, 0, rows.has_constraint, rows, index)
        self.rows.reset()  # its decodes move on without the decode batch
        in_flight = frozenset(pending.sampled) if pending is not None else frozenset()
        seqs = plan.seqs
        step = PreparedStep(plan, 0, any(s.request.params.constraint is not None for s in seqs))
        ids, positions, seg_starts, rows = step.ids, step.positions, step.seg_starts, step.rows
        seg_starts.append(0)
        for seq, start, n in zip(seqs, plan.starts, plan.tokens):
            if start >= seq.prefill_len:  # a decode row (n = 1): its last sampled token
                if seq in in_flight:
                    step.in_flight.append((len(ids), seq))
                    ids.append(0)
                else:
                    ids.append(seq.output_ids[-1])
                scored = False
            else:
                ids.extend(seq.prefill_ids[start : start + n])
                scored = seq.scores_prompt  # its chunk's rows
            positions.extend(range(start, start + n))
            end = seg_starts[-1] + n
            rows.extend(range(seg_starts[-1] if scored else end - 1, end))
            seg_starts.append(end)
            step.scores.append(scored)
        step.kv_rows.extend(s.kv_hold.row for s in seqs)
        step.num_prompt = sum(max(0, min(s.prefill_len, b + n) - b)
                              for s, b, n in zip(seqs, plan.starts, plan.tokens))  # fmt: skip
        return step

    def execute(self, step: PreparedStep, previous: StepOutcome | None = None) -> StepOutcome:
        """Run a prepared step: its forward pass and each sampling request's next token
        (`previous`: the outcome of the step before it, whose tokens are the inputs of
        `step.in_flight`; a request that got none there, having failed, computes token 0,
        dropped with it)."""
        plan = step.plan
        if step.in_flight:
            tokens = previous.tokens_by_request() if previous is not None else {}
            for i, seq in step.in_flight:
                step.ids[i] = tokens.get(seq, 0)
        if step.decode is not None:
            self._fill_tokens(step.decode)
        seqs, samples = list(plan.seqs), plan.samples
        # grammar masks of the requests that sample, computed during the forward
        masks = self.sampler.start_masks(list(plan.sampled)) if step.has_constraint else None
        logits = scanned = None
        if self.graphs is not None and step.decode is not None:  # a graph may run it
            logits = self._replay(step.decode)
        if logits is None:
            logits, scanned, seconds, num_computed = self._forward(step)  # [B, V]
        else:
            seconds, num_computed = 0.0, 0
        # [B] each: finite rows, argmax (sampling/logits_scan.py; scanned: by the native step)
        finite, best = scanned if scanned is not None else scan_logits(logits)
        if all(finite) and all(samples):  # a decode step's usual case: every row as it is
            failed, kept_plan, sampled, argmax = {}, plan, seqs, best
        else:
            keep = [i for i, ok in enumerate(finite) if ok]
            failed = {s: nonfinite_error(s) for s, ok in zip(seqs, finite) if not ok}
            kept_plan = plan if not failed else plan.subset(keep)
            rows = [i for i in keep if samples[i]]
            sampled = [seqs[i] for i in rows]
            if len(rows) < len(seqs):
                logits = logits[rows]  # [S, V], the rows of the requests that sample
            argmax = [best[i] for i in rows]
        if not sampled:
            outcome = StepOutcome(kept_plan, StepResult([], seconds, num_computed), failed)
        else:
            drawn = self.sampler.sample(sampled, logits, masks, argmax)
            result = StepResult(drawn.tokens, seconds, num_computed, drawn.logprobs)
            outcome = StepOutcome(kept_plan, result, failed)
        self._last = (plan, outcome)
        return outcome

    def _fill_tokens(self, rows: DecodeRows) -> None:
        """The continuing rows' inputs: the tokens of the step before (the one this runner
        executed last, when it is the rows' source)."""
        if rows.token_dst is None:
            return
        ran, outcome = self._last if self._last is not None else (None, None)
        if ran is None or ran is not rows.source:  # the step before failed: its rows with it
            rows.fill_each(None)
        elif outcome.plan is ran:  # every row of it sampled, none failed
            rows.fill(outcome.result.tokens)
        else:
            rows.fill_each(outcome.tokens_by_request())

    def _replay(self, rows: DecodeRows) -> torch.Tensor | None:
        """A decode step's logits [B, V] from its CUDA graph, or None where the graphs decline
        (then the step runs eagerly)."""
        entries = rows.entries
        if self.lora.has_dora(entries):
            return None  # the graphs' LoRA does not scale DoRA rows
        adapters = [e.resident if e else None for e in entries]
        loading = any(e is not None and not e.ticket.done for e in entries)
        fields = rows.views.array  # [F, B] int64, the step's set (host memory)
        return self.graphs.run(fields[IDS], fields[POSITIONS], fields[KV_ROWS], adapters, loading)

    def _forward(self, step: PreparedStep) -> tuple[torch.Tensor, Scanned | None, float, int]:
        """The one `ForwardBatch` of a step and its forward pass: request b computes its
        plan.tokens[b] tokens from position plan.starts[b] (its prompt's next chunk, or its
        last sampled token) after the KV its row holds (its past). Returns the logits [B, V]
        of each request's last token (and keeps the prompt logprobs of the chunk of a request
        that scores its prompt: `sampler.score_prompt`), their scan where the model's
        native step scanned them (else None), the seconds of the forward pass (a scored
        prompt's LM head and logprobs not counted) and the prompt tokens it computed."""
        plan = step.plan
        batch = self._decode_batch(step) if step.decode is not None else self._prefill_batch(step)
        scores = any(step.scores)
        started = time.perf_counter()
        if not scores:
            logits, scanned = self.model.forward(batch, self.kv)  # [B, V]
        else:  # the scored rows' hidden states [R, H]; their logits by chunks, below
            hidden, scanned = self.model.hidden(batch, self.kv), None
            segments = self._logit_segments(plan, step.scores)  # [B] (first row, rows) in R
            logits = self.model.head(hidden[[a + n - 1 for a, n in segments]])  # [B, V]
        seconds = time.perf_counter() - started
        if self._trace is not None:
            num_tokens = batch.input_ids.shape[0]
            self._trace.step(StepEvent(plan.is_prefill, num_tokens, started, started + seconds))
        if scores:
            for seq, start, (a, n), scored in zip(plan.seqs, plan.starts, segments, step.scores):
                if scored:
                    score_prompt(seq, start, hidden[a : a + n], self.model.head)
        return logits, scanned, seconds, step.num_prompt

    @staticmethod
    def _logit_segments(plan: StepPlan, scores: list[bool]) -> list[tuple[int, int]]:
        """Each request's rows among a scoring step's logit rows, as (first, count): a scored
        segment has all of its rows there, any other its last one alone."""
        segments, offset = [], 0
        for n, scored in zip(plan.tokens, scores):
            count = n if scored else 1
            segments.append((offset, count))
            offset += count
        return segments

    def _decode_batch(self, step: PreparedStep) -> ForwardBatch:
        """A decode step's batch (every count 1, no prompt token) over its rows, copied to the
        device (on a CPU: the rows themselves); it reads every request's KV through the pool's
        decode index, gathered on the device there (read in `prepare` on a CPU)."""
        rows = step.decode
        fields = self.rows.device_fields(rows)  # [B] each
        slots, kv_index = fields[SLOTS], step.kv_index
        if kv_index is None:  # in stream order: the slots were reserved before this step
            slots = self.kv.slots_at(fields[KV_ROWS], fields[POSITIONS])  # [B]
            kv_index = self.kv.decode_table(fields[KV_ROWS], rows.max_length)  # [B, Lmax]
        lora = self.lora.step(rows.entries, rows.seg_starts, False, generation=rows.generation)
        return ForwardBatch(
            input_ids=fields[IDS],  # [B]
            positions=fields[POSITIONS],  # [B]
            slots=slots,  # [B]
            seg_starts=rows.seg_starts,
            is_prefill=False,
            kv_index=kv_index,  # [B, Lmax]
            kv_lengths=fields[LENGTHS],  # [B]
            lora=lora,
        )

    def _prefill_batch(self, step: PreparedStep) -> ForwardBatch:
        """A step with prompt tokens: each segment reads its past from the pool, exactly as a
        prefill over a cached prefix."""
        plan, device, table = step.plan, self.model.device, self.kv.req_to_slot
        kv_rows, seqs = step.kv_rows, plan.seqs
        # The KV tables are read here, in stream order on a device: the slots of the step and
        # of each request's past were reserved before it and stay put while it holds its row.
        slots = gather_slots(table, kv_rows, plan.starts, plan.tokens)  # [T]
        past = PastTable(table, kv_rows, list(plan.starts))  # each segment's, as spans
        lora = self.lora.step(
            [s.cache_entry for s in seqs], step.seg_starts, True, list(plan.starts),
            [s.lora_start for s in seqs],
        )  # fmt: skip
        return ForwardBatch(
            input_ids=torch.tensor(step.ids, dtype=torch.int64, device=device),  # [T]
            positions=torch.tensor(step.positions, dtype=torch.int64, device=device),  # [T]
            slots=slots,  # [T]
            seg_starts=step.seg_starts,
            is_prefill=True,
            past_slots=past,
            lora=lora,
            logit_rows=None if not any(step.scores) else torch.tensor(step.rows, device=device),
        )


GATHER_FROM_SEGMENTS = 16  # more segments than this: their slots by one gather


def gather_slots(table: torch.Tensor, rows: list[int], starts: list[int], counts: list[int]):
    """`table[r, b : b + n]` of each (r, b, n) in turn, [sum n], from the request table [R, Lmax]:
    sliced row by row for a few segments, else by one gather (a slice costs about 1.7 us in
    Python, 0.43 ms a mixed step of 256 decodes and a chunk on the 2-core Xeon, 0.03 ms gathered;
    the gather's own fixed cost is about 30 us). The index goes to a device table by a
    non-blocking copy, as the paged attention plans' do (unmeasured on a GPU)."""
    if len(rows) <= GATHER_FROM_SEGMENTS:
        return torch.cat([table[r, b : b + n] for r, b, n in zip(rows, starts, counts)])
    n = numpy.asarray(counts, dtype=numpy.int64)
    # each token's column: its place in the step, less its segment's first place, plus its start
    shift = numpy.asarray(starts, dtype=numpy.int64) - (numpy.cumsum(n) - n)
    columns = numpy.arange(int(n.sum()), dtype=numpy.int64) + numpy.repeat(shift, n)
    flat = numpy.repeat(numpy.asarray(rows, dtype=numpy.int64) * table.shape[1], n) + columns
    index = torch.from_numpy(flat)
    if table.device.type != "cpu":
        index = index.to(table.device, non_blocking=True)
    return table.reshape(-1)[index]
