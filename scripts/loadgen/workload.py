"""Workloads for the load generator: arrivals, adapter popularity, rank mix, lengths, traces.

A workload is a list of `TraceEntry` (when, which model, which prompt, how many tokens), made
once from a `WorkloadSpec` and the adapters a server lists, and saved as JSONL so that a run can
be repeated exactly. Every aspect draws from its own seeded stream, so changing the lengths does
not move the arrivals.

- Arrivals: Poisson (exponential gaps at `rps`), or Gamma gaps with mean 1/rps and coefficient
  of variation `cv` (shape 1/cv^2, as S-LoRA's trace generator; cv = 1 is Poisson), or
  `constant` gaps of exactly 1/rps, or `azure-code` / `azure-conv`: bursts shaped like the Azure
  LLM inference trace 2023's code and conversation services (scripts.loadgen.bursts: a model of
  the trace's shape with parameters measured on it, not the trace; `cv` does not apply).
- Popularity over adapters, most popular first (the order is a seeded shuffle of the names):
  `uniform`; `zipf` (weight of the i-th = 1/i^alpha); `power`, S-LoRA's: x ~ numpy's
  power(alpha) on [0, 1), adapter floor(x * n), so P(i) = ((i+1)/n)^a - (i/n)^a (alpha < 1
  favours the first adapters, alpha = 1 is uniform); `azure`, lognormal weights with sigma 3.55,
  chosen so that the top 18.6% of adapters take 99.6% of requests, the skew Shahrad et al. report
  for Azure Functions invocations ("Serverless in the Wild", ATC'20); `identical`, every request
  the one most popular adapter; `distinct`, the adapters in turn (round robin), so consecutive
  requests never share one while there are two or more: the adapter assignments of `vllm bench
  serve` and `sglang.bench_serving`, between which the cold-adapter cost shows.
- Rank mix: a request first draws a rank from the mix, then an adapter of that rank.
- Lengths: `N` or `fixed:N`; `uniform:LO:HI` (inclusive); `lognormal:MEAN:SIGMA`; `lmsys`, the
  lognormal of scheduler.trace (means from the LMSYS-Chat-1M paper, Zheng et al. 2023: 69.5
  prompt tokens, 214.5 response tokens; sigma 1.0). Clipped to [1, max].
- Prompts are token ids drawn uniformly from `token_range`, so their length is exact on every
  tokenizer (and the scheduler counts them exactly); the default range fits any vocabulary of
  256 tokens or more.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from toppings.scheduler.sim.trace import TraceConfig, lognormal_mu
from toppings.scripts.loadgen.bursts import AZURE_SHAPES, burst_arrivals

ARRIVALS = ("poisson", "gamma", "constant", *AZURE_SHAPES)
POPULARITY = ("uniform", "zipf", "power", "azure", "identical", "distinct")
AZURE_SIGMA = 3.55  # top 18.6% of lognormal(0, 3.55) weights hold 99.6% of the mass
LMSYS = {"prompt": TraceConfig.prompt_mean, "output": TraceConfig.output_mean}
LMSYS_SIGMA = TraceConfig.prompt_sigma


@dataclass(frozen=True)
class LengthSpec:
    """A length distribution: kind in fixed | uniform | lognormal, clipped to [1, max_len]."""

    kind: str
    a: float
    b: float = 0.0
    max_len: int = 1 << 30

    @classmethod
    def parse(cls, text: str, max_len: int, which: str = "output") -> LengthSpec:
        """`32`, `fixed:32`, `uniform:8:64`, `lognormal:MEAN:SIGMA` or `lmsys`."""
        kind, *args = text.split(":")
        try:
            if kind.isdigit() and not args:
                return cls("fixed", int(kind), max_len=max_len)
            if kind == "lmsys" and not args:
                return cls("lognormal", LMSYS[which], LMSYS_SIGMA, max_len)
            nums = [float(a) for a in args]
            if kind == "fixed" and len(nums) == 1 and nums[0] >= 1:
                return cls("fixed", nums[0], max_len=max_len)
            if kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1]:
                return cls("uniform", nums[0], nums[1], max_len)
            if kind == "lognormal" and len(nums) == 2 and nums[0] > 0 and nums[1] >= 0:
                return cls("lognormal", nums[0], nums[1], max_len)
        except ValueError:
            pass
        raise ValueError(f"bad length {text!r}: N, fixed:N, uniform:LO:HI, lognormal:M:S or lmsys")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        else:
            value = rng.lognormvariate(lognormal_mu(self.a, self.b), self.b)
        return min(max(int(round(value)), 1), self.max_len)


@dataclass(frozen=True)
class WorkloadSpec:
    """How to make a trace; bounded by `duration_s` and/or `num_requests`."""

    rps: float = 1.0
    arrivals: str = "poisson"
    cv: float = 1.0
    duration_s: float | None = None
    num_requests: int | None = None
    popularity: str = "uniform"
    alpha: float = 1.0
    rank_mix: tuple[tuple[int, float], ...] = ()  # (rank, weight); empty: any adapter
    prompt_len: LengthSpec = LengthSpec("fixed", 32)
    output_len: LengthSpec = LengthSpec("fixed", 32)
    token_range: tuple[int, int] = (100, 250)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rps <= 0 or self.cv <= 0 or self.alpha <= 0:
            raise ValueError("rps, cv and alpha must be positive")
        if self.arrivals not in ARRIVALS or self.popularity not in POPULARITY:
            raise ValueError(f"arrivals in {ARRIVALS}, popularity in {POPULARITY}")
        if self.duration_s is None and self.num_requests is None:
            raise ValueError("bound the workload with a duration and/or a number of requests")
        if not 0 <= self.token_range[0] < self.token_range[1]:
            raise ValueError("token_range must be LO < HI")
        if any(r < 1 or w <= 0 for r, w in self.rank_mix):
            raise ValueError("rank mix entries need a positive rank and weight")


@dataclass(frozen=True)
class TraceEntry:
    """One request of a trace; `model` is an adapter or the base model, `rank` 0 for the base."""

    idx: int
    arrival_s: float
    model: str
    rank: int
    prompt: list[int] | str
    max_tokens: int


def parse_assignment(text: str, alpha: float = 1.0) -> tuple[str, float]:
    """An adapter assignment, as `vllm bench serve --lora-assignment` and `sglang.bench_serving
    --lora-request-distribution` name them, -> (popularity, alpha): `identical`, `distinct`,
    `uniform`, `azure`, `zipf` or `power` with `alpha`, or `zipf:ALPHA` / `power:ALPHA`."""
    kind, sep, exponent = text.partition(":")
    if kind not in POPULARITY or (sep and kind not in ("zipf", "power")):
        raise ValueError(
            f"bad adapter assignment {text!r}: one of {', '.join(POPULARITY)}, or zipf:ALPHA / "
            "power:ALPHA"
        )
    if sep:
        try:
            alpha = float(exponent)
        except ValueError:
            raise ValueError(f"bad exponent in {text!r}: a positive number") from None
        if not alpha > 0:
            raise ValueError(f"bad exponent in {text!r}: a positive number")
    return kind, alpha


def parse_rank_mix(text: str) -> tuple[tuple[int, float], ...]:
    """`32,64` (equal shares) or `32:0.7,64:0.3` -> ((32, 0.7), (64, 0.3))."""
    mix = []
    for part in text.split(","):
        rank, _, weight = part.strip().partition(":")
        mix.append((int(rank), float(weight) if weight else 1.0))
    return tuple(mix)


def arrival_times(spec: WorkloadSpec, rng: random.Random) -> list[float]:
    """Arrival offsets in seconds from 0, within the spec's bounds."""
    if spec.arrivals in AZURE_SHAPES:
        shape = AZURE_SHAPES[spec.arrivals]
        return burst_arrivals(shape, spec.rps, rng, spec.num_requests, spec.duration_s)
    shape = 1.0 / (spec.cv * spec.cv)
    times: list[float] = []
    now = 0.0
    limit = spec.num_requests if spec.num_requests is not None else math.inf
    while len(times) < limit:
        if spec.arrivals == "poisson":
            now += rng.expovariate(spec.rps)
        elif spec.arrivals == "constant":
            now += 1.0 / spec.rps
        else:
            now += rng.gammavariate(shape, 1.0 / (spec.rps * shape))
        if spec.duration_s is not None and now >= spec.duration_s:
            break
        times.append(now)
    return times


