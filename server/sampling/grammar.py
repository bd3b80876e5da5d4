"""Structured output: a request's `Constraint` compiled into a grammar, matched token by token.

The grammar engine is llguidance (compared with xgrammar 0.2.8 on SmolLM2's tokenizer: llguidance
builds a JSON-schema matcher far faster than xgrammar compiles one; xgrammar's mask is faster, both
far below a decode step: docs/benchmarks.md, "Measurements behind the code"; and llguidance refuses
the schema keywords it does not implement, `not`, `if`/`then`, `uniqueItems`, which xgrammar 0.2.8
accepts and then ignores, so a client would get output its schema rejects). See README.md
"Structured output".

`GrammarCompiler` turns a constraint into a matcher with nothing consumed yet, once per distinct
(kind, text) in a bounded LRU cache, and refuses what it cannot compile with a `RequestError`
before the request is queued, the grammars whose first step it cannot take (an empty
language, a limit passed) and the JSON schemas that allow no finite value
(server/sampling/schema_finite.py) included; each request then matches on its own deep copy.
`fill_masks` computes the allowed tokens of many matchers at once (llguidance's thread pool, the GIL
released), `apply_masks` sets the other tokens' logits to -inf in the given rows only.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import OrderedDict

import llguidance
import llguidance.hf
import numpy as np
import torch

from toppings.server.requests.request import Constraint, ConstraintKind, RequestError
from toppings.server.sampling.schema_finite import has_finite_instance
from toppings.server.sampling.schema_refs import close_objects

MAX_CACHED_GRAMMARS = 256
# JSON as a model usually writes it, with one space after separators and no other whitespace:
# a small model left free to add whitespace can fill max_tokens with newlines.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's limits: a grammar or schema past them is refused when it is compiled.
LIMITS = llguidance.LLParserLimits(max_grammar_size=200_000, verbose_errors=False)


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint; raises RequestError for a malformed spec."""
    spec = constraint.spec
    kind = constraint.kind
    try:
        if kind is ConstraintKind.JSON_SCHEMA:  # its objects closed to the keys they list
            closed = json.dumps(close_objects(json.loads(spec)))
            return llguidance.LLMatcher.grammar_from_json_schema(closed, defaults=JSON_OPTIONS)
        if kind is ConstraintKind.REGEX:
            # \d, \w and \s as ASCII classes (as Python's re.ASCII), not every Unicode digit
            return llguidance.LLMatcher.grammar_from_lark(
                f"start: /{llguidance.regex_to_lark(spec, 'dws')}/"
            )
        if kind is ConstraintKind.CHOICE:
            choices = json.loads(spec)
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices)
            )
        return llguidance.grammar_from("grammar", spec)  # GBNF/EBNF, or Lark as is
    except ValueError as e:
        raise RequestError(f"invalid {constraint.what}: {e}") from None


def matcher_error(matcher: llguidance.LLMatcher) -> str:
    """A matcher's error without llguidance's markup."""
    return matcher.get_error().replace("<non-verbose/>", "").strip() or "no reason given"


class GrammarCompiler:
    """Constraints -> matchers, compiled once per distinct text (thread-safe: HTTP handler
    threads compile, the engine thread copies).

    `tokenizer` is a fast Hugging Face tokenizer; `vocab_size` the width of the model's logits;
    `eos_ids` the tokens that end a request (a grammar allows them where it is complete).
    The llguidance tokenizer is built at the first constraint (about half a second).
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_ids: set[int],
        max_cached: int = MAX_CACHED_GRAMMARS,
    ):
        self.vocab_size = vocab_size
        self.max_cached = max_cached
        self._hf_tokenizer = tokenizer
        self._eos_ids = sorted(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and benchmarks

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_ids
                )
            except ValueError as e:
                raise RequestError(f"structured output is not available for this model: {e}") from e
        return self._tokenizer

    def compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        """The cached matcher of `constraint`, nothing consumed (copy it before use); raises
        RequestError when the spec is invalid, uses a feature the engine lacks, or is too big."""
        with self._lock:
            template = self._cache.get(constraint)
            if template is not None:
                self._cache.move_to_end(constraint)
                return template
            tokenizer = self._llg_tokenizer()
        grammar = grammar_text(constraint)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, tokenizer, limits=LIMITS
        )
        if is_error:
            raise RequestError(f"invalid {constraint.what}: {'; '.join(messages)}")
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
        if template.is_error():
            raise RequestError(f"invalid {constraint.what}: {matcher_error(template)}")
        _check_first_step(template, constraint)
        _check_finite(constraint)
        with self._lock:
            self.num_compiled += 1
            self._cache[constraint] = template
            self._cache.move_to_end(constraint)
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return template

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher of its own for one request."""
        return self.compile(constraint).deep_copy()


