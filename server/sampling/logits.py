"""What happens to a row of logits between the model and the token: processors and logprobs.

Processors (vLLM's order and semantics): `allowed_token_ids` (every other token masked), logit
bias and the `min_tokens` EOS mask, then the repetition penalty (prompt and output tokens), then
frequency and presence penalties (output tokens). Sampling (temperature, top-k, top-p) follows
in `sampling.py`. Log-probabilities are taken from the model's logits before any of this
(vLLM's default "raw logprobs"), so they are what transformers' log-softmax gives for the same
adapter and prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy
import torch

from toppings.server.native import library as native_library
from toppings.server.requests.request import SamplingParams, TokenLogprob

LOGPROB_CHUNK_ROWS = 256


def process_row(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    eos_ids: set[int],
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """One row of logits [V] float32 after bias, EOS mask and penalties; a new tensor.
    `allowed`: `params.allowed_token_ids` as an index tensor, where the caller keeps one (made
    here otherwise: 0.5 ms for 4,096 ids, too much to make again at every token)."""
    row = logits.clone()
    vocab = row.shape[0]
    if params.allowed_token_ids:
        if allowed is None:
            allowed = torch.tensor(params.allowed_token_ids, device=row.device)
        kept = row[allowed]
        row.fill_(float("-inf"))
        row[allowed] = kept
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias)
        row[list(ids)] += torch.tensor(biases, dtype=row.dtype, device=row.device)
    if len(output_ids) < params.min_tokens:
        ends = eos_ids | params.stop_token_ids
        row[[t for t in ends if t < vocab]] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), device=row.device)
        picked = row[seen]
        row[seen] = torch.where(
            picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty
        )
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = torch.bincount(
            torch.tensor(list(output_ids), device=row.device), minlength=vocab
        ).to(row.dtype)  # [V]
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return row


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """Each row's log-softmax value of its token, its rank and its top-k. logits float32 [R, V].

    Rows go through in chunks, so scoring a long prompt holds one chunk's log-softmax at a time.
    On a CPU one native call a chunk (`logits_logprobs` in server/native/csrc/logits.c: two reads
    of each row, nothing written but the results), where the torch ops below write the chunk's
    log-softmax and read it three times (1.0 ms against 5.5-7 for 64 rows of SmolLM2's 49,152 on
    a 2-core Xeon, docs/benchmarks.md); the same values to float rounding, the same ranks and tops
    (equal logits: the lower id first).
    """
    out: list[TokenLogprob] = []
    lib = native_library() if logits.device.type == "cpu" else None
    for start in range(0, len(token_ids), LOGPROB_CHUNK_ROWS):
        rows = logits[start : start + LOGPROB_CHUNK_ROWS]
        ids = token_ids[start : start + LOGPROB_CHUNK_ROWS]
        fields = None if lib is None else _native_logprobs(lib, rows, ids, k)
        out.extend(TokenLogprob(*f) for f in (fields or _torch_logprobs(rows, ids, k)))
    return out


def _native_logprobs(lib, rows: torch.Tensor, ids: list[int], k: int) -> zip | None:
    """token_logprobs' fields of one chunk from the native pass (None: it declined)."""
    if rows.dtype != torch.float32 or rows.stride(1) != 1:
        return None
    r = len(ids)
    index = numpy.asarray(ids, dtype=numpy.int64)
    own, rank = numpy.empty(r, dtype=numpy.float32), numpy.empty(r, dtype=numpy.int64)
    top_ids = numpy.empty((r, k), dtype=numpy.int64)
    top_lp = numpy.empty((r, k), dtype=numpy.float32)
    declined = lib.logits_logprobs(
        rows.data_ptr(), rows.stride(0), r, rows.shape[1], index.ctypes.data, k, own.ctypes.data,
        rank.ctypes.data, top_ids.ctypes.data, top_lp.ctypes.data, torch.get_num_threads(),
    )  # fmt: skip
    if declined:
        return None
    tops = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), top_lp.tolist())]
    return zip(ids, own.tolist(), tops, rank.tolist())


def _torch_logprobs(rows: torch.Tensor, ids: list[int], k: int) -> zip:
    """token_logprobs' fields of one chunk from torch ops."""
    logprobs = torch.log_softmax(rows.float(), dim=-1)  # [r, V]
    index = torch.tensor(ids, device=rows.device)[:, None]
    own = logprobs.gather(1, index)  # [r, 1]
    chosen = own[:, 0].tolist()
    if k > 0:
        values, top_ids = logprobs.topk(k, dim=-1)  # [r, k]
        tops = [tuple(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(ids)
    # The rank: 1 + how many logprobs are above the token's own, counted in place (the
    # log-softmax is not read again) as floats: summing the bool tensor of `logprobs > own`
    # took 9x as long (a [256, 49152] chunk: 43 ms against 4.5 on a 2-core Xeon).
    above = logprobs.sub_(own).gt_(0).sum(dim=-1)  # [r], exact below 2^24 tokens
    ranks = (above.to(torch.int64) + 1).tolist()
    return zip(ids, chosen, tops, ranks)
