"""Latency statistics of a load-generator run: percentiles, throughput, SLO attainment, CDF plots.

A record is one line of the load generator's JSONL, `{"config": {...}, "result": {...}}`; the
result of a finished request holds `ttft_s`, `e2e_s`, `tpt_s` (the paper's time per token: E2E
divided by the output tokens, prefill included), `output_tokens`, and its send and finish times
(`start_unix`, `end_unix`). A failed request has `ok` false and counts against the SLO.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

METRICS = (("ttft", "TTFT"), ("tpt", "time per token"), ("e2e", "E2E"))
PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarise(records: Sequence[dict], slo_tpt_ms: float | None = None) -> dict:
    """Percentiles (ms), means, throughput and SLO attainment of `records`."""
    done = [r["result"] for r in records if r["result"].get("ok")]
    summary: dict = {"num_requests": len(records), "num_ok": len(done)}
    summary["num_failed"] = len(records) - len(done)
    for key, _ in METRICS:
        values = [1000.0 * r[f"{key}_s"] for r in done]
        for q in PERCENTILES:
            summary[f"{key}_p{q}_ms"] = percentile(values, q)
        summary[f"{key}_mean_ms"] = sum(values) / len(values) if values else math.nan
    if done:
        span = max(r["end_unix"] for r in done) - min(r["start_unix"] for r in done)
        tokens = sum(r["output_tokens"] for r in done)
        summary["span_s"] = span
        summary["requests_per_s"] = len(done) / span if span > 0 else math.nan
        summary["output_tokens_per_s"] = tokens / span if span > 0 else math.nan
        summary["mean_output_tokens"] = tokens / len(done)
        summary["mean_send_lag_ms"] = 1000.0 * sum(r["lag_s"] for r in done) / len(done)
    if slo_tpt_ms is not None:
        met = sum(1 for r in done if 1000.0 * r["tpt_s"] <= slo_tpt_ms)
        summary["slo_tpt_ms"] = slo_tpt_ms
        summary["slo_attainment"] = met / len(records) if records else math.nan
    return summary


def format_summary(summary: dict) -> str:
    """A small table for the terminal."""
    lines = [
        f"requests: {summary['num_ok']} ok, {summary['num_failed']} failed",
        f"{'':16}" + "".join(f"{f'p{q}':>10}" for q in PERCENTILES) + f"{'mean':>10}",
    ]
    for key, label in METRICS:
        cells = [summary[f"{key}_p{q}_ms"] for q in PERCENTILES] + [summary[f"{key}_mean_ms"]]
        lines.append(f"{label + ' ms':16}" + "".join(f"{c:10.1f}" for c in cells))
    if "span_s" in summary:
        lines.append(
            f"throughput: {summary['requests_per_s']:.2f} req/s, "
            f"{summary['output_tokens_per_s']:.1f} output tokens/s over {summary['span_s']:.1f} s"
            f" (mean send lag {summary['mean_send_lag_ms']:.1f} ms)"
        )
    if "slo_attainment" in summary:
        lines.append(
            f"SLO attainment (time per token <= {summary['slo_tpt_ms']:g} ms): "
            f"{100 * summary['slo_attainment']:.1f}%"
        )
    return "\n".join(lines)


def plot_cdfs(
    runs: dict[str, Sequence[dict]],
    path: str,
    title: str = "",
    slo_tpt_ms: float | None = None,
    log_x: bool = False,
) -> None:
    """CDFs of TTFT, time per token and E2E, one line per run, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 3.4))
    for ax, (key, label) in zip(axes, METRICS):
        for name, records in runs.items():
            values = sorted(1000.0 * r["result"][f"{key}_s"] for r in records if r["result"]["ok"])
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=name)
        if key == "tpt" and slo_tpt_ms is not None:
            ax.axvline(slo_tpt_ms, color="grey", linestyle="--", linewidth=1, label="SLO")
        if log_x:
            ax.set_xscale("log")
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
