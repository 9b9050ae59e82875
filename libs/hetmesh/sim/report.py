"""Console tables, JSON results files and PNG plots for simulation summaries."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hetmesh.sim.results import SimResult


def table(summaries: Sequence[Mapping[str, Any]], title: str = "simulation") -> Table:
    t = Table(title=title)
    for col in ("policy", "out tok/s", "steady tok/s", "goodput tok/s", "SLO %", "TTFT p50/p90/p99 s",
                "TPOT p50/p90/p99 ms", "prefix hit", "KV GB", "utilization"):
        t.add_column(col, justify="left" if col in ("policy", "utilization") else "right")
    for s in summaries:
        tt, tp = s["ttft_s"], s["tpot_s"]
        util = " ".join(f"{k}:{v['utilization']:.0%}" for k, v in s["pools"].items())
        t.add_row(str(s.get("label", s["policy"])), f"{s['output_tok_s']:.1f}", f"{s['output_tok_s_steady']:.1f}",
                  f"{s['goodput_tok_s']:.1f}", f"{100 * s['slo_attainment']:.0f}",
                  f"{tt['p50']:.2f}/{tt['p90']:.2f}/{tt['p99']:.2f}",
                  f"{1e3 * tp['p50']:.0f}/{1e3 * tp['p90']:.0f}/{1e3 * tp['p99']:.0f}",
                  f"{s['prefix_hit_rate']:.0%}", f"{s['kv_transfer_gb']:.1f}", util)
    return t


def print_table(summaries: Sequence[Mapping[str, Any]], title: str = "simulation",
                console: Console | None = None) -> None:
    (console or Console(width=200)).print(table(summaries, title))


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, default=float) + "\n")


def plot_cdfs(path: str | os.PathLike[str], results: Mapping[str, SimResult]) -> None:
    """TTFT and TPOT CDFs, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, res in results.items():
        for ax, vals in ((axes[0], [r.ttft for r in res.records]),
                         (axes[1], [1e3 * r.tpot for r in res.records if r.output_len > 1])):
            if vals:
                xs = np.sort(np.array(vals))
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)
    axes[0].set_xlabel("TTFT (s)")
    axes[1].set_xlabel("TPOT (ms)")
    for ax in axes:
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        # Labels at 1-2-5 steps: a CDF often spans less than a decade, and minor labels would overlap.
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path)


def plot_lines(path: str | os.PathLike[str], xs: Sequence[float], series: Mapping[str, Sequence[float]],
               xlabel: str, ylabel: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, ys in series.items():
        ax.plot(list(xs), list(ys), marker="o", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def _save(fig: Any, path: str | os.PathLike[str]) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
