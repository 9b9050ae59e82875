"""Simulator speed: 10,000 requests over a 24-worker mixed cluster, one core, per policy.

Target: under 60 s wall per run. Prints a table, writes results/sim_speed.json.
    .venv/bin/python benchmarks/sim_speed.py [--requests 10000] [--policies round_robin,cost]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hetmesh.protocol import Role
from hetmesh.sim import pool, simulate, synthetic
from hetmesh.sim.report import write_json

ROOT = Path(__file__).resolve().parents[1]


def cluster() -> list:
    """24 servers: 8 H100 (both), 8 Rubin CPX (prefill), 8 Rubin VR200 (decode), Llama-3.1-70B."""
    m = {"model": "llama-3.1-70b", "devices": 8, "max_batch": 128}
    return (pool("h100", 8, "nvidia-h100", Role.BOTH, **m) + pool("cpx", 8, "nvidia-rubin-cpx", Role.PREFILL, **m)
            + pool("vr200", 8, "nvidia-rubin-vr200", Role.DECODE, **m))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--policies", default="round_robin,least_loaded,prefix_aware,cost")
    ap.add_argument("--out", default=str(ROOT / "results" / "sim_speed.json"))
    a = ap.parse_args()
    try:  # measure one core, as the target says
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    except (AttributeError, OSError):
        pass
    workers = cluster()
    trace = synthetic(a.requests, rate=60.0, input_mean=2048, output_mean=256, prefix_groups=32,
                      prefix_tokens=1024, seed=11)
    rows = []
    for name in [p for p in a.policies.split(",") if p]:
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        s, res = simulate(workers, name, trace)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        rows.append({"policy": name, "requests": s["requests"], "workers": len(workers), "wall_s": wall,
                     "cpu_s": cpu, "virtual_s": s["duration_s"], "output_tokens": int(sum(
                         r.output_len for r in res.records)), "requests_per_wall_s": s["requests"] / wall,
                     "under_60s": wall < 60.0})
    t = Table(title=f"simulator speed: {a.requests} requests, {len(workers)} workers, one core")
    for c in ("policy", "wall s", "cpu s", "virtual s", "req / wall s", "< 60 s"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r["policy"], f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}", f"{r['virtual_s']:.0f}",
                  f"{r['requests_per_wall_s']:.0f}", "yes" if r["under_60s"] else "NO")
    Console(width=120).print(t)
    write_json(a.out, {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                       "trace": "synthetic poisson 60 req/s, lognormal 2048 in / 256 out, 32 prefix groups",
                       "cluster": "8x H100 both + 8x Rubin CPX prefill + 8x Rubin VR200 decode, 8 devices each, "
                                  "Llama-3.1-70B", "runs": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
