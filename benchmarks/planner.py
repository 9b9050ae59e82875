"""The planner's targets, measured: plan time, optimality against enumeration, what heterogeneity
saves in capacity planning, and what re-planning gains when demand moves. Prints a table per part and
writes results/planner.json (parts not run keep their last results there).

- time: 256 devices (32 servers of 8) x 6 accelerator kinds x 3 models; CPU seconds of the solver
  (options + integer program) and of the simulation check of its candidates (target: <= 5 s in all).
- optimality: 6 servers of two kinds, one model: every (role, layout) assignment enumerated and
  simulated; the plan's simulated goodput against the best one (target: within 3%).
- value (planner_economics.py, seconds): per kind and role, $ per million tokens within the SLOs, and
  the most a mix can save (steady state), for the mixed and the long-context workloads.
- bound (planner_economics.py, minutes): the same bound on capacities measured by simulation (bursts
  priced) with servers bought in fractions: the least a purchase sized on those capacities costs.
- heterogeneity (planner_economics.py): a mixed workload (Azure conversation + Azure code, 2023 traces
  in data/, two models with their own SLOs); the cheapest purchase over all kinds that meets
  the SLOs against the cheapest single-kind purchase (target: >= 30% lower $/hour); the same with the
  MI300X price swept, NVIDIA only, and chat + long context (Mooncake prompts).
- long_context: the heterogeneity part's chat + long-context comparison alone (e.g. at another `--scale`).
- timevarying (planner_timevarying.py): model ramp, model step (two models of different sizes), model swap
  (the same step between two 70B models) and prefill:decode shift, re-planned
  from several demand forecasts vs the best static layout and the per-window oracle (targets: >= 1.3x
  and within 10%). Each 5-minute window is simulated whole (1,800-49,000 requests; 1-64 min per case
  and load on 2 shared cores); `--window-requests N` simulates its first N arrivals instead, a quick look that
  flatters a static layout once N arrivals span less than a few request lives (docs/planner.md).
- timevarying_load: the model cases with every rate x 0.5, 1, 1.5, 2 (`--loads`): where re-planning pays
  (the ceiling grows once each phase needs most of the fleet).
- afd: the attention-FFN disaggregation what-if.

    .venv/bin/python benchmarks/planner.py [--parts time,optimality,value,bound,heterogeneity,timevarying,timevarying_load,afd]
    .venv/bin/python benchmarks/planner.py --parts timevarying --cases model-step   (other cases' results kept)
    .venv/bin/python benchmarks/planner.py --parts timevarying_load --load-cases model-swap --loads 1.5,2
    .venv/bin/python benchmarks/planner.py --parts long_context --scale 16 --out results/planner_long_context_16x.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from planner_economics import (  # sibling scripts (on sys.path)
    part_bound,
    part_heterogeneity,
    part_long_context,
    part_value,
)
from planner_timevarying import CASES, LOADS, part_timevarying, part_timevarying_load
from rich.console import Console
from rich.table import Table

from hetmesh.planner import (
    Assignment,
    ModelDemand,
    ServerGroup,
    demand_trace,
    evaluate,
    plan,
)
from hetmesh.planner.plan import score
from hetmesh.protocol import Role
from hetmesh.sim.report import write_json

ROOT = Path(__file__).resolve().parents[1]
KINDS = ["nvidia-h200", "nvidia-b200", "nvidia-rubin-cpx", "nvidia-rubin-vr200", "amd-mi300x", "amd-mi308x"]
console = Console(width=140)


def part_time() -> dict[str, Any]:
    counts = [6, 6, 5, 5, 5, 5]  # 32 servers, 256 devices
    groups = [ServerGroup(name=k, accelerator=k, count=n, max_batch=128) for k, n in zip(KINDS, counts, strict=True)]
    demands = [ModelDemand(name="llama-70b", spec="llama-3.1-70b", rate=12.0, input_mean=2048, output_mean=256),
               ModelDemand(name="qwen3-32b", spec="qwen3-32b", rate=20.0, input_mean=1024, output_mean=512,
                           ttft_slo_s=1.0, tpot_slo_s=0.05, priority=2.0),
               ModelDemand(name="r1", spec="deepseek-r1", rate=2.0, input_mean=4096, output_mean=512,
                           ttft_slo_s=4.0, tpot_slo_s=0.1)]
    from hetmesh.planner.plan import options
    from hetmesh.planner.solve import solve

    c0 = time.process_time()
    opts = options(groups, demands)
    sol = solve(groups, demands, opts)
    c1 = time.process_time()
    p = plan(groups, demands, check_duration_s=60.0)
    c2 = time.process_time()
    return {"servers": sum(counts), "devices": 8 * sum(counts), "kinds": len(KINDS), "models": len(demands),
            "options": len(opts), "solve_cpu_s": c1 - c0, "plan_cpu_s": c2 - c1, "chosen": p.chosen,
            "candidates": [(c.name, round(c.score, 1)) for c in p.candidates], "served": sol.served if sol else {},
            "goodput_tok_s": p.predicted["goodput_tok_s"], "slo_attainment": p.predicted["slo_attainment"],
            "under_5s": c2 - c1 <= 5.0}


def part_optimality() -> dict[str, Any]:
    groups = [ServerGroup(name="mi300x", accelerator="amd-mi300x", count=3),
              ServerGroup(name="mi308x", accelerator="amd-mi308x", count=3)]
    demand = [ModelDemand(name="r1", spec="deepseek-r1", rate=1.5, input_mean=2048, output_mean=256,
                          ttft_slo_s=3.0, tpot_slo_s=0.2)]
    trace = demand_trace(demand, 400.0, seed=3)
    p = plan(groups, demand, trace=trace)
    planned = score(p.predicted, demand)
    roles = [Role.BOTH, Role.PREFILL, Role.DECODE, None]  # None: the server idles
    best, best_layout, n = 0.0, None, 0
    per_kind = [list(itertools.combinations_with_replacement(roles, g.count)) for g in groups]
    for combo in itertools.product(*per_kind):
        lay = []
        for g, rs in zip(groups, combo, strict=True):
            lay += [Assignment(f"{g.name}-{i}", g.name, g.accelerator, g.devices, "r1" if r else "", r or Role.BOTH,
                               "tp") for i, r in enumerate(rs)]
        if not any(a.model for a in lay):
            continue
        sm = evaluate(lay, demand, groups, trace)
        n += 1
        if sm is not None and score(sm, demand) > best:
            best, best_layout = score(sm, demand), [(a.server, str(a.role)) for a in lay if a.model]
    return {"layouts_enumerated": n, "best_enumerated_tok_s": best, "best_layout": best_layout,
            "planned_tok_s": planned, "planned_layout": {f"{k[0]}/{k[2]}/{k[3]}": v for k, v in p.layout().items()},
            "ratio": planned / best if best else float("nan"), "within_3pct": planned >= 0.97 * best}


def part_afd() -> dict[str, Any]:
    """Attention on a bandwidth-rich server, FFN / experts on a compute-rich one, 1:1, against either alone."""
    from hetmesh.costmodel.afd import what_if

    rows = []
    for spec in ("deepseek-r1", "qwen3-235b-a22b"):
        for attn in ("nvidia-rubin-vr200", "amd-mi308x"):
            for ffn in ("nvidia-rubin-cpx", "amd-mi300x"):
                w = what_if(spec, attn, ffn)
                rows.append({"model": spec, "attention": attn, "ffn": ffn, "batch": w.batch, "tok_s": round(w.tok_s),
                             "tok_per_usd": round(w.tok_per_usd), "best_single": w.best_single,
                             "single_tok_per_usd": round(w.single_tok_per_usd), "pays": round(w.pays, 3)})
    return {"pairs": rows, "any_pays": any(r["pays"] > 1 for r in rows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", "--part", default="time,optimality,value,bound,heterogeneity,timevarying,timevarying_load,afd",
                    help="comma-separated parts to run (results of the others are kept from --out if it exists)")
    ap.add_argument("--requests", type=int, default=2000, help="heterogeneity: requests taken from each trace")
    ap.add_argument("--scale", type=float, default=8.0,
                    help="heterogeneity: the traces' arrivals this many times faster (a data-centre's load)")
    ap.add_argument("--long-requests", type=int, default=1000,
                    help="heterogeneity: conversation requests in the long-context mix (Mooncake over their span)")
    ap.add_argument("--attainment", type=float, default=0.9,
                    help="heterogeneity: the share of requests within both SLOs that meeting the SLOs asks for")
    ap.add_argument("--cases", default=",".join(CASES), help="timevarying: which cases")
    ap.add_argument("--load-cases", default="model-step,model-shift,model-swap", help="timevarying_load: which cases")
    ap.add_argument("--window-requests", type=int, default=0,
                    help="timevarying: simulated requests per window, its first arrivals (0: the whole window)")
    ap.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS), help="timevarying_load: rate multipliers")
    ap.add_argument("--sub-s", type=float, default=60.0, help="timevarying: re-plan interval of last_subwindow, s")
    ap.add_argument("--out", default=str(ROOT / "results" / "planner.json"))
    a = ap.parse_args()
    if not 0.0 < a.attainment <= 1.0:
        ap.error(f"--attainment {a.attainment}: a share of requests, in (0, 1]")
    if a.window_requests < 0:
        ap.error(f"--window-requests {a.window_requests}: a count of requests, or 0 for the whole window")
    try:
        loads = [float(x) for x in a.loads.split(",")]
    except ValueError:
        ap.error(f"--loads {a.loads}: comma-separated rate multipliers, e.g. 1,2")
    if any(x <= 0 for x in loads):
        ap.error(f"--loads {a.loads}: every multiplier must be above 0")
    parts = {"time": part_time, "optimality": part_optimality,
             "value": lambda: part_value(a.requests, a.scale, a.long_requests),
             "bound": lambda: part_bound(a.requests, a.scale, a.long_requests, a.attainment),
             "heterogeneity": lambda: part_heterogeneity(a.requests, a.scale, a.long_requests, a.attainment),
             "long_context": lambda: part_long_context(a.long_requests, a.scale, a.attainment),
             "timevarying": lambda: part_timevarying(sub_s=a.sub_s, cases=a.cases.split(","),
                                                   window_requests=a.window_requests),
             "timevarying_load": lambda: part_timevarying_load(sub_s=a.sub_s, cases=a.load_cases.split(","),
                                                             loads=loads, window_requests=a.window_requests),
             "afd": part_afd}
    chosen = a.parts.split(",")
    if unknown := [p for p in chosen if p not in parts]:
        ap.error(f"unknown part(s) {', '.join(unknown)}: choose from {', '.join(parts)}")
    if bad := [c for c in a.cases.split(",") + a.load_cases.split(",") if c not in CASES]:
        ap.error(f"unknown case(s) {', '.join(bad)}: choose from {', '.join(CASES)}")
    out: dict[str, Any] = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {}
    out.update({"machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version()})
    for part in chosen:
        t0 = time.perf_counter()
        got = parts[part]()
        # the time-varying parts are keyed by case: a run of some cases keeps the others' last results
        out[part] = {**out.get(part, {}), **got} if part.startswith("timevarying") else got
        out[part]["wall_s"] = time.perf_counter() - t0
        t = Table(title=f"planner: {part}")
        t.add_column("key")
        t.add_column("value")
        for k, v in out[part].items():
            t.add_row(k, f"{v:.3g}" if isinstance(v, float) else str(v))
        console.print(t)
    write_json(a.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
