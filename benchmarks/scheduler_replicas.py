"""1 vs 2 vs 4 scheduler replicas in the simulator, each placing on the view the live mesh gives it.

Each replica is its own cost policy (its own bookkeeping) over its own view: every worker's heartbeat every
0.5 s and Finished records 20 ms late (batched), both heard by every replica, plus what the replica placed itself
since the heartbeat (hetmesh.sim.replicas). Gateways pick a replica at random per request (and per client retry;
a request a replica holds stays on it). Two ways to share
placements: "own" (no sharing: another replica's placements show only in the next heartbeat, and never in a
policy's own bookkeeping) and "shared", what the scheduler does: each replica publishes its placements on the bus
(hetmesh.sched.booked, at once; heard here --share-s later, 1 ms by default) and the others count them on the workers and book them
in their policy as the placing one did (CostPolicy.booked). The worker is the arbiter either way: its engine
admits nothing past its batch or KV blocks.

Clusters, traces and loads are the anchors benchmark's (benchmarks/anchors.py), at its high loads 0.8, 1.0 and
1.5x capacity; the cost policy with the scheduler's defaults. Goodput is the anchors' (SLO-met output tokens per
second of the offered trace), the mean over --seeds draws (heartbeat phases, the gateways' picks; without sharing
one draw); M replicas' over one replica's at the same point (the same heartbeat model; "instant" is the plain simulator, every view
exact). Two replicas placing within the sharing delay of each other still place on views that miss each other's
placement, and at points where few requests meet their SLOs that changes goodput by several % either way per
draw: the spread (min..max over draws) is in the results. Over-booking: requests on the
chosen workers that the placing replica did not count, placements onto a batch that was full while the
replica's view showed room, prefills placed on a worker another replica had just placed on (its booking not heard
yet: the collisions the sharing delay allows), admissions past pool_full (queue_factor) the replica could not see, and steps in
which any worker ran past its batch or KV limit (must be 0). Writes results/scheduler_replicas.json.
--place-s: each replica's time per placement (default 0, instant), behind which what it hears waits.
    nice .venv/bin/python benchmarks/scheduler_replicas.py [--only mix] [--traces azure-conv] [--loads 0.8]
        [--seeds 4] [--share-s 0.001] [--place-s S]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchors import CLUSTERS, TRACES, _row, capacity

from hetmesh.bus import EVENT_BATCH_S
from hetmesh.config import SchedulerConfig
from hetmesh.costmodel import load_efficiencies
from hetmesh.sim import SimConfig, load, simulate
from hetmesh.sim.replicas import simulate_replicas
from hetmesh.sim.report import write_json
from hetmesh.sim.traces import DATA_DIR

ROOT = Path(__file__).resolve().parents[1]
LOADS = (0.8, 1.0, 1.5)
REPLICAS = (1, 2, 4)
MODES = {"own": None, "shared": 0.001, "withdrawn": 0.001}
TARGET = 0.97  # goodput of M replicas over one
RUNS = ("2 own", "4 own", "2 shared", "4 shared", "2 withdrawn", "4 withdrawn")


def run_point(ws: list, tr: Any, cfg: SimConfig, slo: Any, sc: SchedulerConfig, seeds: int,
              place_s: float = 0.0) -> dict[str, Any]:
    kw = {"objective": sc.objective, "admission_margin": sc.admission_margin}
    s, _ = simulate(ws, "cost", tr, cfg, slo, **kw)
    out: dict[str, Any] = {"instant": _row(s, tr, "instant", "both")}
    for mode, share in MODES.items():
        for m in REPLICAS:
            if m == 1 and mode != "own":
                continue  # one replica has nobody to share with
            runs, obs = [], []
            for seed in range(seeds if mode != "own" or m == 1 else 1):  # without sharing: one draw shows it
                s, _, ob = simulate_replicas(ws, "cost", m, tr, cfg, slo, seed=seed, share_s=share,
                                             queue_factor=sc.queue_factor, withdraw=mode == "withdrawn",
                                             place_s=place_s, **kw)
                runs.append(_row(s, tr, f"{m} {mode}", "both"))
                obs.append(dataclasses.asdict(ob))
            r = runs[0]
            goods = [x["goodput_tok_s"] for x in runs]
            r["goodput_runs"] = goods
            r["goodput_tok_s"] = sum(goods) / len(goods)
            r["slo_attainment"] = sum(x["slo_attainment"] for x in runs) / len(runs)
            r["rejected"] = sum(x["rejected"] for x in runs) / len(runs)
            r["overbooking"] = {k: (max if k.endswith("_max") or k.startswith("peak") else sum)(o[k] for o in obs)
                                for k in obs[0] if k != "per_replica"}  # summed over the draws (maxima: max)
            r["overbooking"]["per_replica"] = obs[0]["per_replica"]
            out["1" if m == 1 else f"{m} {mode}"] = r
    one = out["1"]["goodput_tok_s"]
    for r in out.values():
        r["vs_one"] = r["goodput_tok_s"] / one if one > 0 else 1.0
    return out


def markdown(results: dict[str, Any]) -> str:
    """docs/benchmarks.md's table: per point, goodput of 1 replica and M replicas over it, and over-booking."""
    lines = ["| cluster / trace | load | 1 replica (tok/s) | 2, own | 4, own | 2, shared | 4, shared "
             "| 2, shared + withdrawn | 4, shared + withdrawn | 4 shared: draws "
             "| unseen per placement, 4 own / shared | placed on a full batch, 4 own / shared "
             "| prefills placed on unheard bookings, 2 / 4 shared | over a limit |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|---:|"]
    for cname, c in results["clusters"].items():
        for tname, t in c["traces"].items():
            for p in t["points"]:
                one = p["1"]["goodput_tok_s"]
                ob = {k: p[k]["overbooking"] for k in ("4 own", "4 shared")}
                draws = [g / one for g in p["4 shared"]["goodput_runs"]] if one > 0 else [1.0]
                lines.append(
                    f"| {cname} / {tname} | {p['load']:g}x | {one:,.0f} | "
                    + " | ".join(f"{p[k]['vs_one']:.2f}x" for k in RUNS)
                    + f" | {min(draws):.2f}-{max(draws):.2f} | "
                    + " / ".join(f"{o['unseen'] / max(o['placements'], 1):.2f}" for o in ob.values()) + " | "
                    + " / ".join(str(o["blind_full"]) for o in ob.values()) + " | "
                    + " / ".join(str(p[k]["overbooking"].get("collided", 0)) for k in ("2 shared", "4 shared")) + " | "
                    + str(sum(p[k]["overbooking"]["over_limit"] for k in ("1", *RUNS))) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--span", type=float, default=60.0, help="as benchmarks/anchors.py")
    ap.add_argument("--max-requests", type=int, default=3000)
    ap.add_argument("--seeds", type=int, default=4, help="draws per point and replica count (goodput: their mean)")
    ap.add_argument("--only", nargs="*", default=None, choices=sorted(CLUSTERS))
    ap.add_argument("--traces", nargs="*", default=None, choices=sorted(TRACES))
    ap.add_argument("--loads", nargs="*", type=float, default=list(LOADS), help="x capacity")
    ap.add_argument("--share-s", type=float, default=MODES["shared"], help="how late the other replicas hear a booking")
    ap.add_argument("--place-s", type=float, default=0.0,
                    help="each replica's time per placement, which what it hears waits behind (0: instant)")
    ap.add_argument("--out", default=str(ROOT / "results" / "scheduler_replicas.json"))
    ap.add_argument("--tables", action="store_true", help="print the markdown table of --out, run nothing")
    args = ap.parse_args()
    console = Console(width=200)
    if args.tables:
        console.print(markdown(json.loads(Path(args.out).read_text())), soft_wrap=True)
        return 0
    MODES["shared"] = MODES["withdrawn"] = args.share_s
    sc = SchedulerConfig()
    effs = load_efficiencies(ROOT / "results" / "seed_efficiency.json")
    t0 = time.time()
    results: dict[str, Any] = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "cpus": os.cpu_count(),
        "load_average_start": os.getloadavg(), "span_s": args.span, "max_requests": args.max_requests,
        "loads": args.loads, "replicas": REPLICAS, "modes": {k: v for k, v in MODES.items()}, "seeds": args.seeds, "place_s": args.place_s,
        "heartbeat_s": 0.5, "finished_s": EVENT_BATCH_S, "goodput": "mean over the seeds' draws", "target": TARGET, "clusters": {}}
    tb = Table(title="Scheduler replicas: SLO goodput (tok/s, mean of the draws) and over 1 replica; over-booking "
                     "summed over the draws")
    for col in ("cluster / trace", "load", "instant", "1", *RUNS, "4 shared draws",
                "unseen/placement (4 own -> shared)", "blind full batch", "past pool_full", "over limit"):
        tb.add_column(col, justify="right")
    misses = []
    for cname, (desc, build, slo) in CLUSTERS.items():
        if args.only and cname not in args.only:
            continue
        cfg = SimConfig(efficiencies=effs if cname == "seed" else {})
        cres: dict[str, Any] = {"cluster": desc, "traces": {}}
        for tname, fname in TRACES.items():
            if args.traces and tname not in args.traces:
                continue
            trace = load(Path(DATA_DIR) / fname, limit=args.max_requests)
            cap = max(capacity(build, trace, cfg, slo).values())
            trace = trace.head(int(min(max(cap * args.span, 300), args.max_requests)))
            natural = len(trace) / max(trace.requests[-1].arrival - trace.requests[0].arrival, 1e-9)
            points = []
            for x in args.loads:
                tr = trace.scaled(x * cap / natural)
                p = run_point(build("both"), tr, cfg, slo, sc, args.seeds, args.place_s)
                points.append({"load": x, "rate_req_s": x * cap, **p})
                ob = {k: p[k]["overbooking"] for k in p if k != "instant"}
                per = {k: o["unseen"] / max(o["placements"], 1) for k, o in ob.items()}
                tb.add_row(f"{cname} / {tname}", f"{x:g}x", f"{p['instant']['goodput_tok_s']:.0f}",
                           f"{p['1']['goodput_tok_s']:.0f}",
                           *(f"{p[k]['goodput_tok_s']:.0f} ({p[k]['vs_one']:.3f})"
                             for k in RUNS),
                           "..".join(f"{g / max(p['1']['goodput_tok_s'], 1e-9):.2f}" for g in (
                               min(p["4 shared"]["goodput_runs"]), max(p["4 shared"]["goodput_runs"]))),
                           f"{per['4 own']:.2f} -> {per['4 shared']:.2f}",
                           f"{ob['4 own']['blind_full']} -> {ob['4 shared']['blind_full']}",
                           f"{ob['4 own']['pool_full_missed']} -> {ob['4 shared']['pool_full_missed']}",
                           str(sum(o["over_limit"] for o in ob.values())))
                misses += [f"{cname}/{tname} {x:g}x {k}: {p[k]['vs_one']:.3f}" for k in RUNS[2:]
                           if p[k]["vs_one"] < TARGET]
                console.print(f"{cname} {tname} {x:g}x: " + ", ".join(
                    f"{k} {v['goodput_tok_s']:.0f}" for k, v in p.items()) + f"  [{time.time() - t0:.0f}s]")
            cres["traces"][tname] = {"capacity_req_s": cap, "requests": len(trace), "points": points}
        results["clusters"][cname] = cres
    results["misses"] = misses
    results["wall_s"] = time.time() - t0
    results["load_average_end"] = os.getloadavg()
    console.print(tb)
    for mode in ("shared", "withdrawn"):
        miss = [m for m in misses if f" {mode}:" in m]
        console.print(f"{mode} within {1 - TARGET:.0%} of one replica at every point: "
                      + ("yes" if not miss else f"no: {miss}"))
    write_json(args.out, results)
    console.print(markdown(results), soft_wrap=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
