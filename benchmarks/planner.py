"""The planner's targets, measured: plan time, optimality against enumeration, and what heterogeneity
saves in capacity planning. Prints a table per part and writes results/planner.json.

- time: 256 devices (32 servers of 8) x 6 accelerator kinds x 3 models; CPU seconds of the solver
  (options + integer program) and of the simulation check of its candidates (target: <= 5 s in all).
- optimality: 6 servers of two kinds, one model: every (role, layout) assignment enumerated and
  simulated; the plan's simulated goodput against the best one (target: within 3%).
- heterogeneity: a mixed workload (Azure conversation + Azure code, 2023 traces in ../shared/data,
  two models with their own SLOs); the cheapest purchase over all kinds that meets the SLOs against
  the cheapest single-kind purchase (target: >= 30% lower $/hour).

    .venv/bin/python benchmarks/planner.py [--parts time,optimality,heterogeneity]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hetmesh.planner import (
    Assignment,
    ModelDemand,
    ServerGroup,
    demand_from_trace,
    demand_trace,
    evaluate,
    plan,
)
from hetmesh.planner.buy import cheapest
from hetmesh.planner.plan import current_layout, score
from hetmesh.protocol import Role
from hetmesh.sim.report import write_json
from hetmesh.sim.traces import Trace, TraceRequest, load_azure

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
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


def _mixed(n: int, scale: float = 1.0) -> tuple[Trace, list[ModelDemand]]:
    conv = load_azure(DATA / "azure2023_AzureLLMInferenceTrace_conv.csv", limit=n)
    code = load_azure(DATA / "azure2023_AzureLLMInferenceTrace_code.csv", limit=n)
    reqs = [TraceRequest(r.arrival, r.input_len, r.output_len, r.hash_ids, "chat") for r in conv.requests]
    reqs += [TraceRequest(r.arrival, r.input_len, r.output_len, r.hash_ids, "code") for r in code.requests]
    reqs.sort(key=lambda r: r.arrival)
    tr = Trace(reqs, conv.block_tokens, "azure-conv+code").scaled(scale)
    demands = [demand_from_trace(tr, name="chat", spec="llama-3.1-70b", ttft_slo_s=2.0, tpot_slo_s=0.1),
               demand_from_trace(tr, name="code", spec="qwen3-32b", ttft_slo_s=4.0, tpot_slo_s=0.05)]
    return tr, demands


def part_heterogeneity(n: int, scale: float) -> dict[str, Any]:
    tr, demands = _mixed(n, scale)
    kinds = [ServerGroup(name=k, accelerator=k, count=48, max_batch=128) for k in KINDS]
    mixed = cheapest(kinds, demands, trace=tr)
    singles: dict[str, Any] = {}
    for k in kinds:
        q = cheapest([k], demands, trace=tr)
        singles[k.name] = None if q is None or not q.meets else {"usd_per_hour": q.usd_per_hour,
                                                                 "servers": q.servers,
                                                                 "slo_attainment": q.slo_attainment}
    met = {k: v for k, v in singles.items() if v}
    single_best = min(met.items(), key=lambda kv: kv[1]["usd_per_hour"]) if met else None
    saving = 1 - mixed.usd_per_hour / single_best[1]["usd_per_hour"] if mixed and mixed.meets and single_best else None
    return {"requests": len(tr.requests), "rate_scale": scale, "demands": [(d.name, round(d.rate, 2), round(d.input_mean),
                                                       round(d.output_mean)) for d in demands],
            "mixed": None if mixed is None else {"servers": mixed.servers, "usd_per_hour": mixed.usd_per_hour,
                                                 "slo_attainment": mixed.slo_attainment, "meets": mixed.meets},
            "singles": singles, "cheapest_single": single_best and single_best[0], "saving": saving,
            "saves_30pct": bool(saving is not None and saving >= 0.30)}


def _shift_case(case: str, windows: int, window_s: float) -> tuple[list[ServerGroup], list[list[ModelDemand]]]:
    """Per-window demand of a time-varying case, and the fleet it runs on (today's layout: all `both`)."""
    out = []
    for i in range(windows):
        x = i / max(windows - 1, 1)
        if case == "model-shift":  # demand moves from model A to model B over the hour, the fleet ~busy
            out.append([ModelDemand(name="A", spec="llama-3.1-70b", rate=max(36.0 * (1 - x), 1.8), input_mean=2048,
                                    output_mean=256),
                        ModelDemand(name="B", spec="qwen3-32b", rate=max(80.0 * x, 4.0), input_mean=1024,
                                    output_mean=256)])
        else:  # the prefill:decode mix alternates between code-heavy and chat-heavy phases
            code = i % 2 == 0
            out.append([ModelDemand(name="A", spec="llama-3.1-70b", rate=6.0 if code else 10.0,
                                    input_mean=8192 if code else 512, output_mean=64 if code else 512)])
    if case == "model-shift":
        groups = [ServerGroup(name="h200", accelerator="nvidia-h200", count=8, model="A", max_batch=128)]
    else:  # the NVL144 CPX rack's 2:1
        groups = [ServerGroup(name="cpx", accelerator="nvidia-rubin-cpx", count=6, model="A", max_batch=128),
                  ServerGroup(name="vr200", accelerator="nvidia-rubin-vr200", count=3, model="A", max_batch=128)]
    return groups, out


def part_timevarying(windows: int = 6, window_s: float = 300.0) -> dict[str, Any]:
    """Re-plan each window from the last window's demand (what a live planner knows), switch costs
    counted, against the best single static layout in hindsight and the per-window oracle."""
    res: dict[str, Any] = {}
    for case in ("model-shift", "pd-shift"):
        groups, demand = _shift_case(case, windows, window_s)
        traces = [demand_trace(d, window_s, seed=i) for i, d in enumerate(demand)]
        n = sum(g.count for g in groups)

        def good(lay: list[Assignment], i: int, gs: list[ServerGroup] = groups,
                 demand: list[list[ModelDemand]] = demand, traces: list[Trace] = traces) -> float:
            sm = evaluate(lay, demand[i], gs, traces[i])
            return score(sm, demand[i]) if sm else 0.0

        oracle = [plan(groups, demand[i], trace=traces[i], horizon_s=float("inf")) for i in range(windows)]
        oracle_tok = sum(good(p.assignments, i) for i, p in enumerate(oracle))
        replanned: dict[str, float] = {}
        for basis_name, lag in (("forecast", 0), ("last_window", 1)):
            cur, tok = groups, 0.0
            for i in range(windows):
                basis = demand[max(i - lag, 0)]  # a forecast of this window, or what the last one saw
                p = plan(cur, basis, trace=demand_trace(basis, window_s, seed=100 + i), horizon_s=window_s)
                out_s = sum(m.seconds for m in p.moves)
                tok += good(p.assignments, i, cur) * (1 - min(out_s / (window_s * n), 1.0))
                cur = _regroup(cur, p.assignments)
            replanned[basis_name] = tok
        statics = [p.assignments for p in oracle] + [current_layout(groups)]  # each held all hour
        static_tok = max(sum(good(lay, i) for i in range(windows)) for lay in statics)
        res[case] = {"windows": windows, "window_s": window_s, "static_best_tok": static_tok, "oracle_tok": oracle_tok,
                     **{f"replanned_{k}_tok": v for k, v in replanned.items()},
                     **{f"gain_vs_static_{k}": v / static_tok for k, v in replanned.items()},
                     **{f"vs_oracle_{k}": v / oracle_tok for k, v in replanned.items()}}
    return res


def _regroup(groups: list[ServerGroup], lay: list[Assignment]) -> list[ServerGroup]:
    """The fleet as the plan left it: one group per server (its current model, role and layout),
    named so that a server keeps its name from one window to the next."""
    base = {g.name: g for g in groups}

    def name(a: Assignment) -> str:
        stem = a.server.removesuffix("-0")
        return stem if stem == a.group else a.server

    return [ServerGroup(name=name(a), accelerator=a.accelerator, devices=a.devices, count=1, model=a.model,
                        role=a.role, parallel=a.parallel, max_batch=base[a.group].max_batch,
                        step_tokens=base[a.group].step_tokens) for a in lay]


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
    ap.add_argument("--parts", default="time,optimality,heterogeneity,timevarying,afd")
    ap.add_argument("--requests", type=int, default=2000, help="heterogeneity: requests taken from each trace")
    ap.add_argument("--scale", type=float, default=8.0,
                    help="heterogeneity: the traces' arrivals this many times faster (a data-centre's load)")
    ap.add_argument("--out", default=str(ROOT / "results" / "planner.json"))
    a = ap.parse_args()
    out: dict[str, Any] = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version()}
    for part in a.parts.split(","):
        t0 = time.perf_counter()
        out[part] = {"time": part_time, "optimality": part_optimality,
                     "heterogeneity": lambda: part_heterogeneity(a.requests, a.scale),
                     "timevarying": part_timevarying, "afd": part_afd}[part]()
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
