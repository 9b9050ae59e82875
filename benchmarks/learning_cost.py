"""What learning each worker's speed costs the scheduler, per placement, in one process.

The cost policy places a stream of requests on a synthetic fleet (three server kinds, heartbeats as views)
with learning off, then on: every worker reports a bounded sample of its steps every REPORT_S of engine time
(as its heartbeat does), through the scheduler's own learning shell (hetmesh.scheduler.learning: the fits'
CPU budget, reports kept for a later fit when it is spent), and is priced with its own learned factors.
`--no-budget` fits every report. CPU per placement = (placement time + the fit's time) / placements, at a
request rate of --rate (engine time stands for the scheduler's wall clock); both runs in this process,
alternated --repeats times, the best of each kept (the machine is shared). Each worker's first fit (when it
joins; never put off) runs before the timing starts. The budget counts placement CPU
only, so it is stricter here than in a scheduler, whose other work (the bus, heartbeats) earns it too.

    python benchmarks/learning_cost.py [--fleets 16 64 256 1024] [--rate 500] [--out results/learning_cost.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from hetmesh.costmodel.learn import REPORT_S, FitBudget, StepLog
from hetmesh.placement import RequestInfo, WorkerView
from hetmesh.placement.cost import CostPolicy
from hetmesh.protocol import Heartbeat, Role, StepSample
from hetmesh.scheduler.learning import Learning

KINDS = ("nvidia-h100", "amd-mi300x", "amd-mi308x")
MODEL = "llama-3.1-70b"


def fleet(n: int) -> list[WorkerView]:
    return [WorkerView(worker_id=f"w{i}", model=MODEL, accelerator=KINDS[i % 3], vendor=KINDS[i % 3].split("-")[0],
                       devices=8, role=Role.BOTH, queue_depth=i % 4, running=8 + i % 16, max_batch=128,
                       kv_blocks_total=100_000, kv_blocks_used=20_000 + 500 * (i % 8), block_size=16)
            for i in range(n)]


def reports(n_workers: int, rng: np.random.Generator, per_report: int = StepLog().cap) -> list[list[StepSample]]:
    out = []
    for _ in range(n_workers):
        steps = []
        for _ in range(per_report):
            new = int(rng.integers(0, 4096)) if rng.random() < 0.3 else 0
            nd = int(rng.integers(1, 64))
            steps.append(StepSample(new, int(new > 0), new * (new + 1) / 2, 0, nd, nd * int(rng.integers(500, 4000)),
                                    float(rng.uniform(0.01, 0.08))))
        out.append(steps)
    return out


def beats(views: list[WorkerView], steps: list[list[StepSample]]) -> list[Heartbeat]:
    return [Heartbeat(worker_id=w.worker_id, model=w.model, accelerator=w.accelerator, vendor=w.vendor,
                      devices=w.devices, role=w.role, engine="sim", work_subject="", queue_depth=w.queue_depth,
                      running=w.running, max_batch=w.max_batch, kv_blocks_total=w.kv_blocks_total,
                      kv_blocks_used=w.kv_blocks_used, block_size=w.block_size, ts=0.0, instance="run",
                      steps=s) for w, s in zip(views, steps, strict=True)]


def run(n: int, learn: bool, rate: float, requests: int, budget: bool = True, seed: int = 1) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    views = fleet(n)
    pol = CostPolicy(models={MODEL: MODEL}, learn=learn, admission_margin=0.0)
    shell = Learning(pol, 1.0)
    if not budget:  # credit without end: every report fitted
        shell.budget = FitBudget(share=0.0, floor=0.0, burst_s=math.inf)
    hbs = beats(views, reports(n, rng))
    prompts = rng.integers(128, 8192, requests)
    place_s = learn_s = 0.0
    if learn:  # each worker's first fit, once when it joins (never put off), before the steady state timed
        for w, hb in zip(views, hbs, strict=True):
            shell.heartbeat(hb, w, 0.0)
        shell.budget.skipped = 0
    next_report = REPORT_S
    reported = 0
    for i in range(requests):
        now = i / rate
        if learn and now >= next_report:  # every worker's heartbeat with its steps, once per REPORT_S
            t0 = time.process_time()
            for w, hb in zip(views, hbs, strict=True):
                shell.heartbeat(hb, w, now)
            learn_s += time.process_time() - t0
            reported += n
            next_report += REPORT_S
        req = RequestInfo(request_id=f"r{i}", model=MODEL, prompt_len=int(prompts[i]), max_tokens=256, arrival=now)
        t0 = time.process_time()
        pol.place(req, views)
        place_s += time.process_time() - t0
    return {"placements": requests, "place_us": place_s / requests * 1e6, "learn_us": learn_s / requests * 1e6,
            "cpu_us_per_placement": (place_s + learn_s) / requests * 1e6, "reports": reported,
            "us_per_report": learn_s / max(reported, 1) * 1e6, "deferred": shell.budget.skipped,
            "fitted_share": 1.0 - shell.budget.skipped / max(reported, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fleets", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--rate", type=float, default=500.0, help="requests per second of engine time")
    ap.add_argument("--seconds", type=float, default=8.0, help="engine seconds of requests per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-budget", action="store_true", help="fit every report (no CPU budget)")
    ap.add_argument("--out", default="results/learning_cost.json")
    args = ap.parse_args()
    rows = []
    for n in args.fleets:
        best: dict[bool, dict[str, float]] = {}
        for _ in range(args.repeats):
            for learn in (False, True):
                r = run(n, learn, args.rate, int(args.rate * args.seconds), budget=not args.no_budget)
                if learn not in best or r["cpu_us_per_placement"] < best[learn]["cpu_us_per_placement"]:
                    best[learn] = r
        rows.append({"workers": n, "off": best[False], "on": best[True],
                     "ratio": best[True]["cpu_us_per_placement"] / best[False]["cpu_us_per_placement"]})
    t = Table(title=f"Scheduler CPU per placement, cost policy, {args.rate:.0f} req/s, steps every {REPORT_S:.0f} s "
                    f"per worker, fits {'unbudgeted' if args.no_budget else 'budgeted'} (best of runs)")
    for col in ("workers", "learning off us", "on: placement us", "on: fit us", "on: total us", "on / off",
                "us per report", "reports fitted"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["workers"]), f"{r['off']['cpu_us_per_placement']:.0f}", f"{r['on']['place_us']:.0f}",
                  f"{r['on']['learn_us']:.0f}", f"{r['on']['cpu_us_per_placement']:.0f}", f"{r['ratio']:.3f}",
                  f"{r['on']['us_per_report']:.0f}", f"{r['on']['fitted_share']:.0%}")
    Console(width=130).print(t)
    res = {"rows": rows, "config": vars(args),
           "machine": {"platform": platform.platform(), "python": platform.python_version(),
                       "cpus": os.cpu_count(), "load": os.getloadavg(), "date": datetime.now(UTC).isoformat(timespec="seconds")}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
