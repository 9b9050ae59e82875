"""Live re-planning on the sim engine: the planner benchmark's time-varying cases replayed through the
real gateway, scheduler, planner and sim-engine workers (time-scaled), against the best static layout.

Per case (benchmarks/planner_timevarying.py `shift_case`, scaled down to fit this machine):
- the fleet becomes `--workers` one-device servers (the groups' proportions kept; a model whose weights
  fit no single device runs as a smaller one, SPEC_ON_ONE_DEVICE), and each window's rate per model is
  scaled by the small fleet's capacity over the original's (hetmesh.planner.capacity, all `both`): every
  window loads the small fleet as much as the original one;
- the trace: `--windows` windows of `--window-s` engine seconds, each a synthetic trace of that window's
  demand (hetmesh.planner.demand_trace), replayed open-loop at `--time-scale` (engine seconds per wall
  second), every prompt distinct, `ignore_eos`;
- static: the best single layout in hindsight, chosen by the simulator (each window's own plan, today's
  layout, the plan for the mean demand), run with the planner off;
- planner: the same starting layout with `[planner] mode = "act"` (scope "fleet" where the case moves
  demand between models: model switches; a case that needs them is "not run" where they are not there).

Live goodput: output tokens of the requests that met the SLOs (TTFT and mean TPOT, measured by the
client, in engine seconds) and whose streamed text is the sim engine's deterministic text, per engine
second of the trace. The simulator's figures for the same trace: the static layout per window, and the
layouts the live planner actually moved through (split at each switch), with the planner's switch-cost
accounting (a move takes its server out for its priced seconds: drain, + reload; the share of the
window's server-seconds lost comes off that window's goodput). Also the offline planner's own
re-planning of the same windows (from the last window's demand, as benchmarks/planner.py).
Target: live gain (planner / static) within 10% of the simulator's.

    .venv/bin/python benchmarks/live_replanning.py [--cases pd-shift,model-step] [--time-scale 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from hetmesh import config, protocol
from hetmesh.costmodel import server_model
from hetmesh.planner import Assignment, ModelDemand, ServerGroup, demand_trace, evaluate, plan
from hetmesh.planner.capacity import capacity
from hetmesh.planner.plan import current_layout, moves
from hetmesh.planner.plan import good_tokens as weighted_good_tokens
from hetmesh.protocol import Role
from hetmesh.sim.report import write_json
from hetmesh.sim.traces import Trace, TraceRequest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_replanning_mesh import expected, run_arms
from planner_timevarying import CASES, regroup, shift_case

ROOT = Path(__file__).resolve().parents[1]
# 70B weights (140 GB in bf16) fit no one device of these fleets; the 8B runs the same case on one.
SPEC_ON_ONE_DEVICE = {"llama-3.1-70b": "llama-3.1-8b"}
console = Console(width=150)


def model_switch_available() -> bool:
    """Workers take ModelSwitch commands and the planner plans across models (planner.scope = fleet)."""
    return hasattr(protocol, "ModelSwitch") and "scope" in config.PlannerConfig.__struct_fields__


# --- the case, scaled down -----------------------------------------------------------------------
@dataclass
class Case:
    name: str
    groups: list[ServerGroup]
    demand: list[list[ModelDemand]]  # per window
    window_s: float
    trace: list[TraceRequest]  # every window's requests, arrivals in engine seconds from the start
    rate_scale: list[dict[str, float]] = field(default_factory=list)  # per window: small fleet's rate / original's

    @property
    def models(self) -> list[str]:
        return [d.name for d in self.demand[0]]

    def window(self, i: int, t0: float | None = None, t1: float | None = None) -> Trace:
        lo = i * self.window_s if t0 is None else t0
        hi = (i + 1) * self.window_s if t1 is None else t1
        return Trace([r for r in self.trace if lo <= r.arrival < hi], name=f"{self.name}-{i}")


def fleet_capacity(groups: list[ServerGroup], d: ModelDemand) -> float:
    """Requests/s the fleet sustains on `d` with every server `both` (the planner's closed form)."""
    return sum(g.count * capacity(server_model(g.accelerator, d.spec, devices=g.devices, parallel=g.parallel),
                                  d, Role.BOTH, g.max_batch, g.step_tokens) for g in groups)


def scaled_case(name: str, windows: int, window_s: float, workers: int, load: float = 1.0) -> Case:
    groups, demand = shift_case(name, windows)
    n = sum(g.count for g in groups)
    small = [msgspec.structs.replace(g, devices=1, count=max(1, round(g.count * workers / n))) for g in groups]
    out, scale = [], []
    for ds in demand:
        row, ks = [], {}
        for d in ds:
            d1 = msgspec.structs.replace(d, spec=SPEC_ON_ONE_DEVICE.get(d.spec, d.spec))
            ks[d.name] = load * fleet_capacity(small, d1) / fleet_capacity(groups, d)
            row.append(d1.scaled(ks[d.name]))
        out.append(row)
        scale.append(ks)
    trace: list[TraceRequest] = []
    for i, ds in enumerate(out):
        tr = demand_trace(ds, window_s, seed=i, max_requests=None)
        trace += [TraceRequest(r.arrival + i * window_s, r.input_len, r.output_len, r.hash_ids, r.model)
                  for r in tr.requests if r.arrival < window_s]
    return Case(name, small, out, window_s, sorted(trace, key=lambda r: r.arrival), scale)


# --- the simulator's figures ---------------------------------------------------------------------
def good_tokens(lay: list[Assignment], c: Case, i: int, tr: Trace) -> float:
    """Simulated SLO-meeting output tokens (priority-weighted) of `tr`'s requests on `lay`."""
    if not tr.requests:
        return 0.0
    sm = evaluate(lay, c.demand[i], c.groups, tr)
    return weighted_good_tokens(sm, c.demand[i]) if sm else 0.0


def best_static(c: Case) -> tuple[str, list[Assignment], list[float]]:
    """The best single layout in hindsight (each window's own plan, today's layout, the mean-demand plan)
    that serves every model."""
    cands = {f"window-{i}": plan(c.groups, c.demand[i], trace=c.window(i), horizon_s=float("inf")).assignments
             for i in range(len(c.demand))}
    mean = [msgspec.structs.replace(m, rate=sum(w[j].rate for w in c.demand) / len(c.demand), peak_rate=0.0)
            for j, m in enumerate(c.demand[0])]
    cands["mean-demand"] = plan(c.groups, mean, check_duration_s=c.window_s, horizon_s=float("inf")).assignments
    cands["today"] = current_layout(c.groups)
    seen: dict[tuple, list[float]] = {}
    per: dict[str, list[float]] = {}
    for k, lay in cands.items():
        sig = tuple(sorted((a.server, a.model, str(a.role)) for a in lay))
        if sig not in seen:
            seen[sig] = [good_tokens(lay, c, i, c.window(i)) for i in range(len(c.demand))]
        per[k] = seen[sig]
    # Only layouts that keep a worker on every model, as the planner keeps them (hetmesh.planner.solve): a
    # model with no live worker is refused at the gateway's door (503 no_workers).
    pool = [k for k, lay in cands.items() if {a.model for a in lay} >= set(c.models)] or list(cands)
    name = max(pool, key=lambda k: sum(per[k]))
    return name, cands[name], per[name]


def priced(c: Case, before: list[Assignment], after: list[Assignment], i: int, storage: float) -> float:
    """The planner's price of going from `before` to `after` (server-seconds out of service)."""
    named = [a if a.server == f"{a.group}-0" else msgspec.structs.replace(a, server=f"{a.server}-0") for a in after]
    return sum(m.seconds for m in moves(regroup(c.groups, before), named, c.demand[i], storage))  # regroup's names


def with_debt(c: Case, tokens: list[float], out_s: list[float]) -> float:
    """Windows' good tokens less the share of their server-seconds moves took out (what does not fit in a
    window carries into the next): benchmarks/planner_timevarying.py's accounting."""
    n, debt, tot = sum(g.count for g in c.groups), 0.0, 0.0
    for tok, o in zip(tokens, out_s, strict=True):
        o += debt
        debt = max(o - c.window_s * n, 0.0)
        tot += tok * (1 - min(o / (c.window_s * n), 1.0))
    return tot


def sim_of_layouts(c: Case, start: list[Assignment], changes: list[tuple[float, str, str, Role]],
                   storage: float) -> dict[str, Any]:
    """The trace on the layouts the live planner moved through: `changes` = (engine s, server, model, role)
    as each switch completed; every window split at them, each piece simulated on the layout then in force."""
    lay, tokens, out_s = list(start), [], []
    pending = sorted(changes)
    for i in range(len(c.demand)):
        t, hi = i * c.window_s, (i + 1) * c.window_s
        tok = out = 0.0
        while True:
            nxt = pending[0][0] if pending and pending[0][0] < hi else hi
            tok += good_tokens(lay, c, i, c.window(i, t, nxt))
            if nxt >= hi:
                break
            _, server, model, role = pending.pop(0)
            new = [msgspec.structs.replace(a, model=model, role=role) if a.server == server else a for a in lay]
            out += priced(c, lay, new, i, storage)
            lay, t = new, nxt
        tokens.append(tok)
        out_s.append(out)
    return {"good_tokens": with_debt(c, tokens, out_s), "per_window": tokens, "switch_out_s": out_s}


def sim_replanned(c: Case, start: list[Assignment], storage: float) -> dict[str, Any]:
    """The offline planner's own re-planning of the windows: window i planned from window i-1's demand."""
    lay, tokens, out_s, moved = list(start), [], [], 0
    for i in range(len(c.demand)):
        cur = regroup(c.groups, lay)
        basis = c.demand[max(i - 1, 0)]
        p = plan(cur, basis, trace=c.window(max(i - 1, 0)), horizon_s=c.window_s, storage_bytes_per_s=storage)
        new = [msgspec.structs.replace(a, group=b.group, server=b.server)
               for a, b in zip(sorted(p.assignments, key=lambda a: a.server), sorted(lay, key=lambda a: a.server),
                               strict=True)]
        out_s.append(sum(m.seconds for m in p.moves))
        moved += len(p.moves)
        tokens.append(good_tokens(new, c, i, c.window(i)))
        lay = new
    return {"good_tokens": with_debt(c, tokens, out_s), "per_window": tokens, "moves": moved}


# --- one case, and the table ---------------------------------------------------------------------
def run_case(name: str, a: argparse.Namespace) -> dict[str, Any]:
    c = scaled_case(name, a.windows, a.window_s, a.workers, a.load)
    dur = len(c.demand) * c.window_s
    info: dict[str, Any] = {
        "fleet": [(g.name, g.accelerator, g.count) for g in c.groups], "models": c.models,
        "rate_scale": c.rate_scale, "windows": len(c.demand), "window_s": c.window_s, "requests": len(c.trace),
        "demand": [[(d.name, d.spec, round(d.rate, 2), d.input_mean, d.output_mean) for d in ds] for ds in c.demand]}
    if len(c.models) > 1 and not model_switch_available():
        return info | {"not_run": "model switch not available"}
    storage = config.WorkerConfig().storage_bytes_per_s  # the workers' reload speed, as the planner prices it
    t0 = time.process_time()
    static_name, lay, static_per = best_static(c)
    info |= {"static_layout": static_name, "layout": {s.server: f"{s.model}/{s.role.value}" for s in lay},
             "sim_static_good_tokens": sum(static_per), "sim_static_per_window": static_per}
    console.print(f"{name}: {len(c.trace)} requests over {dur:g} engine s; best static layout {static_name} "
                  f"{info['layout']} (sim {sum(static_per) / dur:.1f} tok/s)")
    live_static, live_plan = run_arms(c, lay, a)
    console.print(f"  live static: {live_static['goodput_tok_s']:.1f} tok/s, {live_static['errors']} errors, "
                  f"{live_static['wrong_text']} wrong texts, {live_static['refused']} refused")
    console.print(f"  live planner: {live_plan['goodput_tok_s']:.1f} tok/s, {live_plan['moves']} moves, "
                  f"{live_plan['errors']} errors, {live_plan['wrong_text']} wrong texts, {live_plan['refused']} refused")
    changes = [(t, s, m, Role(r)) for t, s, m, r in live_plan["changes"]]
    same = sim_of_layouts(c, lay, changes, storage)
    offline = sim_replanned(c, lay, storage)
    st = sum(static_per)
    live_gain = live_plan["good_tokens"] / max(live_static["good_tokens"], 1e-9)
    sim_gain = same["good_tokens"] / max(st, 1e-9)
    info |= {"live_static": live_static, "live_planner": live_plan, "sim_same_layouts": same,
             "sim_offline_replanned": offline, "sim_cpu_s": round(time.process_time() - t0, 1),
             "live_gain": live_gain, "sim_gain": sim_gain, "live_over_sim_gain": live_gain / sim_gain,
             "sim_offline_gain": offline["good_tokens"] / max(st, 1e-9),
             "live_over_sim_static": live_static["good_tokens"] / max(st, 1e-9),
             "within_10pct": abs(live_gain / sim_gain - 1) <= 0.10,
             "clean": live_static["errors"] + live_plan["errors"] + live_static["wrong_text"]
             + live_plan["wrong_text"] == 0}
    return info


def table(res: dict[str, Any], a: argparse.Namespace) -> Table:
    t = Table(title=f"live re-planning (sim engines, time scale {a.time_scale:g}; goodput in SLO-meeting "
                    f"output tok per engine s)")
    for col in ("case", "static layout", "live static", "sim static", "live planner", "moves", "sim same layouts",
                "live gain", "sim gain", "live/sim gain", "offline re-plan gain", "errors / wrong / refused"):
        t.add_column(col, justify="right")
    for name, r in res.items():
        if "not_run" in r:
            t.add_row(name, f"not run: {r['not_run']}", *[""] * 10)
            continue
        dur = r["windows"] * r["window_s"]
        ls, lp = r["live_static"], r["live_planner"]
        t.add_row(name, ", ".join(f"{k}={v}" for k, v in r["layout"].items()), f"{ls['goodput_tok_s']:.1f}",
                  f"{r['sim_static_good_tokens'] / dur:.1f}", f"{lp['goodput_tok_s']:.1f}", str(lp["moves"]),
                  f"{r['sim_same_layouts']['good_tokens'] / dur:.1f}", f"{r['live_gain']:.3f}",
                  f"{r['sim_gain']:.3f}", f"{r['live_over_sim_gain']:.3f}", f"{r['sim_offline_gain']:.3f}",
                  f"{ls['errors'] + lp['errors']} / {ls['wrong_text'] + lp['wrong_text']} / "
                  f"{ls['refused']} + {lp['refused']}")
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window-s", type=float, default=100.0, help="engine seconds per window of constant demand")
    ap.add_argument("--workers", type=int, default=3, help="one-device sim workers the fleet is scaled to")
    # 1: as busy as the original fleet. The live mesh's own CPU (gateway, client, ~12 processes a mesh, two
    # meshes side by side) shares 2 cores with other work here: at 1 its queues ran away (TTFT tens of s).
    ap.add_argument("--load", type=float, default=0.5, help="the scaled rates times this")
    ap.add_argument("--time-scale", type=float, default=1.0, help="engine seconds per wall second")
    ap.add_argument("--heartbeat-s", type=float, default=0.1, help="heartbeat interval, wall seconds")
    # a plan simulates its candidates (seconds of CPU each round): rounds further apart leave the workers the CPU
    ap.add_argument("--interval-s", type=float, default=10.0, help="planner round and demand report, wall seconds")
    ap.add_argument("--demand-window-s", type=float, default=0.0,
                    help="the scheduler's demand window, wall seconds (0: two planner rounds)")
    ap.add_argument("--max-moving-share", type=float, default=0.67)
    ap.add_argument("--out", default=str(ROOT / "results" / "live_replanning.json"))
    a = ap.parse_args()
    a.demand_window_s = a.demand_window_s or 2 * a.interval_s
    res = {}
    for name in a.cases.split(","):
        res[name] = run_case(name, a)
        expected.cache_clear()
    console.print(table(res, a))
    # cases not run keep their last results in the file (each with the config it ran under)
    kept = json.loads(Path(a.out).read_text()).get("cases", {}) if Path(a.out).exists() else {}
    for r in res.values():
        r["config"] = {k: v for k, v in vars(a).items() if k not in ("cases", "out")}
    write_json(a.out, {"cases": kept | res, "config": vars(a), "model_switch_available": model_switch_available(),
                       "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                   "python": platform.python_version(),
                                   "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
                       "ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    console.print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