def popularity_weights(kind: str, num: int, alpha: float, rng: random.Random) -> list[float]:
    """Weight of each of `num` adapters, most popular first; they sum to 1."""
    if kind == "uniform":
        weights = [1.0] * num
    elif kind == "zipf":
        weights = [1.0 / (i**alpha) for i in range(1, num + 1)]
    elif kind == "power":
        weights = [((i + 1) / num) ** alpha - (i / num) ** alpha for i in range(num)]
    elif kind == "azure":
        weights = sorted((rng.lognormvariate(0.0, AZURE_SIGMA) for _ in range(num)), reverse=True)
    elif kind in ("identical", "distinct"):  # distinct: drawn in turn by build_trace, not by weight
        weights = [1.0] + [0.0 if kind == "identical" else 1.0] * (num - 1)
    else:
        raise ValueError(f"popularity must be one of {POPULARITY}, not {kind!r}")
    total = sum(weights)
    return [w / total for w in weights]


def build_trace(
    spec: WorkloadSpec, adapters: dict[str, int], base_model: str | None = None
) -> list[TraceEntry]:
    """The requests of `spec` over `adapters` (name -> rank); the base model if there are none."""
    rngs = [random.Random(f"{spec.seed}/{part}") for part in ("arrive", "pick", "len", "prompt")]
    arrive_rng, pick_rng, len_rng, prompt_rng = rngs
    names = sorted(adapters)
    pick_rng.shuffle(names)  # popularity order is not name order
    if spec.rank_mix:
        groups = {r: [n for n in names if adapters[n] == r] for r, _ in spec.rank_mix}
        missing = [r for r, group in groups.items() if not group]
        if missing:
            served = sorted(set(adapters.values()))
            raise ValueError(f"no adapter of rank {missing}; ranks served: {served}")
    elif names:
        groups = {0: names}
    elif base_model:
        groups = {0: [base_model]}
    else:
        raise ValueError("no adapters and no base model to send requests to")
    rank_keys = list(groups)
    rank_weights = [w for _, w in spec.rank_mix] or [1.0]
    weights = {
        r: popularity_weights(spec.popularity, len(g), spec.alpha, pick_rng)
        for r, g in groups.items()
    }
    lo, hi = spec.token_range
    turns = dict.fromkeys(groups, 0)  # `distinct`: each group's next adapter
    trace = []
    for idx, when in enumerate(arrival_times(spec, arrive_rng)):
        rank = pick_rng.choices(rank_keys, rank_weights)[0]
        if spec.popularity == "distinct":
            model = groups[rank][turns[rank] % len(groups[rank])]
            turns[rank] += 1
        else:
            model = pick_rng.choices(groups[rank], weights[rank])[0]
        prompt_len = spec.prompt_len.sample(len_rng)
        max_tokens = spec.output_len.sample(len_rng)
        prompt = [prompt_rng.randrange(lo, hi) for _ in range(prompt_len)]
        trace.append(TraceEntry(idx, when, model, adapters.get(model, 0), prompt, max_tokens))
    return trace


def save_trace(trace: list[TraceEntry], path: str | Path) -> None:
    """One JSON object per line, in arrival order."""
    with open(path, "w") as f:
        for entry in trace:
            f.write(json.dumps(dataclasses.asdict(entry)) + "\n")


def load_trace(path: str | Path) -> list[TraceEntry]:
    """Entries of a JSONL trace; `prompt` may be token ids or text, `rank` may be absent."""
    trace = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                entry = TraceEntry(
                    idx=int(obj.get("idx", len(trace))),
                    arrival_s=float(obj["arrival_s"]),
                    model=str(obj["model"]),
                    rank=int(obj.get("rank") or 0),
                    prompt=obj["prompt"],
                    max_tokens=int(obj["max_tokens"]),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: not a trace entry ({e})") from None
            trace.append(entry)
    return sorted(trace, key=lambda e: (e.arrival_s, e.idx))
