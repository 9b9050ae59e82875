"""The planner benchmark's time-varying part (run through benchmarks/planner.py --parts timevarying).

Demand that moves over the half hour, in windows of constant demand, on a fleet that starts all
`both` on model A. Per case:
- oracle: the best layout of each window, planned for it alone, moves free (an upper bound);
- static best in hindsight: the best single layout held all along (each oracle window's layout,
  today's layout, and the plan for the whole period's mean demand);
- re-planned, moves paid: at each window from a forecast of it (perfect: the window's own demand;
  last_window: the window before, what a live planner measured; holt: Holt's linear trend over
  the windows so far), and every `sub_s` from the sub-interval before (last_subwindow: re-planning
  more often than the demand changes).
A move takes its server out of service for its drain (+ weights' reload: bytes / storage
bandwidth, `hetmesh.planner.plan.moves`); the goodput lost is the out-of-service share of the
fleet in that interval, as in the planner's own pricing. `bound` = oracle / static: what no
re-planning can exceed on that case.
"""

from __future__ import annotations

import sys
import time
import zlib
from collections.abc import Sequence
from typing import Any

import msgspec

from hetmesh.planner import Assignment, ModelDemand, ServerGroup, demand_trace, evaluate, plan
from hetmesh.planner.forecast import forecast_demand
from hetmesh.planner.plan import Plan, current_layout, score

CASES = ("model-shift", "model-step", "model-swap", "pd-shift")
# Simulated requests per window (its first arrivals); 0: the whole window. A sample much shorter than a
# request's life (TTFT + output x TPOT, ~28 s here) overstates an overloaded layout: its batches hold the
# sample's arrivals at once and drain them after the last, so a static split that starves a phase looks
# ~1.5x better than it runs (docs/planner.md, "How long a window must be simulated")
WINDOW_REQUESTS = 0


def shift_case(case: str, windows: int, load: float = 1.0) -> tuple[list[ServerGroup], list[list[ModelDemand]]]:
    """Per-window demand of a time-varying case, and the fleet it runs on (today's layout: all `both`);
    `load` multiplies every rate."""
    out = []
    for i in range(windows):
        x = i / max(windows - 1, 1)
        if case in ("model-shift", "model-step"):
            # model-shift: a linear ramp from model A to model B, the fleet ~busy; model-step: all of A's
            # traffic, then all of B's (a regional day/night swap), each keeping a 5% trickle
            a = max(36.0 * (1 - x), 1.8) if case == "model-shift" else (36.0 if i < windows / 2 else 1.8)
            b = max(80.0 * x, 4.0) if case == "model-shift" else (4.0 if i < windows / 2 else 80.0)
            out.append([ModelDemand(name="A", spec="llama-3.1-70b", rate=a * load, input_mean=2048, output_mean=256),
                        ModelDemand(name="B", spec="qwen3-32b", rate=b * load, input_mean=1024, output_mean=256)])
        elif case == "model-swap":  # the step between two models of one size: each phase needs the fleet alike
            a, b = (36.0, 1.8) if i < windows / 2 else (1.8, 36.0)
            out.append([ModelDemand(name="A", spec="llama-3.1-70b", rate=a * load, input_mean=2048, output_mean=256),
                        ModelDemand(name="B", spec="llama-2-70b", rate=b * load, input_mean=2048, output_mean=256)])
        else:  # the prefill:decode mix alternates between code-heavy and chat-heavy phases
            code = i % 2 == 0
            out.append([ModelDemand(name="A", spec="llama-3.1-70b", rate=(6.0 if code else 10.0) * load,
                                    input_mean=8192 if code else 512, output_mean=64 if code else 512)])
    if case == "pd-shift":  # the NVL144 CPX rack's 2:1
        groups = [ServerGroup(name="cpx", accelerator="nvidia-rubin-cpx", count=6, model="A", max_batch=128),
                  ServerGroup(name="vr200", accelerator="nvidia-rubin-vr200", count=3, model="A", max_batch=128)]
    else:
        groups = [ServerGroup(name="h200", accelerator="nvidia-h200", count=8, model="A", max_batch=128)]
    return groups, out


