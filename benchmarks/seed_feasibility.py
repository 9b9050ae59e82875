"""Is 1.6x the load balancer reachable on the seed case-study cluster? Two maps over what the
seed's figures do not pin down.

The seed case is calibrated on two numbers (the single-server figures), so only one factor per
chip is fitted (compute efficiency). The rest are assumptions: the workload (the seed states
none; we assume a closed loop of 4 clients per server, 4096-token prompts, 256-token outputs)
and the per-step overhead and memory efficiency (the Splitwise H100 fit). Each point of a map
changes one of them, recalibrates, says whether the seed is still reproduced within issue 3's
tolerance (load balanced and split within 15%, their ratio within 0.1 of 1.53), and measures
the static split and the cost policy against the load balancer (means of 3 trace seeds, 30
requests per client). Writes results/seed_feasibility.json.

    .venv/bin/python benchmarks/seed_feasibility.py [--jobs N]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from casestudy import PRIOR, REPRO_TOLERANCE, SEED_RATIO, Workload, feasibility_point
from rich.console import Console
from rich.table import Table

from hetmesh.sim.report import write_json

ROOT = Path(__file__).resolve().parents[1]
OVERHEADS = [0.005, 0.01, PRIOR["overhead_s"], 0.02, 0.025, 0.03]
MEMORIES = [0.15, 0.2, 0.25, 0.3, PRIOR["memory"], 0.45, 0.55, 0.7, 0.85]
INPUTS = [3072, 4096, 6144, 8192]
OUTPUTS = [128, 192, 256, 384]


def _point(kw: dict[str, Any]) -> dict[str, Any]:
    return feasibility_point(**kw)


def _table(title: str, rows: list[dict[str, Any]], keys: tuple[str, str]) -> Table:
    t = Table(title=title)
    for c in (*keys, "LB tok/s", "split tok/s", "repro ratio", "reproduces seed", "static x LB", "cost x LB (min..max)"):
        t.add_column(c, justify="right")
    for r in rows:
        head = [f"{r[k] * 1e3:.1f}" if k == "overhead_s" else f"{r[k]:g}" for k in keys]
        if not r["reachable"]:
            t.add_row(*head, "-", "-", "-", "no: needs compute eff > 1", "-", "-")
            continue
        t.add_row(*head, f"{r['load_balanced']:.1f}", f"{r['disaggregated']:.1f}", f"{r['ratio']:.3f}",
                  "yes" if r["reproduces"] else "no", f"{r['static_x_lb']:.3f}",
                  f"{r['cost_x_lb']:.3f} ({r['cost_x_lb_min']:.3f}..{r['cost_x_lb_max']:.3f})")
    return t


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r.get("reproduces")]
    over = [r for r in rows if r.get("reachable") and r["cost_x_lb"] >= 1.6]
    best = max(ok, key=lambda r: r["cost_x_lb"]) if ok else None
    return {"points": len(rows), "reproducing": len(ok), "best_where_seed_reproduces": best,
            "points_with_cost_x_lb_ge_1_6": len(over),
            "reproducing_points_with_cost_x_lb_ge_1_6": sum(bool(r.get("reproduces")) for r in over)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(ROOT / "results/seed_feasibility.json"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    priors = [{"overhead_s": o, "memory": m} for o, m in itertools.product(OVERHEADS, MEMORIES)]
    workloads = [{"wl": Workload(input_len=i, output_len=o)} for i, o in itertools.product(INPUTS, OUTPUTS)]
    with ProcessPoolExecutor(args.jobs) as ex:
        prior_rows = list(ex.map(_point, priors))
        workload_rows = list(ex.map(_point, workloads))
    wall = time.perf_counter() - t0
    console = Console(width=140)
    console.print(_table("priors (workload as assumed): recalibrate, check the reproduction, x LB", prior_rows,
                         ("overhead_s", "memory")))
    console.print(_table("workloads (shipped prior, 4 clients per server): recalibrate, check the reproduction, x LB",
                         workload_rows, ("input_len", "output_len")))
    summary = {"priors": _summary(prior_rows), "workloads": _summary(workload_rows)}
    for name, sm in summary.items():
        b = sm["best_where_seed_reproduces"]
        console.print(f"{name}: {sm['reproducing']} of {sm['points']} points reproduce the seed; best cost x LB "
                      f"among them {b['cost_x_lb']:.3f} (static {b['static_x_lb']:.3f}); cost >= 1.6x at "
                      f"{sm['points_with_cost_x_lb_ge_1_6']} points, {sm['reproducing_points_with_cost_x_lb_ge_1_6']} "
                      f"of them reproducing the seed" if b else f"{name}: no point reproduces the seed")
    console.print(f"{wall:.0f} s wall on {args.jobs} processes")
    write_json(Path(args.out), {
        "priors": prior_rows, "workloads": workload_rows, "summary": summary, "tolerance": REPRO_TOLERANCE,
        "seed_ratio": SEED_RATIO, "shipped_prior": PRIOR, "assumed_workload": Workload().describe(), "wall_s": wall,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
    })
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
