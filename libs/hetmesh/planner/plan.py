"""The planner: fleet + models + demand + prices in, a layout out, checked by simulation.

`plan()` builds every (server group, model, parallel layout, role) option the cost model can run
within the model's SLOs, asks the integer program (hetmesh.planner.solve) for the best layouts
under a few structural choices (free, all aggregated, all P/D) plus the current layout, simulates
each with the cost policy the scheduler runs (hetmesh.sim) on the demand, and returns the one with
the most priority-weighted SLO goodput, with the moves from today's layout and what they cost.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from hetmesh.costmodel import Efficiency, server_model
from hetmesh.costmodel.economics import device_usd_per_hour, usd_per_mtok
from hetmesh.costmodel.model import PARALLEL
from hetmesh.planner.capacity import capacity
from hetmesh.planner.inputs import ModelDemand, ServerGroup
from hetmesh.planner.solve import Option, Solution, solve
from hetmesh.protocol import Role
from hetmesh.sim import SimConfig, Slo, WorkerSpec, simulate
from hetmesh.sim.traces import Trace, TraceRequest, synthetic

STORAGE_BYTES_PER_S = 5e9  # assumed weight-load bandwidth of one server (NVMe RAID or a fast network store)
# Capacities this close are within the steady-state model's error (it has no queues, no interference):
# the solver breaks such ties arbitrarily, or toward what a server runs now; the simulation decides them
LAYOUT_TIE = 0.05
# A check sample shorter than a few request lives (TTFT + output x TPOT, at the SLOs) fits in a layout's
# batches at once and drains after its last arrival: it shows neither the queue nor the refusals of an
# overloaded layout, and overstates its goodput (docs/planner.md). The check keeps at least this many lives.
MIN_LIVES = 4.0
# The candidate layouts `plan` simulates besides its variants, and how each is found
CANDIDATES = {"flexible": "the solver's best (a both server may also prefill or decode for others)",
              "static-roles": "the solver's best with fixed roles (a both server serves requests whole)",
              "aggregated": "the solver's best with every request served whole on one server",
              "current": "the layout the fleet runs now"}


class Assignment(msgspec.Struct, frozen=True):
    server: str
    group: str
    accelerator: str
    devices: int
    model: str  # "" idle
    role: Role
    parallel: str


class Move(msgspec.Struct, frozen=True):
    server: str
    change: str  # role (drain, no reload) | reload (model or layout: drain, then load weights) | stop
    before: str
    after: str
    seconds: float  # the server is out of service this long


class CandidateResult(msgspec.Struct, frozen=True):
    name: str
    score: float  # priority-weighted SLO goodput, output tokens/s, simulated, less what its moves cost
    goodput_tok_s: float  # SLO-meeting output tokens per second of the offered arrivals (`evaluate`)
    slo_attainment: float
    usd_per_hour: float
    what: str = ""  # how the layout was found, for people
    refused: int = 0  # requests offered and not served (admission, or no server for their model)
    offered: int = 0


class Plan(msgspec.Struct, frozen=True):
    assignments: list[Assignment]
    moves: list[Move]
    chosen: str  # which candidate
    predicted: dict[str, Any]  # the chosen candidate's simulated summary (goodput, attainment, $/h, $/Mtok, pools)
    candidates: list[CandidateResult]
    served: dict[str, float]  # the solver's req/s per model (before simulation)
    headroom: float

    def layout(self) -> dict[tuple[str, str, Role, str], int]:
        """(group, model, role, parallel) -> servers."""
        out: dict[tuple[str, str, Role, str], int] = {}
        for a in self.assignments:
            if a.model:
                k = (a.group, a.model, a.role, a.parallel)
                out[k] = out.get(k, 0) + 1
        return out


def options(groups: Sequence[ServerGroup], demands: Sequence[ModelDemand],
            prices: Mapping[str, float] | None = None,
            efficiencies: Mapping[str, Efficiency] | None = None) -> list[Option]:
    """Every (group, model, layout, role) a server can run within the model's SLOs, with its capacity."""
    out: list[Option] = []
    for gi, g in enumerate(groups):
        usd = device_usd_per_hour(g.accelerator, prices) * g.devices
        for d in demands:
            seen: set[str] = set()
            for par in (p for p in PARALLEL if p in g.layouts):
                cm = server_model(g.accelerator, d.spec, devices=g.devices, parallel=par, dtype=d.dtype,
                                  efficiencies=efficiencies)
                if cm.parallel in seen:  # ep on a dense model is tp
                    continue
                seen.add(cm.parallel)
                caps = {role: capacity(cm, d, role, g.max_batch, g.step_tokens)
                        for role in (Role.BOTH, Role.PREFILL, Role.DECODE)}
                if any(caps.values()):
                    out.append(Option(gi, d.name, Role.BOTH, cm.parallel, caps[Role.BOTH], usd,
                                      prefill=caps[Role.PREFILL], decode=caps[Role.DECODE]))
                out += [Option(gi, d.name, role, cm.parallel, caps[role], usd)
                        for role in (Role.PREFILL, Role.DECODE) if caps[role] > 0]
    return out


