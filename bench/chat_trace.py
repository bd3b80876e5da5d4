"""A multi-turn chat trace over many adapters, for bench_memory (issue 13).

- Each adapter has its own system prompt: `system_len` (200-400) random token ids, seeded by the
  adapter's name, so it is the same in every round and every config.
- Conversations start by Poisson arrivals (scripts.workload.arrival_times) at `rate` per second.
  Each picks an adapter by Zipf popularity over a fixed order of the adapters (a seeded shuffle
  with `popularity_seed`, not the round's seed: which adapters are hot does not change between
  rounds), and has `min_turns`-`max_turns` turns (uniform).
- User-turn and output lengths are LMSYS-shaped lognormals (scripts.workload.LengthSpec; the
  driver scales them down for a CPU). Between turns the user thinks for an exponential time of
  mean `think_s`: the next turn is sent that long after the previous answer ended (a closed loop
  per conversation), so the driver, not the trace, knows when a later turn is sent.
- Turn k's prompt (`turn_prompt`) is the system prompt, every earlier user turn each followed by
  the model's actual answer to it, and the new user turn: a prefix cache can hit on the whole
  history.

Every aspect draws from its own seeded stream, as in scripts.workload.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from toppings.scripts.loadgen.workload import (
    LengthSpec,
    WorkloadSpec,
    arrival_times,
    popularity_weights,
)


@dataclass(frozen=True)
class ChatSpec:
    """How to make a chat trace; bounded by `duration_s` and/or `num_conversations`."""

    rate: float  # conversations started per second (Poisson)
    duration_s: float | None = None  # conversations start within [0, duration_s)
    num_conversations: int | None = None
    min_turns: int = 3
    max_turns: int = 6
    system_len: tuple[int, int] = (200, 400)  # inclusive
    user_len: LengthSpec = LengthSpec("lognormal", 35.0, 1.0, 96)
    output_len: LengthSpec = LengthSpec("lognormal", 27.0, 1.0, 64)
    think_s: float = 3.0  # mean think time; 0: the next turn as soon as the answer ends
    alpha: float = 1.0  # Zipf exponent of adapter popularity
    token_range: tuple[int, int] = (100, 250)  # prompt token ids: fit any vocabulary >= 256
    seed: int = 0
    popularity_seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_turns <= self.max_turns:
            raise ValueError("need 1 <= min_turns <= max_turns")
        if not 1 <= self.system_len[0] <= self.system_len[1]:
            raise ValueError("need 1 <= system_len[0] <= system_len[1]")
        if self.think_s < 0:
            raise ValueError("think_s must be >= 0")

    def max_context(self) -> int:
        """The most KV tokens one request of this trace can need (prompt plus output)."""
        turn = self.user_len.max_len + self.output_len.max_len
        return self.system_len[1] + self.max_turns * turn


@dataclass(frozen=True)
class Conversation:
    """One user's chat with one adapter; `think_s[k]` is the pause before turn k + 1."""

    idx: int
    start_s: float
    adapter: str
    user_turns: tuple[tuple[int, ...], ...]
    output_lens: tuple[int, ...]
    think_s: tuple[float, ...]

    @property
    def num_turns(self) -> int:
        return len(self.user_turns)


def system_prompts(adapters: Sequence[str], spec: ChatSpec) -> dict[str, list[int]]:
    """Each adapter's system prompt: fixed random token ids, seeded by its name only."""
    lo, hi = spec.token_range
    prompts = {}
    for name in adapters:
        rng = random.Random(f"system/{name}")
        length = rng.randint(*spec.system_len)
        prompts[name] = [rng.randrange(lo, hi) for _ in range(length)]
    return prompts


def popularity(adapters: Sequence[str], spec: ChatSpec) -> tuple[list[str], list[float]]:
    """The adapters most popular first (a shuffle seeded by popularity_seed) and Zipf weights."""
    rng = random.Random(f"{spec.popularity_seed}/popularity")
    names = sorted(adapters)
    rng.shuffle(names)
    return names, popularity_weights("zipf", len(names), spec.alpha, rng)


def build_conversations(spec: ChatSpec, adapters: Sequence[str]) -> list[Conversation]:
    """The conversations of `spec`, in start order, over the named adapters."""
    if not adapters:
        raise ValueError("a chat trace needs at least one adapter")
    streams = ("arrive", "pick", "turns", "len", "prompt", "think")
    arrive, pick, turns, lens, prompt, think = (random.Random(f"{spec.seed}/{s}") for s in streams)
    bounds = WorkloadSpec(
        rps=spec.rate, duration_s=spec.duration_s, num_requests=spec.num_conversations
    )
    names, weights = popularity(adapters, spec)
    lo, hi = spec.token_range
    conversations = []
    for idx, start in enumerate(arrival_times(bounds, arrive)):
        adapter = pick.choices(names, weights)[0]
        num_turns = turns.randint(spec.min_turns, spec.max_turns)
        user_lens = [spec.user_len.sample(lens) for _ in range(num_turns)]
        output_lens = tuple(spec.output_len.sample(lens) for _ in range(num_turns))
        user_turns = tuple(tuple(prompt.randrange(lo, hi) for _ in range(n)) for n in user_lens)
        pauses = tuple(
            think.expovariate(1.0 / spec.think_s) if spec.think_s else 0.0
            for _ in range(num_turns - 1)
        )
        conversations.append(Conversation(idx, start, adapter, user_turns, output_lens, pauses))
    return conversations


def turn_prompt(
    system: Sequence[int], conversation: Conversation, answers: Sequence[Sequence[int]], k: int
) -> list[int]:
    """Turn k's prompt (k from 0): system prompt, turns 0..k-1 each with its answer, turn k."""
    if len(answers) < k:
        raise ValueError(f"turn {k} needs the answers to the {k} turns before it")
    ids = list(system)
    for user, answer in zip(conversation.user_turns[:k], answers[:k]):
        ids += user
        ids += answer
    ids += conversation.user_turns[k]
    return ids
