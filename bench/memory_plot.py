"""The plot of bench_memory: TTFT CDF per config, all turns and turns >= 2 side by side.

Turns >= 2 are where prefix reuse can help: their prompt starts with the conversation's history.
The records are the driver's per-turn records (see bench/memory_stats.py), pooled over rounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

STYLES = {
    "static": ("tab:red", "static split (KV 80% / adapters 20%)"),
    "pool": ("tab:orange", "one pool, no prefix reuse"),
    "pool_prefix": ("tab:blue", "one pool, prefix reuse + host tier"),
}


def cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Sorted values and the fraction of values at or below each."""
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def plot_ttft_cdf(path: Path, runs: dict[str, list[list[dict]]], title: str) -> None:
    """Save the TTFT CDFs (seconds, log scale) of each config's turns to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(9.6, 4.0), sharey=True)
    panels = (("all turns", 0), ("turns >= 2", 1))
    for ax, (label, first_turn) in zip(axes, panels):
        for name, rounds in runs.items():
            ttft = [r["ttft_s"] for run in rounds for r in run if r["turn"] >= first_turn]
            if not ttft:
                continue
            color, legend = STYLES.get(name, ("k", name))
            ax.step(*cdf(ttft), where="post", color=color, label=f"{legend} ({len(ttft)})")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # the minor labels overlap on short spans
        ax.set_xlabel("TTFT (s)")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of turns")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