def demand_trace(demands: Sequence[ModelDemand], duration_s: float, seed: int = 0,
                 max_requests: int | None = 4000) -> Trace:
    """A synthetic open-loop trace with each model's rate and mean lengths (lognormal), merged; a model
    with no demand (rate 0, e.g. a forecast that its traffic is gone) has no requests in it. At most
    `max_requests` in all (its first arrivals, shared by rate), unless that spans fewer than MIN_LIVES
    request lives; None: all of `duration_s`."""
    reqs: list[TraceRequest] = []
    total = sum(d.rate for d in demands)
    live = [d for d in demands if d.rate > 0]
    floor_s = min(duration_s, MIN_LIVES * max((d.ttft_slo_s + d.output_mean * d.tpot_slo_s for d in live),
                                              default=0.0))
    for i, d in enumerate(demands):
        if d.rate <= 0:
            continue
        whole = d.rate * duration_s
        n = max(1, int(whole if max_requests is None else
                       min(whole, max(max_requests * d.rate / total, d.rate * floor_s))))
        t = synthetic(n, d.rate, input_mean=int(d.input_mean), output_mean=int(d.output_mean), seed=seed + i,
                      prefix_groups=8 if d.prefix_hit > 0 else 0,
                      prefix_tokens=int(d.input_mean * d.prefix_hit))
        reqs += [TraceRequest(r.arrival, r.input_len, r.output_len, r.hash_ids, d.name) for r in t.requests]
    reqs.sort(key=lambda r: r.arrival)
    return Trace(reqs, name="demand")


def _servers(groups: Sequence[ServerGroup], opts: Sequence[Option], counts: Mapping[int, int]) -> list[Assignment]:
    """Concrete servers for option counts: servers keep what they run where the plan still runs it."""
    out: list[Assignment] = []
    for gi, g in enumerate(groups):
        mine = sorted(((j, n) for j, n in counts.items() if opts[j].group == gi),
                      key=lambda jn: (opts[jn[0]].model, opts[jn[0]].role, opts[jn[0]].parallel) !=
                      (g.model, g.role, g.parallel))  # the current option first: its servers stay
        ids = iter(g.server_ids())
        for j, n in mine:
            o = opts[j]
            out += [Assignment(next(ids), g.name, g.accelerator, g.devices, o.model, o.role, o.parallel)
                    for _ in range(n)]
        out += [Assignment(s, g.name, g.accelerator, g.devices, "", Role.BOTH, g.parallel) for s in ids]
    return out


def _signature(lay: Sequence[Assignment]) -> tuple:
    return tuple(sorted((a.group, a.model, str(a.role), a.parallel) for a in lay))


def current_layout(groups: Sequence[ServerGroup]) -> list[Assignment]:
    return [Assignment(s, g.name, g.accelerator, g.devices, g.model, g.role, g.parallel)
            for g in groups for s in g.server_ids()]


def moves(groups: Sequence[ServerGroup], new: Sequence[Assignment], demands: Sequence[ModelDemand],
          storage_bytes_per_s: float = STORAGE_BYTES_PER_S) -> list[Move]:
    """What changes per server and how long it is out: a role switch drains (the longest request in
    flight: TTFT SLO + output x TPOT SLO of its model); a model or layout change drains and reloads
    the weights (their bytes / the storage bandwidth)."""
    dem = {d.name: d for d in demands}
    old = {a.server: a for a in current_layout(groups)}
    out: list[Move] = []
    for a in new:
        b = old[a.server]
        if (a.model, a.role, a.parallel) == (b.model, b.role, b.parallel) or (not a.model and not b.model):
            continue
        drain = 0.0
        if b.model in dem:
            d = dem[b.model]
            drain = d.ttft_slo_s + d.output_mean * d.tpot_slo_s
        before = f"{b.model}/{b.role}/{b.parallel}" if b.model else "idle"
        after = f"{a.model}/{a.role}/{a.parallel}" if a.model else "idle"
        if not a.model:
            out.append(Move(a.server, "stop", before, after, drain))
        elif a.model == b.model and a.parallel == b.parallel:
            out.append(Move(a.server, "role", before, after, drain))
        else:
            d = dem[a.model]
            w = server_model(a.accelerator, d.spec, devices=a.devices, parallel=a.parallel, dtype=d.dtype)
            out.append(Move(a.server, "reload", before, after, drain + w.weights_bytes() / storage_bytes_per_s))
    return out


