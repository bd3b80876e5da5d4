"""The plan of one step and what running it gave: the typed contract between the scheduler, which
makes plans, and whatever runs them (the model runner, a simulator's step-time model)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.request import TokenLogprob
from toppings.server.requests.sequence import Sequence


@dataclass(frozen=True)
class StepPlan:
    """One step, in vLLM v1's single shape: its requests (one adapter's side by side, so the
    LoRA kernels run once per run of them), the tokens each computes (`tokens`: a decode 1, a
    prompt its chunk, an unchunked prompt all of what its cached prefix leaves), the position
    its tokens start at (`starts`: its computed-token count before the step, the slots the
    scheduler reserved for it following), and whether it samples a token (`samples`: a decode,
    or the chunk that ends its prompt). `is_prefill`: whether the step computes prompt tokens
    (else every count is 1 and the step is a decode step, which CUDA graphs may replay)."""

    seqs: tuple[Sequence, ...]
    tokens: tuple[int, ...]
    samples: tuple[bool, ...]
    starts: tuple[int, ...]
    is_prefill: bool

    @classmethod
    def of(cls, chunks: Mapping[Sequence, int], starts: Mapping[Sequence, int]) -> StepPlan:
        """The plan of these requests computing `chunks[seq]` tokens from `starts[seq]`, before
        any runs (a request not yet prefilled samples when its chunk ends its prompt)."""
        seqs = tuple(sorted(chunks, key=_adapter_key))
        tokens = tuple(chunks[s] for s in seqs)
        samples = tuple(s.is_prefilled or s.num_prefilled + chunks[s] >= s.prefill_len
                        for s in seqs)  # fmt: skip
        is_prefill = not all(s.is_prefilled for s in seqs)
        return cls(seqs, tokens, samples, tuple(starts.get(s, 0) for s in seqs), is_prefill)

    @property
    def sampled(self) -> tuple[Sequence, ...]:
        """The requests that get a token from this step, in plan order."""
        return tuple(s for s, sample in zip(self.seqs, self.samples) if sample)

    def subset(self, keep: list[int]) -> StepPlan:
        """The plan of the requests at indices `keep` only."""

        def pick(values: tuple) -> tuple:
            return tuple(values[i] for i in keep)

        seqs = pick(self.seqs)
        return StepPlan(seqs, pick(self.tokens), pick(self.samples), pick(self.starts),
                        self.is_prefill)  # fmt: skip


@dataclass(frozen=True)
class StepResult:
    """What running a plan gave: one token per request of `plan.sampled`, in order (with its
    logprob where the request asked for them: `logprobs`, None when none did), and for the
    memory's prefill-speed estimate the forward's seconds and the prompt tokens it computed."""

    tokens: list[int]
    forward_s: float = 0.0
    num_computed: int = 0
    logprobs: list[TokenLogprob | None] | None = None


def _adapter_key(seq: Sequence) -> tuple[bool, AdapterRef | None]:
    """Groups a step's requests by adapter: the base model first, then by id."""
    adapter = seq.request.adapter
    return adapter is not None, adapter
