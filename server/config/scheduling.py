"""Which waiting request runs next and how large a step may be (`SchedulingConfig`, one part
of server.config.EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from toppings.server.settings import (
    ON_OFF,
    Bound,
    Flag,
    Settings,
    on_off,
    setting,
)

QUEUE_POLICIES = ("fcfs", "chameleon")  # the classes: server.sched.policies
KV_ADMISSIONS = ("expected", "worst-case")


@dataclass(frozen=True)
class SchedulingConfig(Settings):
    """Which waiting request runs next, and how large a step may be."""

    title = "scheduling"

    max_batch_size: int = setting(
        128, bound=Bound.POSITIVE, flag=Flag("most requests running at once", type=int)
    )
    max_prefill_tokens: int = setting(8192, bound=Bound.POSITIVE)
    # Which waiting request goes next (server.sched.policies).
    queue_policy: str = setting(
        "chameleon",
        choices=QUEUE_POLICIES,
        flag=Flag(
            "which waiting request is admitted next: chameleon's adapter-aware multi-level "
            "queues with token quotas (bench/results/queueing.json compares the load each "
            "sustains within the TTFT SLO), or fcfs, arrival order"
        ),
    )
    # The order of waiting requests across adapters (server.sched.fair_share).
    fair_share: bool = setting(
        True,
        flag=Flag(
            "fair shares between adapters: waiting requests are admitted in start-time fair "
            "queueing order over their tokens (each adapter a tenant, the base model one), so "
            "one adapter's flood of requests waits behind the others' requests; off: in "
            "arrival order",
            choices=ON_OFF,
            default="on",
            parse=on_off,
        ),
    )
    # What admission reserves of a request's KV (server.sched.scheduler, `Scheduler.add`).
    kv_admission: str = setting(
        "expected",
        choices=KV_ADMISSIONS,
        flag=Flag(
            "what admission reserves of a request's KV memory: expected, its prompt and the "
            "output its adapter's last 32 requests made (their 90th percentile share of "
            "max_tokens; all of it until 8 have ended); one that runs longer takes blocks as "
            "it goes, and when the pool runs out the youngest running request is preempted "
            "and later resumes where it was. worst-case: its prompt plus max_tokens (nothing "
            "is preempted; fewer requests run at once where max_tokens is large)"
        ),
    )
    # Mixed steps of decodes and prompt chunks under a token budget (server.sched.scheduler).
    chunked_prefill: bool = setting(
        True,
        flag=Flag(
            "chunked prefill: each step runs every decode first, then prompt chunks up to "
            "--max-num-batched-tokens, so a long prompt no longer stalls the running streams",
            choices=ON_OFF,
            default="on",
            parse=on_off,
        ),
    )
    # The token budget of a chunked-prefill step; 0: derived (server.sched.step_budget).
    max_num_batched_tokens: int = setting(
        0,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "tokens one chunked-prefill step computes, decodes included (more than "
            "--max-batch-size); 0: sized for --itl-target-ms from the modelled step time, "
            "per number of decodes, logged at start-up",
            type=int,
            metavar="N",
        ),
    )
    # The inter-token SLO a chunked-prefill step is sized for (server.sched.step_budget's
    # ITL_TARGET_MS: a fixed value, not a multiple of the step the engine runs).
    itl_target_ms: float = setting(
        150.0,
        bound=Bound.POSITIVE,
        flag=Flag(
            "inter-token SLO the default --max-num-batched-tokens is sized for: a step with "
            "decodes takes the prompt tokens that keep its modelled time within it, but a chunk "
            "is at least the GEMM floor (--chunk-floor-tokens, else measured at start-up: 256 "
            "to 2048 tokens whatever the past they attend to, more beside more decodes, logged: "
            "on a CPU the floor, not the target, sizes most chunks), and a step without decodes "
            "takes whole prompts",
            type=float,
            metavar="X",
        ),
    )
    # The GEMM floor of chunked prefill's steps when given; 0: measured (server.sched.step_budget).
    chunk_floor_tokens: int = setting(
        0,
        bound=Bound.NON_NEGATIVE,
        flag=Flag(
            "the GEMM floor given: beside decodes a prompt chunk is at least N tokens, however "
            "many decodes; 0: the floor measured at start-up. Smaller chunks shorten the gaps "
            "of the streams beside a long prompt and delay that prompt's first token "
            "(docs/benchmarks.md has what 128-1024 traded on a CPU)",
            type=int,
            metavar="N",
        ),
    )
    # The TTFT SLO Chameleon's queue quotas are sized for.
    ttft_slo_ms: float = setting(
        5000.0,
        bound=Bound.POSITIVE,
        flag=Flag(
            "the TTFT SLO that chameleon's queue quotas are sized for", type=float, metavar="X"
        ),
    )

    def check(self) -> None:
        if self.chunked_prefill and 0 < self.max_num_batched_tokens <= self.max_batch_size:
            raise ValueError(
                "max_num_batched_tokens must exceed max_batch_size: a step's decodes come "
                "first, and prompt chunks need tokens left after them"
            )
        if self.chunk_floor_tokens and self.max_num_batched_tokens:
            raise ValueError(
                "chunk_floor_tokens floors the budget sized for itl_target_ms; with "
                "max_num_batched_tokens given there is none to floor: give one of them"
            )