def workers_for(layout: Sequence[Assignment], demands: Sequence[ModelDemand],
                groups: Sequence[ServerGroup]) -> list[WorkerSpec]:
    dem = {d.name: d for d in demands}
    gs = {g.name: g for g in groups}
    return [WorkerSpec(worker_id=a.server, pool=f"{a.group}/{a.model}/{a.role}", model=a.model,
                       spec=dem[a.model].spec, accelerator=a.accelerator, devices=a.devices, role=a.role,
                       max_batch=gs[a.group].max_batch, parallel=a.parallel, dtype=dem[a.model].dtype,
                       step_tokens=gs[a.group].step_tokens)
            for a in layout if a.model]


def score(summary: Mapping[str, Any], demands: Sequence[ModelDemand]) -> float:
    """Priority-weighted SLO goodput of a summary, in its own unit: per second of the offered arrivals
    for one from `evaluate`, per simulated second for a simulator's own."""
    per = summary.get("models")
    if not per:
        return summary["goodput_tok_s"] * (demands[0].priority if len(demands) == 1 else 1.0)
    return sum(d.priority * per.get(d.name, {}).get("goodput_tok_s", 0.0) for d in demands)


def good_tokens(summary: Mapping[str, Any], demands: Sequence[ModelDemand]) -> float:
    """Priority-weighted SLO-meeting output tokens of a simulated summary."""
    return score(summary, demands) * summary.get("offered_span_s", summary["duration_s"])


def evaluate(layout: Sequence[Assignment], demands: Sequence[ModelDemand], groups: Sequence[ServerGroup],
             trace: Trace, prices: Mapping[str, float] | None = None,
             efficiencies: Mapping[str, Efficiency] | None = None) -> dict[str, Any] | None:
    """Simulate `layout` on `trace` with the cost policy (the scheduler's); None when it serves nothing."""
    workers = workers_for(layout, demands, groups)
    served = {w.model for w in workers}
    if not workers:
        return None
    tr = Trace([r for r in trace.requests if (r.model or demands[0].name) in served], trace.block_tokens, trace.name)
    if not tr.requests:
        return None
    slos = {d.name: Slo(d.ttft_slo_s, d.tpot_slo_s) for d in demands}
    summary, _ = simulate(workers, "cost", tr, SimConfig(efficiencies=efficiencies or {}),
                          slo=slos if len(served) > 1 else slos[next(iter(served))], prices=prices)
    # SLO attainment of every request offered: a refused one (the mesh's admission) is a miss, or a layout
    # too small would pass the check by refusing work; so is a request for a model nobody serves
    missed = len(trace.requests) - len(tr.requests)
    summary["unserved_requests"] = missed
    summary["offered_requests"] = len(trace.requests)
    summary["refused_requests"] = summary["rejected"] + missed
    arrivals = [r.arrival for r in trace.requests]
    span = max(arrivals) - min(arrivals)
    summary["offered_span_s"] = span if span > 0 else summary["duration_s"]
    # Goodput per second of the offered arrivals, not per simulated second: that includes the drain after
    # the last arrival, so a layout that refused work or finished sooner would show more for the same tokens
    per_span = summary["duration_s"] / summary["offered_span_s"]
    summary["goodput_tok_s"] *= per_span
    summary["usd_per_good_mtok"] = usd_per_mtok(summary["usd_per_hour"], summary["goodput_tok_s"])
    summary["slo_attainment"] = summary["offered_slo_attainment"] * len(tr.requests) / len(trace.requests)
    for per in summary.get("models", {}).values():
        per["goodput_tok_s"] *= per_span
        per["slo_attainment"] = per["offered_slo_attainment"]
    if len(served) == 1 and len(demands) > 1:
        summary["models"] = {next(iter(served)): {"goodput_tok_s": summary["goodput_tok_s"],
                                                  "slo_attainment": summary["offered_slo_attainment"]}}
    return summary


