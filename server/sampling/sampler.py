"""From the model's logits to each request's next token: prompt scoring, processors, sampling,
logprobs (the model runner's side of a step; `Sequence` keeps only the results).

Each sampled request has its own `torch.Generator` (server/sampling/next_token.py), made at its
first sampled token and kept while it lives (a request taken out of the batch and resumed goes
on drawing from it), so a seeded request draws the same tokens in any batch.

A request with a `constraint` has its own grammar matcher (server/sampling/grammar.py), made the
same way: at its first token, kept through a resume. Its row's logits (after the processors)
keep only the tokens the grammar allows; the other rows of the batch are not touched, so a free
request samples exactly what it would without constrained neighbours. The masks of a step can
be computed while the model runs (`start_masks` before the forward pass, on the sampler's mask
thread; llguidance releases the GIL). The sampled token advances the matcher; when the grammar
is complete and allows nothing more, the sequence is told (`step_ends_grammar`) and stops; when
the matcher fails (no way on, a limit passed), it ends with an error (`step_grammar_error`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from toppings.server.process.threads import torch_on_this_thread_only
from toppings.server.requests.request import TokenLogprob
from toppings.server.requests.sequence import Sequence
from toppings.server.sampling.grammar import GrammarCompiler, apply_masks, fill_masks, matcher_error
from toppings.server.sampling.logits import LOGPROB_CHUNK_ROWS, process_row, token_logprobs
from toppings.server.sampling.next_token import make_generator, sample_next

log = logging.getLogger(__name__)


def score_prompt(
    seq: Sequence, start: int, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Keep the prompt logprobs of one chunk of a sequence that asked for them: `hidden` [n, H]
    the final hidden states of its prompt positions start .. start + n - 1, each scoring the
    prompt token after it (the prompt's last position predicts the output: not scored here);
    `head` makes float32 logits [r, V] of r of those rows. The logits go by chunks of
    `LOGPROB_CHUNK_ROWS` rows: a chunk of n tokens never holds its [n, V] at once (8k tokens
    of a 128k vocabulary would be 4.2 GB of them)."""
    ids = seq.request.prompt_ids
    end = min(start + hidden.shape[0], len(ids) - 1)
    k = seq.request.params.prompt_logprobs
    scored: list[TokenLogprob] = []
    for first in range(start, end, LOGPROB_CHUNK_ROWS):
        last = min(first + LOGPROB_CHUNK_ROWS, end)
        rows = hidden[first - start : last - start]
        scored.extend(token_logprobs(head(rows), ids[first + 1 : last + 1], k))
    seq.add_prompt_logprobs(start, start + hidden.shape[0], scored)