def regroup(groups: Sequence[ServerGroup], lay: Sequence[Assignment]) -> list[ServerGroup]:
    """The fleet as the plan left it: one group per server (its current model, role and layout),
    named so that a server keeps its name from one window to the next."""
    base = {g.name: g for g in groups}

    def name(a: Assignment) -> str:
        stem = a.server.removesuffix("-0")
        return stem if stem == a.group else a.server

    return [ServerGroup(name=name(a), accelerator=a.accelerator, devices=a.devices, count=1, model=a.model,
                        role=a.role, parallel=a.parallel, max_batch=base[a.group].max_batch,
                        step_tokens=base[a.group].step_tokens) for a in lay]


def _sig(lay: Sequence[Assignment]) -> tuple:
    return tuple(sorted((a.accelerator, a.devices, a.model, str(a.role), a.parallel) for a in lay))


class _Case:
    """One case's windows, with every simulation and plan memoised (layouts recur across bases)."""

    def __init__(self, case: str, windows: int, window_s: float, load: float = 1.0,
                 window_requests: int = WINDOW_REQUESTS) -> None:
        self.groups, self.demand = shift_case(case, windows, load)
        self.windows, self.window_s = windows, window_s
        self.n = sum(g.count for g in self.groups)
        self.cap = window_requests or None  # demand_trace's None: the whole window
        self.traces = [demand_trace(d, window_s, seed=i, max_requests=self.cap) for i, d in enumerate(self.demand)]
        self.scores: dict[tuple[tuple, int], float] = {}
        self.plans: dict[tuple, Plan] = {}
        self.plans_made = 0

    def good(self, lay: Sequence[Assignment], i: int, groups: Sequence[ServerGroup] | None = None) -> float:
        """Simulated priority-weighted goodput (tok/s) of `lay` held through window i."""
        key = (_sig(lay), i)
        if key not in self.scores:
            sm = evaluate(list(lay), self.demand[i], groups or self.groups, self.traces[i])
            self.scores[key] = score(sm, self.demand[i]) if sm else 0.0
        return self.scores[key]

    def plan(self, cur: Sequence[ServerGroup], basis: Sequence[ModelDemand], horizon_s: float,
             check: int | None = None) -> Plan:
        """The plan from `cur` for `basis`, checked on window `check`'s trace, or else on a synthetic
        trace of `basis` (its seed from the basis: the same question gets the same answer)."""
        blob = msgspec.json.encode(list(basis))
        now = tuple((a.server, a.accelerator, a.model, str(a.role), a.parallel) for a in current_layout(cur))
        key = (now, blob, horizon_s, check)
        if key not in self.plans:
            tr = self.traces[check] if check is not None else demand_trace(
                basis, self.window_s, seed=100 + zlib.crc32(blob) % 1000, max_requests=self.cap)
            p = self.plans[key] = plan(cur, basis, trace=tr, horizon_s=horizon_s)
            self.plans_made += 1
            if check is not None:  # the plan simulated its layout on that window already
                self.scores.setdefault((_sig(p.assignments), check), score(p.predicted, self.demand[check]))
        return self.plans[key]

    def replan(self, basis_at: Any, sub_s: float) -> float:
        """Goodput summed over windows (tok/s x window), re-planning every `sub_s` seconds from
        `basis_at(i, k)` (window i, sub-interval k), moves paid. Out-of-service time beyond an
        interval's server-seconds carries into the next."""
        per = max(round(self.window_s / sub_s), 1)
        cur, tok, debt = list(self.groups), 0.0, 0.0
        for i in range(self.windows):
            for k in range(per):
                p = self.plan(cur, basis_at(i, k), self.window_s)
                out_s = debt + sum(m.seconds for m in p.moves)
                span = sub_s * self.n
                debt = max(out_s - span, 0.0)
                tok += self.good(p.assignments, i, cur) * (1 - min(out_s / span, 1.0)) / per
                cur = regroup(cur, p.assignments)
        return tok


