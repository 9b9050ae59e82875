"""What learning each worker's speed costs the scheduler, per placement, in one process.

The cost policy places a stream of requests on a synthetic fleet (three server kinds, heartbeats as views)
with learning off, then on: every worker reports a bounded sample of its steps every REPORT_S of engine time
(as its heartbeat does) and is priced with its own learned factors. CPU per placement = (placement time +
the fit's time) / placements, at a request rate of --rate; both runs in this process, alternated --repeats
times, the best of each kept (the machine is shared).

    python benchmarks/learning_cost.py [--fleets 16 64 256 1024] [--rate 500] [--out results/learning_cost.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from hetmesh.costmodel.learn import REPORT_S, StepLog
from hetmesh.placement import RequestInfo, WorkerView
from hetmesh.placement.cost import CostPolicy
from hetmesh.protocol import Role, StepSample

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


def run(n: int, learn: bool, rate: float, requests: int, seed: int = 1) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    views = fleet(n)
    pol = CostPolicy(models={MODEL: MODEL}, learn=learn, admission_margin=0.0)
    steps = reports(n, rng)
    prompts = rng.integers(128, 8192, requests)
    place_s = learn_s = 0.0
    next_report = 0.0
    reported = 0
    for i in range(requests):
        now = i / rate
        if learn and now >= next_report:  # every worker's heartbeat with its steps, once per REPORT_S
            t0 = time.process_time()
            for w, s in zip(views, steps, strict=True):
                pol.observe(w, s, now)
            learn_s += time.process_time() - t0
            reported += n
            next_report += REPORT_S
        req = RequestInfo(request_id=f"r{i}", model=MODEL, prompt_len=int(prompts[i]), max_tokens=256, arrival=now)
        t0 = time.process_time()
        pol.place(req, views)
        place_s += time.process_time() - t0
    return {"placements": requests, "place_us": place_s / requests * 1e6, "learn_us": learn_s / requests * 1e6,
            "cpu_us_per_placement": (place_s + learn_s) / requests * 1e6, "reports": reported,
            "us_per_report": learn_s / max(reported, 1) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fleets", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--rate", type=float, default=500.0, help="requests per second of engine time")
    ap.add_argument("--seconds", type=float, default=8.0, help="engine seconds of requests per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="results/learning_cost.json")
    args = ap.parse_args()
    rows = []
    for n in args.fleets:
        best: dict[bool, dict[str, float]] = {}
        for _ in range(args.repeats):
            for learn in (False, True):
                r = run(n, learn, args.rate, int(args.rate * args.seconds))
                if learn not in best or r["cpu_us_per_placement"] < best[learn]["cpu_us_per_placement"]:
                    best[learn] = r
        rows.append({"workers": n, "off": best[False], "on": best[True],
                     "ratio": best[True]["cpu_us_per_placement"] / best[False]["cpu_us_per_placement"]})
    t = Table(title=f"Scheduler CPU per placement, cost policy, {args.rate:.0f} req/s, steps every {REPORT_S:.0f} s "
                    "per worker (best of runs)")
    for col in ("workers", "learning off us", "on: placement us", "on: fit us", "on: total us", "on / off",
                "us per report"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["workers"]), f"{r['off']['cpu_us_per_placement']:.0f}", f"{r['on']['place_us']:.0f}",
                  f"{r['on']['learn_us']:.0f}", f"{r['on']['cpu_us_per_placement']:.0f}", f"{r['ratio']:.3f}",
                  f"{r['on']['us_per_report']:.0f}")
    Console(width=130).print(t)
    res = {"rows": rows, "config": vars(args),
           "machine": {"platform": platform.platform(), "python": platform.python_version(),
                       "cpus": __import__("os").cpu_count(), "date": datetime.now(UTC).isoformat(timespec="seconds")}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
