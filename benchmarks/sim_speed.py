"""Simulator speed on one core, per policy, at two points:

- small: 10,000 requests over a 24-worker mixed cluster (8 H100 both, 8 Rubin CPX prefill, 8 Rubin VR200
  decode; Llama-3.1-70B, synthetic Poisson 60 req/s);
- large: 100,000 requests over 256 workers (64 H100 both, 64 CPX prefill, 64 VR200 decode, 32 MI300X both,
  32 MI308X decode; 600 req/s), the size the planner simulates layouts at. Target: under 60 s.

`--baseline DIR` also runs the same points on another checkout (e.g. a `git worktree` of an older
commit) in a child process on this machine, for a same-run ratio. CPU seconds are reported (wall
time swings with whatever else shares the cores). `--reps N` runs each point N times, this
checkout and the baseline each in a fresh child process, in alternating order, and keeps the least
CPU time of each (on a shared machine the noise only ever adds). Prints a table, writes
results/sim_speed.json.

    .venv/bin/python benchmarks/sim_speed.py [--points small,large] [--policies round_robin,cost] [--baseline DIR] [--reps N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hetmesh.protocol import Role
from hetmesh.sim import pool, simulate, synthetic
from hetmesh.sim.report import write_json

ROOT = Path(__file__).resolve().parents[1]
POINTS = {
    "small": {"requests": 10_000, "rate": 60.0, "prefix_groups": 32,
              "pools": [("h100", 8, "nvidia-h100", Role.BOTH), ("cpx", 8, "nvidia-rubin-cpx", Role.PREFILL),
                        ("vr200", 8, "nvidia-rubin-vr200", Role.DECODE)]},
    "large": {"requests": 100_000, "rate": 600.0, "prefix_groups": 256,
              "pools": [("h100", 64, "nvidia-h100", Role.BOTH), ("cpx", 64, "nvidia-rubin-cpx", Role.PREFILL),
                        ("vr200", 64, "nvidia-rubin-vr200", Role.DECODE), ("mi300x", 32, "amd-mi300x", Role.BOTH),
                        ("mi308x", 32, "amd-mi308x", Role.DECODE)]},
}


def run_point(point: str, policy: str) -> dict[str, object]:
    p = POINTS[point]
    m = {"model": "llama-3.1-70b", "devices": 8, "max_batch": 128}
    workers = [w for name, n, acc, role in p["pools"] for w in pool(name, n, acc, role, **m)]  # type: ignore[attr-defined]
    trace = synthetic(p["requests"], rate=p["rate"], input_mean=2048, output_mean=256,  # type: ignore[arg-type]
                      prefix_groups=p["prefix_groups"], prefix_tokens=1024, seed=11)  # type: ignore[arg-type]
    t0, cpu0 = time.perf_counter(), time.process_time()
    s, res = simulate(workers, policy, trace)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"point": point, "policy": policy, "requests": s["requests"], "workers": len(workers), "wall_s": wall,
            "cpu_s": cpu, "virtual_s": s["duration_s"], "output_tok_s": s["output_tok_s"],
            "output_tokens": int(sum(r.output_len for r in res.records)), "under_60s": cpu < 60.0}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="small,large")
    ap.add_argument("--policies", default="round_robin,least_loaded,prefix_aware,cost")
    ap.add_argument("--baseline", help="another checkout to run the same points on (its libs/ on PYTHONPATH)")
    ap.add_argument("--reps", type=int, default=1, help="runs per point (fresh processes, interleaved); least CPU kept")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child mode: point:policy -> one JSON row on stdout
    ap.add_argument("--out", default=str(ROOT / "results" / "sim_speed.json"))
    a = ap.parse_args()
    try:  # measure one core, as the target says
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    except (AttributeError, OSError):
        pass
    if a.one:
        point, policy = a.one.split(":")
        print(json.dumps(run_point(point, policy)))
        return 0
    if a.reps < 1:
        print("--reps must be >= 1", file=sys.stderr)
        return 2

    def child(checkout: Path | str, point: str, name: str) -> dict[str, object]:
        env = {**os.environ, "PYTHONPATH": f"{checkout}/libs{os.pathsep}{checkout}/services"}
        out = subprocess.run([sys.executable, __file__, "--one", f"{point}:{name}"], env=env, check=True,
                             capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    def least(runs: list[dict[str, object]]) -> dict[str, object]:
        return min(runs, key=lambda r: r["cpu_s"])  # type: ignore[arg-type,return-value]

    rows = []
    for point in [p for p in a.points.split(",") if p]:
        for name in [p for p in a.policies.split(",") if p]:
            if a.reps == 1:
                row = run_point(point, name)
                base = child(a.baseline, point, name) if a.baseline else None
            else:
                mine: list[dict[str, object]] = []
                theirs: list[dict[str, object]] = []
                for i in range(a.reps):
                    order = [(ROOT, mine), (a.baseline, theirs)] if i % 2 == 0 else [(a.baseline, theirs), (ROOT, mine)]
                    for checkout, runs in order:
                        if checkout:
                            runs.append(child(checkout, point, name))
                row, base = least(mine), (least(theirs) if theirs else None)
                row["reps"] = a.reps
            if base is not None:
                row["baseline_cpu_s"] = base["cpu_s"]
                row["baseline_output_tok_s"] = base["output_tok_s"]
                row["cpu_x_baseline"] = row["cpu_s"] / base["cpu_s"]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    t = Table(title="simulator speed, one core (CPU s)")
    for c in ("point", "policy", "workers", "requests", "cpu s", "virtual s", "req / cpu s", "< 60 s",
              "baseline cpu s", "x baseline"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r["point"], r["policy"], str(r["workers"]), str(r["requests"]), f"{r['cpu_s']:.2f}",
                  f"{r['virtual_s']:.0f}", f"{r['requests'] / r['cpu_s']:.0f}", "yes" if r["under_60s"] else "NO",
                  f"{r['baseline_cpu_s']:.2f}" if "baseline_cpu_s" in r else "-",
                  f"{r['cpu_x_baseline']:.2f}" if "cpu_x_baseline" in r else "-")
    Console(width=140).print(t)
    write_json(a.out, {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                       "python": platform.python_version(), "baseline": a.baseline or "", "reps": a.reps,
                       "trace": "synthetic poisson, lognormal 2048 in / 256 out, shared 1024-token prefixes",
                       "points": {k: {"requests": v["requests"], "rate": v["rate"],
                                      "pools": [(n, c, acc, str(r)) for n, c, acc, r in v["pools"]]}  # type: ignore[attr-defined]
                                  for k, v in POINTS.items()},
                       "runs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