def _check_first_step(template: llguidance.LLMatcher, constraint: Constraint) -> None:
    """Refuse, before anything is queued, a grammar whose first step the engine cannot take:
    an empty language (`root ::= root`, a `$ref` that only refers to itself) or one past the
    engine's limits where its first mask is computed. Probed on a copy: the template stays
    untouched for the requests that copy it. Twice: the copies share the lexer's expressions,
    and a first step can build so many (`(a{1000}){1000}`: 0.8 s) that the next copy's fails
    at once, as every request's would (a 422 mid-request, where a 400 is due); a second probe
    of a grammar that passes costs microseconds, its states built."""
    for _ in range(2):
        probe = template.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():
            raise RequestError(
                f"invalid {constraint.what}: the grammar engine finds no output that satisfies "
                f"it ({matcher_error(probe)})"
            )


def _check_finite(constraint: Constraint) -> None:
    """Refuse a JSON schema whose every value nests without end: llguidance would let the model
    write a prefix of one until `max_tokens` (see server/sampling/schema_finite.py)."""
    if constraint.kind is ConstraintKind.JSON_SCHEMA and not has_finite_instance(constraint.spec):
        raise RequestError(
            f"invalid {constraint.what}: the grammar engine finds no output that satisfies it "
            "(every value it allows nests without end: a $ref cycle each value must follow)"
        )


def fill_masks(executor: llguidance.LLExecutor, matchers: list, vocab_size: int) -> torch.Tensor:
    """The allowed next tokens of each matcher as a bitmask int32 [M, ceil(V/32)]: bit j of word
    w is token 32*w + j."""
    words = (vocab_size + 31) // 32
    bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)  # [M, W]
    if matchers:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(matchers))
    return bitmask


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The allowed tokens of a bitmask int32 [M, W] (CPU) as bool [M, V]: token 32*w + j is
    allowed when bit j of word w is set. numpy's unpackbits does it in one C pass over the
    bytes (shifting a [M, W, 32] int32 tensor was far slower for a batch of rows)."""
    words = bitmask.numpy()
    if sys.byteorder != "little":  # byte k of a word must hold its bits 8k..8k+7
        words = words.byteswap()
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")  # [M, 32 W]
    return torch.from_numpy(bits[:, :vocab_size]).view(torch.bool)


def apply_masks(
    logits: torch.Tensor, raw: torch.Tensor, rows: list[int], bitmask: torch.Tensor
) -> None:
    """Set to -inf, in place, the logits of the tokens a grammar forbids, in `rows` only.

    logits float32 [B, V] (after processors), raw float32 [B, V] (the model's); rows: M row
    indices; bitmask int32 [M, W] from `fill_masks`. A row whose every allowed token a processor
    had set to -inf (min_tokens masking EOS where the grammar allows only EOS) takes the allowed
    tokens' raw logits instead: the grammar wins.
    """
    if not rows:
        return
    forbidden = unpack_bitmask(bitmask, logits.shape[1]).logical_not().to(logits.device)  # [M, V]
    every_row = rows == list(range(logits.shape[0]))
    index = None if every_row else torch.tensor(rows, device=logits.device)
    picked = logits if every_row else logits[index]  # [M, V]
    picked.masked_fill_(forbidden, float("-inf"))
    empty = picked.amax(dim=1) == float("-inf")  # [M]
    if bool(empty.any()):
        fallback = (raw if every_row else raw[index]).masked_fill(forbidden, float("-inf"))
        picked.copy_(torch.where(empty[:, None], fallback, picked))
    if not every_row:
        logits[index] = picked
