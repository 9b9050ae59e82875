"""The idle-tenant case of `flow_live.py` in the simulator, scored as the live client scores it.

The live client stops `--grace` wall seconds after the last arrival: a request still streaming then counts the
tokens it streamed, judged on its TTFT and TPOT so far; the simulator's own score counts every output to its end
(the drain of the long outputs runs to 3x the arrivals' span). This replays the live case's trace (three tenants
at 1x capacity, a fourth configured that sends nothing) with and without flow control and prints both scores,
whole and cut, so that the live figure can be read against the simulator's on the same terms.

    .venv/bin/python benchmarks/flow_idle_cut.py [--time-scale 0.25] [--duration 30] [--grace 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

from flow_control import SLO, WORKERS, capacity, load, within_slo
from rich.console import Console
from rich.table import Table

from hetmesh.placement.flow import Tenant
from hetmesh.sim import SimConfig, simulate
from hetmesh.sim.results import SimResult
from hetmesh.sim.traces import merge


def good_tokens(res: SimResult, cutoff: float) -> tuple[float, int]:
    """Output tokens of the requests within SLO, and how many, counting what each streamed by `cutoff` (engine
    seconds from the run's start; tokens at an even pace between the first and the last)."""
    tokens, n = 0.0, 0
    for r in res.records:
        if r.output_len <= 0 or r.first_token > res.start + cutoff or not within_slo(r):
            continue
        left = res.start + cutoff - r.first_token
        tokens += r.output_len if r.finish <= res.start + cutoff else 1 + left / max(r.tpot, 1e-9)
        n += 1
    return tokens, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-scale", type=float, default=0.25, help="engine seconds per wall second (the live run's)")
    ap.add_argument("--duration", type=float, default=30.0, help="engine seconds of arrivals")
    ap.add_argument("--grace", type=float, default=20.0, help="wall seconds the live client waits past its last arrival")
    ap.add_argument("--out", default="results/flow_idle_cut.json")
    a = ap.parse_args()
    cap = capacity(a.duration)
    trace = merge(*(load(cap, a.duration, n, i) for i, n in enumerate("abc")))
    cutoff = max(r.arrival for r in trace.requests) + a.grace * a.time_scale
    runs = {}
    for label, tenants in (("flow", tuple(Tenant(n) for n in "abcd")), ("no flow", ())):
        _, res = simulate(WORKERS, "cost", trace, SimConfig(tenants=tenants), SLO)
        whole, n_whole = good_tokens(res, float("inf"))
        cut, n_cut = good_tokens(res, cutoff)
        runs[label] = {"good_tokens": whole, "within_slo": n_whole, "good_tokens_cut": cut, "within_slo_cut": n_cut,
                       "end_s": res.end - res.start}
    ratio = {k: runs["flow"][k] / runs["no flow"][k] for k in ("good_tokens", "good_tokens_cut")}
    table = Table(title=f"Idle tenant, simulated, scored whole and cut {a.grace:g} wall s "
                        f"({a.grace * a.time_scale:g} engine s) past the last arrival")
    for c in ("run", "good tokens (whole)", "within SLO", "good tokens (cut)", "within SLO (cut)", "drained at"):
        table.add_column(c)
    for label, r in runs.items():
        table.add_row(label, f"{r['good_tokens']:.0f}", str(r["within_slo"]), f"{r['good_tokens_cut']:.0f}",
                      str(r["within_slo_cut"]), f"{r['end_s']:.1f} s")
    table.add_row("flow / no flow", f"{ratio['good_tokens']:.3f}", "", f"{ratio['good_tokens_cut']:.3f}", "", "")
    Console().print(table)
    Path(a.out).write_text(json.dumps({
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "command": f"python benchmarks/flow_idle_cut.py --time-scale {a.time_scale:g} --duration {a.duration:g} "
                   f"--grace {a.grace:g}",
        "capacity_req_s": cap, "cutoff_engine_s": cutoff, "runs": runs, "flow_over_no_flow": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