def _layout_variants(lay: Sequence[Assignment], groups: Sequence[ServerGroup],
                     opts: Sequence[Option]) -> list[tuple[list[Assignment], str]]:
    """`lay` with one pool (the servers of one kind running one model in one role) moved whole onto
    another parallel layout whose capacity is within LAYOUT_TIE of the best its servers run now. A kind
    is a server's hardware (accelerator, devices, batch limits), not its group: a fleet split into more
    groups has the same variants. Each comes with what it changed."""
    def kind(g: ServerGroup) -> tuple:
        return g.accelerator, g.devices, g.max_batch, g.step_tokens, g.layouts

    by_name = {g.name: kind(g) for g in groups}
    cap: dict[tuple, float] = {}
    for o in opts:
        cap[(kind(groups[o.group]), o.model, o.role, o.parallel)] = o.capacity
    pools: dict[tuple, set[str]] = {}
    for a in lay:
        if a.model:
            pools.setdefault((by_name[a.group], a.model, a.role), set()).add(a.parallel)
    out: list[tuple[list[Assignment], str]] = []
    for pool, used in pools.items():
        alts = {k[3]: c for k, c in cap.items() if k[:3] == pool}
        top = max(alts.get(p, 0.0) for p in used)
        for par, c in sorted(alts.items()):
            if c >= (1.0 - LAYOUT_TIE) * top and used != {par}:
                kind, model, role = pool
                out.append(([msgspec.structs.replace(a, parallel=par) if a.model and
                             (by_name[a.group], a.model, a.role) == pool else a for a in lay],
                            f"{model} {role} on {kind[0]} in {par}"))
    return out


def _neighbours(lay: list[Assignment], sm: dict[str, Any], best: float, demands: Sequence[ModelDemand],
                groups: Sequence[ServerGroup], opts: Sequence[Option], trace: Trace, budget: int,
                priced: Any, prices: Mapping[str, float] | None,
                efficiencies: Mapping[str, Efficiency] | None) -> list[tuple[list[Assignment], dict[str, Any], str]]:
    """Greedy local search: hand one server from the best-served model to the worst-served one while
    the simulated score improves; every layout tried is returned (with its summary and the move)."""
    tried: list[tuple[list[Assignment], dict[str, Any], str]] = []
    gi = {g.name: i for i, g in enumerate(groups)}
    while len(tried) < budget:
        per = sm.get("models", {})
        att = {d.name: per.get(d.name, {}).get("slo_attainment", 0.0) for d in demands}
        worst = min(att, key=lambda m: att[m])
        donors = sorted((m for m in att if m != worst and sum(a.model == m for a in lay) > 1), key=lambda m: -att[m])
        moved, what = None, ""
        for donor in donors:
            for a in reversed(lay):
                fit = [o for o in opts if o.group == gi[a.group] and o.model == worst and o.role == Role.BOTH]
                if a.model == donor and fit:
                    moved = [b if b.server != a.server else msgspec.structs.replace(
                        b, model=worst, role=Role.BOTH, parallel=fit[0].parallel) for b in lay]
                    what = f"{a.server} from {donor} to {worst}"
                    break
            if moved:
                break
        if moved is None:
            break
        new = evaluate(moved, demands, groups, trace, prices, efficiencies)
        if new is None:
            break
        tried.append((moved, new, what))
        got = priced("", moved, new).score
        if got <= best:
            break
        lay, sm, best = moved, new, got
    return tried