@dataclass(frozen=True)
class Sampled:
    """A batch's next tokens, and each one's logprob where its request asked (None: none did)."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None] | None


@dataclass(frozen=True)
class PendingMasks:
    """The grammar masks of a step's constrained requests, being computed: `bitmask` gives int32
    [M, W], row m for `seqs[m]`."""

    seqs: tuple[Sequence, ...]
    bitmask: Future


class Sampler:
    """Next tokens of a batch; holds the random generators and grammar matchers of the requests
    it samples. `grammars` compiles constraints (None: a model without structured output)."""

    def __init__(self, eos_ids: set[int], grammars: GrammarCompiler | None = None):
        self.eos_ids = eos_ids
        self.grammars = grammars
        # request -> its generator (None: greedy); entries go with their request
        self._generators: weakref.WeakKeyDictionary[Sequence, torch.Generator | None] = (
            weakref.WeakKeyDictionary()
        )
        # request -> its grammar matcher
        self._matchers: weakref.WeakKeyDictionary[Sequence, llguidance.LLMatcher] = (
            weakref.WeakKeyDictionary()
        )
        # request -> its allowed_token_ids as an index tensor, made at its first token
        self._allowed: weakref.WeakKeyDictionary[Sequence, torch.Tensor] = (
            weakref.WeakKeyDictionary()
        )
        self._mask_thread: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None

    def matcher(self, seq: Sequence) -> llguidance.LLMatcher:
        """The request's grammar matcher, made at its first token."""
        made = self._matchers.get(seq)
        if made is None:
            if self.grammars is None:
                raise RuntimeError("a constrained request reached a sampler without grammars")
            made = self._matchers[seq] = self.grammars.matcher(seq.request.params.constraint)
        return made

    def _allowed_index(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor | None:
        """The request's `allowed_token_ids` as an index on the logits' device, made once
        (None: it allows every token)."""
        ids = seq.request.params.allowed_token_ids
        if not ids:
            return None
        index = self._allowed.get(seq)
        if index is None:
            index = self._allowed[seq] = torch.tensor(ids, device=logits.device)
        return index

    def start_masks(self, seqs: list[Sequence]) -> PendingMasks | None:
        """Begin computing the grammar masks of the constrained requests of `seqs` on the mask
        thread (None when none is constrained)."""
        constrained = tuple(s for s in seqs if s.request.params.constraint is not None)
        if not constrained:
            return None
        matchers = [self.matcher(s) for s in constrained]
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(
                1, thread_name_prefix="grammar-masks", initializer=torch_on_this_thread_only
            )  # no OpenMP team beside the engine's (threads.py)
            self._executor = llguidance.LLExecutor()
        vocab = self.grammars.vocab_size
        future = self._mask_thread.submit(fill_masks, self._executor, matchers, vocab)
        return PendingMasks(constrained, future)

    def _constrain(
        self,
        seqs: list[Sequence],
        logits: torch.Tensor,
        chosen_from: torch.Tensor,
        masks: PendingMasks | None,
    ) -> None:
        """Mask the constrained rows of `chosen_from` [B, V] in place (`logits`: the raw ones)."""
        rows = [i for i, s in enumerate(seqs) if s.request.params.constraint is not None]
        if masks is None or any(seqs[i] not in masks.seqs for i in rows):
            masks = self.start_masks(seqs)
        bitmask = masks.bitmask.result()  # [M, W]
        order = {s: m for m, s in enumerate(masks.seqs)}
        picked = bitmask[[order[seqs[i]] for i in rows]]  # [M', W]
        apply_masks(chosen_from, logits, rows, picked)

    def _advance(self, seqs: list[Sequence], tokens: list[int]) -> None:
        """Feed each constrained request its token; mark the ones whose grammar is done."""
        for seq, token in zip(seqs, tokens):
            if seq.request.params.constraint is None:
                continue
            matcher = self.matcher(seq)
            if not matcher.consume_token(token) or matcher.is_error():
                constraint = seq.request.params.constraint
                error = matcher_error(matcher)
                log.warning("request %s: its grammar failed at token %d: %s",
                            seq.request.request_id, token, error)  # fmt: skip
                seq.step_grammar_error = (
                    f"the {constraint.what} constraint failed while generating: the grammar "
                    f"engine found no way to go on ({error}); the output does not satisfy it"
                )
            elif matcher.is_stopped():
                seq.step_ends_grammar = True

    def generator(self, seq: Sequence) -> torch.Generator | None:
        """The request's generator (None: greedy), made at its first token."""
        if seq not in self._generators:
            self._generators[seq] = make_generator(seq.request.params)
        return self._generators[seq]

    def sample(
        self,
        seqs: list[Sequence],
        logits: torch.Tensor,
        masks: PendingMasks | None = None,
        argmax: list[int] | None = None,
    ) -> Sampled:
        """Next token of each sequence from its row of logits [B, V] float32 (argmax: each
        row's, where the caller has it: the greedy rows that nothing processes take it).

        Rows with penalties, a logit bias or min_tokens are processed first, then constrained
        rows keep only their grammar's tokens (`masks` from `start_masks`, computed here when
        None); the logprobs asked for are taken from the unprocessed rows (see
        server/sampling/logits.py) and returned beside the tokens."""
        if argmax is not None and all(s.request.params.takes_argmax for s in seqs):
            return Sampled(list(argmax), None)  # every row greedy as it stands
        params = [s.request.params for s in seqs]
        chosen_from = logits
        is_constrained = any(p.constraint is not None for p in params)
        if is_constrained or any(p.has_processors for p in params):
            chosen_from = logits.clone()
            for i, (seq, p) in enumerate(zip(seqs, params)):
                if p.has_processors:
                    prompt, allowed = seq.request.prompt_ids, self._allowed_index(seq, logits)
                    chosen_from[i] = process_row(
                        logits[i], p, prompt, seq.output_ids, self.eos_ids, allowed
                    )
        if is_constrained:
            self._constrain(seqs, logits, chosen_from, masks)
        if chosen_from is not logits:
            argmax = None  # processed or constrained: the argmax of what they left
        generators = [None if p.is_greedy else self.generator(s) for s, p in zip(seqs, params)]
        tokens = sample_next(chosen_from, params, generators, argmax)
        if is_constrained:
            self._advance(seqs, tokens)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not want:
            return Sampled(tokens, None)
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        k = max(params[i].logprobs for i in want)
        scored = token_logprobs(logits[want], [tokens[i] for i in want], k)
        for i, lp in zip(want, scored):
            top = lp.top[: params[i].logprobs]
            logprobs[i] = TokenLogprob(lp.token_id, lp.logprob, top, lp.rank)
        return Sampled(tokens, logprobs)
