"""`toppings-loadgen`'s command line, generated from settings classes (server.settings), as
toppings-serve's is: the workload (what is sent, when) and the run (where to, how it is
measured and written). `LoadgenConfig` is both in one flat frozen dataclass; a summary file
records its fields as the run's config.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from toppings.scripts.loadgen.workload import ARRIVALS, POPULARITY, parse_rank_mix
from toppings.server.settings import Flag, Settings, command_parser, setting


@dataclass(frozen=True)
class WorkloadSettings(Settings):
    """The trace: arrivals, adapters, ranks and lengths, or a saved trace replayed."""

    title = "workload"

    rps: float = setting(1.0, flag=Flag("mean arrival rate (requests/s)", type=float))
    arrivals: str = setting(
        "poisson",
        choices=ARRIVALS,
        flag=Flag(
            "azure-code / azure-conv: bursts shaped like the Azure LLM inference trace 2023's "
            "services (a model of its shape, not the trace)"
        ),
    )
    cv: float = setting(1.0, flag=Flag("coefficient of variation of gamma gaps", type=float))
    duration: float | None = setting(None, flag=Flag("seconds of arrivals", type=float))
    num_requests: int | None = setting(None, flag=Flag("at most this many requests", type=int))
    popularity: str = setting(
        "uniform",
        flag=Flag(
            f"which adapter each request names: {' | '.join(POPULARITY)}, or zipf:ALPHA / "
            "power:ALPHA",
            name="--lora-assignment",
            aliases=("--popularity",),
            metavar="SPEC",
        ),
    )
    alpha: float = setting(1.0, flag=Flag("exponent of zipf / power", type=float))
    ranks: tuple[tuple[int, float], ...] = setting(
        (),
        flag=Flag(
            "rank mix, e.g. 32,64 or 32:0.7,64:0.3 (default: any adapter)",
            type=parse_rank_mix,
            metavar="MIX",
        ),
    )
    prompt_len: str = setting(
        "32", flag=Flag("N, uniform:LO:HI, lognormal:MEAN:SIGMA or lmsys", metavar="SPEC")
    )
    output_len: str = setting("32", flag=Flag("as --prompt-len", metavar="SPEC"))
    max_prompt_len: int = setting(2048, flag=Flag("cap of a drawn prompt length", type=int))
    max_output_len: int = setting(1024, flag=Flag("cap of a drawn output length", type=int))
    token_range: str = setting(
        "100:250", flag=Flag("prompt token ids are drawn from [LO, HI)", metavar="LO:HI")
    )
    seed: int = setting(0, flag=Flag("seed of the trace's draws", type=int))
    trace: str | None = setting(
        None, flag=Flag("replay this JSONL trace instead of generating one")
    )
    save_trace: str | None = setting(None, flag=Flag("write the trace to this JSONL file"))

    def check(self) -> None:
        if not self.trace and self.duration is None and self.num_requests is None:
            raise ValueError("give --duration and/or --num-requests (or --trace)")


@dataclass(frozen=True)
class RunSettings(Settings):
    """Where the requests go, how each is sent, and where the results are written."""

    title = "run and output"

    url: str = setting(
        "http://127.0.0.1:8000",
        flag=Flag("server or scheduler base URL", parse=lambda url: url.rstrip("/")),
    )
    out: str | None = setting(
        None, flag=Flag("JSONL of {config, result}, one line per request (resumable)")
    )
    summary: str | None = setting(None, flag=Flag("write the summary as a benchmark JSON file"))
    slo_tpt_ms: float | None = setting(
        None, flag=Flag("SLO on time per token, for attainment", type=float)
    )
    plot: str | None = setting(
        None, flag=Flag("draw CDFs of TTFT, time per token and E2E to this PNG")
    )
    api_key: str | None = setting(
        None,
        flag=Flag(
            "sent as Authorization: Bearer KEY on every request (a scheduler's --api-key, a "
            "server's); default $TOPPINGS_SCHEDULER_API_KEY, then $TOPPINGS_API_KEY",
            env=("TOPPINGS_SCHEDULER_API_KEY", "TOPPINGS_API_KEY"),
        ),
    )
    temperature: float = setting(
        0.0, flag=Flag("sampling temperature of every request", type=float)
    )
    timeout: float = setting(600.0, flag=Flag("seconds per request", type=float))
    max_concurrency: int = setting(512, flag=Flag("requests in flight at most", type=int))
    dry_run: bool = setting(
        False, flag=Flag("make (and save) the trace, send none", action="store_true")
    )
    no_progress: bool = setting(False, flag=Flag("no progress bar", action="store_true"))


@dataclass(frozen=True)
class LoadgenConfig(RunSettings, WorkloadSettings):
    """Every setting of one `toppings-loadgen` run, flat (`config.rps`, `config.url`, ...)."""


# Every settings class whose fields are flags of toppings-loadgen, in --help's order.
SETTINGS_CLASSES: tuple[type[Settings], ...] = (RunSettings, WorkloadSettings)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `toppings-loadgen` (docs/flags.md is generated from the same classes)."""
    return command_parser(
        "toppings-loadgen",
        "Open-loop load against a toppings server or scheduler, with latency stats.",
        SETTINGS_CLASSES,
    )