def plan(groups: Sequence[ServerGroup], demands: Sequence[ModelDemand], *, trace: Trace | None = None,
         prices: Mapping[str, float] | None = None, efficiencies: Mapping[str, Efficiency] | None = None,
         check_duration_s: float = 300.0, storage_bytes_per_s: float = STORAGE_BYTES_PER_S,
         horizon_s: float = 3600.0, refine: int = 4, seed: int = 0,
         progress: Callable[[str], None] | None = None) -> Plan:
    """The best layout of `groups` for `demands`, checked by simulating every candidate on `trace`
    (default: a synthetic trace of the demands, `check_duration_s` long). A candidate's moves cost
    it the goodput of the servers they take out of service, spread over `horizon_s` (how long the
    plan is expected to hold): a move must pay for itself within it. `refine`: at most this many
    more simulations of the best candidate with one pool on another parallel layout the cost model
    prices within LAYOUT_TIE, and as many of a local search from the best so far, moving one server at
    a time from the model that meets its SLOs best to the one that meets them worst (the steady-state
    capacities the solver sizes with miss bursts and interference; the simulation does not).
    `progress` is told what is being simulated (a what-if on an overloaded fleet can take minutes)."""
    if not demands:
        raise ValueError("no models to plan for")
    if not groups or not any(g.count for g in groups):
        raise ValueError("no servers to plan")
    opts = options(groups, demands, prices, efficiencies)
    if not opts:
        raise ValueError("no server can run any model within its SLOs: relax the SLOs or add faster chips")
    n_servers = sum(g.count for g in groups)
    tr = trace or demand_trace(demands, check_duration_s, seed)
    sols: dict[str, Solution] = {}
    for name, kw in (("flexible", {}), ("static-roles", {"flexible": False}),
                     ("aggregated", {"modes": frozenset({"aggregated"})})):
        s = solve(groups, demands, opts, **kw)  # type: ignore[arg-type]
        if s is not None and s.counts and all(s.counts != o.counts for o in sols.values()):
            sols[name] = s
    layouts: dict[str, list[Assignment]] = {k: _servers(groups, opts, s.counts) for k, s in sols.items()}
    if any(g.model for g in groups):
        layouts["current"] = current_layout(groups)
    def priced(name: str, lay: list[Assignment], sm: dict[str, Any], what: str = "") -> CandidateResult:
        """The simulated score less the goodput the layout's moves take out of service over the horizon."""
        out_s = sum(m.seconds for m in moves(groups, lay, demands, storage_bytes_per_s))
        return CandidateResult(name, score(sm, demands) * (1.0 - min(out_s / horizon_s / n_servers, 1.0)),
                               sm["goodput_tok_s"], sm["slo_attainment"], sm["usd_per_hour"],
                               what or CANDIDATES.get(name, ""), sm["refused_requests"], sm["offered_requests"])

    results: list[CandidateResult] = []
    summaries: dict[str, dict[str, Any]] = {}
    for name, lay in layouts.items():
        if progress:
            progress(f"simulating the {name} layout on {len(tr.requests):,} requests")
        sm = evaluate(lay, demands, groups, tr, prices, efficiencies)
        if sm is None:
            continue
        summaries[name] = sm
        results.append(priced(name, lay, sm))
    if not results:
        raise ValueError("no candidate layout serves any request")

    start = max(results, key=lambda r: r.score)
    if start.slo_attainment >= 1.0:  # every request served within its SLOs: nothing left for refining to win
        refine = 0
    if refine:  # ties the cost model cannot break, one pool at a time
        seen = {_signature(v) for v in layouts.values()}
        fresh = [v for v in _layout_variants(layouts[start.name], groups, opts) if _signature(v[0]) not in seen]
        for k, (lay, what) in enumerate(fresh[:refine]):
            if progress:
                progress(f"simulating layout variant {k + 1} of {min(len(fresh), refine)}")
            sm = evaluate(lay, demands, groups, tr, prices, efficiencies)
            if sm is not None:
                name = f"layout-{k + 1}"
                layouts[name], summaries[name] = lay, sm
                results.append(priced(name, lay, sm, f"{start.name} with {what}"))
    if refine and len(demands) > 1:
        start = max(results, key=lambda r: r.score)
        if progress:
            progress(f"local search from the {start.name} layout")
        for k, (lay, sm, what) in enumerate(_neighbours(layouts[start.name], summaries[start.name], start.score,
                                                        demands, groups, opts, tr, refine, priced, prices,
                                                        efficiencies)):
            name = f"refined-{k + 1}"
            layouts[name], summaries[name] = lay, sm
            results.append(priced(name, lay, sm, f"{start.name} with server {what}"))
    # the most weighted goodput; at a tie (within 1%) the current layout (no moves), then the cheaper
    top = max(r.score for r in results)
    best = min((r for r in results if r.score >= 0.99 * top),
               key=lambda r: (r.name != "current", r.usd_per_hour, -r.score))
    lay = layouts[best.name]
    sol = sols.get(best.name)
    pred = summaries[best.name]
    return Plan(assignments=lay, moves=moves(groups, lay, demands, storage_bytes_per_s), chosen=best.name,
                predicted=pred, candidates=results, served=sol.served if sol else {},
                headroom=sol.headroom if sol else 0.0)