def run_case(case: str, windows: int, window_s: float, sub_s: float, load: float = 1.0,
             window_requests: int = WINDOW_REQUESTS) -> dict[str, Any]:
    c = _Case(case, windows, window_s, load, window_requests)
    d = c.demand
    oracle = [c.plan(c.groups, d[i], float("inf"), check=i) for i in range(windows)]
    oracle_tok = sum(c.good(p.assignments, i) for i, p in enumerate(oracle))
    mean = [msgspec.structs.replace(m, rate=sum(w[j].rate for w in d) / windows, peak_rate=0.0)
            for j, m in enumerate(d[0])]
    hindsight = c.plan(c.groups, mean, float("inf"))
    statics = {**{f"oracle-{i}": p.assignments for i, p in enumerate(oracle)}, "today": current_layout(c.groups),
               "mean-demand": hindsight.assignments}
    static_tok = {k: sum(c.good(lay, i) for i in range(windows)) for k, lay in statics.items()}
    static_name = max(static_tok, key=lambda k: static_tok[k])
    per = max(round(window_s / sub_s), 1)
    bases = {
        "forecast": lambda i, k: d[i],
        "last_window": lambda i, k: d[max(i - 1, 0)],
        "holt": lambda i, k: forecast_demand(d[:i], "holt") if i > 1 else d[max(i - 1, 0)],
        "last_subwindow": lambda i, k: d[i] if k > 0 else d[max(i - 1, 0)],
    }
    got = {name: c.replan(fn, sub_s if name == "last_subwindow" else window_s) for name, fn in bases.items()}
    best = static_tok[static_name]
    return {"windows": windows, "window_s": window_s, "sub_s": sub_s, "load": load, "replans_per_window_sub": per,
            "window_requests": window_requests, "simulated_requests": [len(t.requests) for t in c.traces],
            "static_best": static_name, "static_best_tok": best, "oracle_tok": oracle_tok,
            "bound_oracle_vs_static": oracle_tok / best,
            **{f"replanned_{k}_tok": v for k, v in got.items()},
            **{f"gain_vs_static_{k}": v / best for k, v in got.items()},
            **{f"vs_oracle_{k}": v / oracle_tok for k, v in got.items()},
            "meets": {k: v / best >= 1.3 and v / oracle_tok >= 0.9 for k, v in got.items()},
            "plans_made": c.plans_made, "simulations": len(c.scores)}


def part_timevarying(windows: int = 6, window_s: float = 300.0, sub_s: float = 60.0,
                     cases: Sequence[str] = CASES, window_requests: int = WINDOW_REQUESTS) -> dict[str, Any]:
    if unknown := [c for c in cases if c not in CASES]:
        raise ValueError(f"unknown time-varying case(s) {', '.join(unknown)}: choose from {', '.join(CASES)}")
    out = {}
    for case in cases:
        t0 = time.perf_counter()
        out[case] = run_case(case, windows, window_s, sub_s, window_requests=window_requests)
        print(f"  timevarying: {case} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return out


LOADS = (0.5, 1.0, 1.5, 2.0)


def part_timevarying_load(windows: int = 6, window_s: float = 300.0, sub_s: float = 60.0,
                          cases: Sequence[str] = ("model-step", "model-shift", "model-swap"),
                          loads: Sequence[float] = LOADS, window_requests: int = WINDOW_REQUESTS) -> dict[str, Any]:
    """The model cases with every rate times `load`: where the fleet has room, a static split of the
    servers between the models serves both phases and re-planning has little to win; once each phase
    needs most of the fleet, only moving servers to the model in demand serves it."""
    out: dict[str, Any] = {}
    for case in cases:
        rows = []
        for x in loads:
            t0 = time.perf_counter()
            r = run_case(case, windows, window_s, sub_s, x, window_requests)
            rows.append({k: v for k, v in r.items() if not k.startswith("replanned_")})
            print(f"  timevarying_load: {case} x{x:g} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        out[case] = rows
    return out


__all__ = ["CASES", "LOADS", "part_timevarying", "part_timevarying_load", "regroup", "shift_case"]
