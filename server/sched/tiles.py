"""Chunks of a prompt in whole tiles of the blocked attention kernel (chunked prefill).

The blocked kernel (`server/native/csrc/attention_tiles.c`) attends a prompt segment of t new
tokens after a past of P in tiles of `ATTENTION_TILE` tokens and reads the past once per tile; a
tile of fewer tokens reads it all the same (its lanes are padded). The rows kernel, which takes
a segment of fewer than a tile (or of less than `TILE_MIN_WORK` key reads: a short past, where
it is the faster one), reads the whole past once per token. server/model/attention.py chooses
between them by these numbers (tests/server/sched/test_tiles.py checks that they agree; the
scheduler runs without torch, so it cannot import them from there).

Where the target sets the step budget it prices a prompt token at 1 + w x its past
(server.sched.step_budget), so late chunks of a long prompt come out small: stepping the real
engine beside a few decoding streams (bench/probe_long_prompt_steps.py), the budget cut a long
prompt's chunks below a tile early on, almost all its steps ran the rows kernel and its first
token came far later than alone (docs/benchmarks.md, "Measurements behind the code"). The rows
kernel's cost per token of a long past is well above the blocked one's, and the refit then
measured that rate and cut the chunks further (server.sched.step_refit). So:
- a chunk cut below a tile, after a past long enough for a tile to go to the blocked kernel
  (after a shorter one the rows kernel is the faster: the budget's cut stands), is raised to a
  whole tile (to its prompt's end, where that is nearer), oldest prompt first, while the step's
  cost stays within `TILE_STALL` times its budget. A stream's gap in such a step is at most
  twice the inter-token target (the budget's own floor, MIN_CHUNK tokens, is a step's least
  prompt work in the same way), far below the multi-second step of an unchunked long prompt,
  and the tile does in one step what the rows kernel did in two or three, each paying the
  step's fixed cost. Where the operator gave the budget (--max-num-batched-tokens) the bound
  is the budget itself (StepBudget.tile_stall): a tile only where it fits;
- a chunk that does not end its prompt and runs on the blocked kernel drops a last partial tile
  of fewer than half a tile's tokens: that tile would read the whole past again for them (the
  next step's chunk starts with them instead).
A prompt's last chunk is what is left of it, whatever its size. The refit prices the past by
the keys the kernel reads (`key_reads`: a partial tile reads as a whole one), so what it fits is
the blocked kernel's rate, not one blurred by padding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from toppings.server.requests.sequence import Sequence

ATTENTION_TILE = 32  # tokens per tile of attention_tiles.c (its BQ); attention.py TILE_MIN_LEN
TILE_MIN_WORK = 16384  # key reads below which a segment goes to the rows kernel (attention.py)
TILE_STALL = 2.0  # most a tile floor may take a step's cost to, in multiples of its budget


def runs_tiled(tokens: int, past: int) -> bool:
    """Whether a segment of `tokens` new tokens after `past` goes to the blocked kernel."""
    return tokens >= ATTENTION_TILE and tokens * (past + (tokens + 1) / 2) >= TILE_MIN_WORK


def key_reads(tokens: int, past: int) -> float:
    """The keys before it that each token of a chunk of `tokens` after `past` is scored against,
    summed as the kernel reads them: on the rows kernel each token's own, on the blocked kernel
    each tile's as if it were whole (a partial tile's padded lanes read as much)."""
    if not runs_tiled(tokens, past):
        return tokens * (past + (tokens - 1) / 2)
    tiles, t = -(-tokens // ATTENTION_TILE), ATTENTION_TILE
    return t * tiles * (past + (t * tiles - 1) / 2)


def whole_tiles(tokens: int, past: int, left: int) -> int:
    """`tokens` of a chunk after `past` with a last partial tile of under half a tile dropped,
    where the chunk runs on the blocked kernel and does not end its prompt (`left` tokens)."""
    if tokens >= left or not runs_tiled(tokens, past):
        return tokens
    whole = tokens // ATTENTION_TILE * ATTENTION_TILE
    if tokens - whole >= ATTENTION_TILE // 2 or not runs_tiled(whole, past):
        return tokens
    return whole


def in_tiles(
    chunks: dict[Sequence, int],
    oldest_first: Iterable[Sequence],
    cost: Callable[[Sequence, int], int],
    bound: float,
) -> None:
    """Make the prompt chunks of a planned step whole tiles (see the module docstring), in
    place: `chunks` the step's tokens per request (a decode 1), `cost` a request's budget
    tokens for so many, `bound` the most budget tokens the step may cost with a chunk raised to
    a tile."""
    prompts = [s for s in oldest_first if chunks.get(s, 0) > 0 and not s.is_prefilled]
    for seq in prompts:
        chunks[seq] = whole_tiles(
            chunks[seq], seq.num_prefilled, seq.prefill_len - seq.num_prefilled
        )
    spent = sum(cost(s, n) for s, n in chunks.items())
    for seq in prompts:
        n, left = chunks[seq], seq.prefill_len - seq.num_prefilled
        floor = min(left, ATTENTION_TILE)
        if n >= floor or not runs_tiled(ATTENTION_TILE, seq.num_prefilled):
            continue  # after a short past the rows kernel is the faster one
        if spent - cost(seq, n) + cost(seq, floor) <= bound:
            spent += cost(seq, floor) - cost(seq, n)
            chunks[seq] = floor
