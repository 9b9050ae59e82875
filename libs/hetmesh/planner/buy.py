"""Capacity planning: the cheapest mix of servers that meets every model's SLOs for a demand, and
the Pareto front of $/hour against goodput. Same options and integer program as the fleet plan
(hetmesh.planner.plan), with the purchasable servers as groups (`count`: the most one may buy);
every answer is checked by simulation and re-solved with more headroom until it meets the SLOs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from hetmesh.costmodel import Efficiency
from hetmesh.costmodel.economics import device_usd_per_hour
from hetmesh.planner.inputs import ModelDemand, ServerGroup
from hetmesh.planner.measure import calibrate
from hetmesh.planner.plan import Assignment, _servers, demand_trace, evaluate, options, score
from hetmesh.planner.solve import Option, solve
from hetmesh.protocol import Role
from hetmesh.sim.traces import Trace

STARTS = 3  # purchases the local search (`trim`) starts from


class Purchase(msgspec.Struct, frozen=True):
    servers: dict[str, int]  # group name -> servers to buy
    usd_per_hour: float
    goodput_tok_s: float  # simulated, per second of the offered arrivals (`evaluate`)
    slo_attainment: float  # simulated, of all the requests offered
    served_share: float  # the demand share the solver was asked to serve (> 1: headroom it needed)
    assignments: list[Assignment]
    meets: bool  # every model's attainment >= the target
    worst_attainment: float  # simulated, of the worst-served model's requests (`attained`)
    model_attainment: dict[str, float] = msgspec.field(default_factory=dict)
    refused: int = 0  # requests offered and not served (admission, or no server for their model)
    offered: int = 0


def attained(sm: Mapping[str, Any], demands: Sequence[ModelDemand]) -> float:
    """The SLO attainment of the worst-served model with demand (a model nobody serves: 0). A fleet meets
    the SLOs when every model meets its own: over all requests, a fleet could starve one model (its
    longest prompts, say) and still pass on the others' share."""
    named = [d.name for d in demands if d.rate > 0]
    if len(named) <= 1:
        return sm["slo_attainment"]
    per = sm.get("models", {})
    return min(per.get(m, {}).get("slo_attainment", 0.0) for m in named)


def _purchase(groups: Sequence[ServerGroup], lay: list[Assignment], sm: dict, share: float,
              target: float, demands: Sequence[ModelDemand]) -> Purchase:
    bought: dict[str, int] = {}
    for a in lay:
        if a.model:
            bought[a.group] = bought.get(a.group, 0) + 1
    worst = attained(sm, demands)
    return Purchase(servers=bought, usd_per_hour=sm["usd_per_hour"], goodput_tok_s=sm["goodput_tok_s"],
                    slo_attainment=sm["slo_attainment"], served_share=share,
                    assignments=[a for a in lay if a.model], meets=worst >= target, worst_attainment=worst,
                    model_attainment={m: v["slo_attainment"] for m, v in sm.get("models", {}).items()},
                    refused=sm["refused_requests"], offered=sm["offered_requests"])


def _steps(lay: Sequence[Assignment], kinds: Sequence[ServerGroup], opts: Sequence[Option],
           prices: Mapping[str, float] | None) -> list[tuple[float, list[Assignment]]]:
    """The local search's neighbourhood of `lay`, each with the $/hour it saves, most first: a server
    dropped (not the last of its model; of equal savings, one with the most twins first: it leaves its
    shape served); a server replaced by one or more of a cheaper kind running its model in its role,
    on each of that kind's layouts for it, for less in all (the strongest first: a dear server is
    often worth two or three cheap ones, which a one-for-one swap never reaches); a server on another
    layout of its own kind (saves nothing: taken only where it meets the SLOs better, which may make
    room for the others)."""
    used = {a.server for a in lay}
    layouts: dict[tuple[str, str, Role], list[Option]] = {}  # (kind, model, role) -> its options, strongest first
    for o in opts:
        layouts.setdefault((kinds[o.group].name, o.model, o.role), []).append(o)
    for v in layouts.values():
        v.sort(key=lambda o: -_strength(o))
    free = {g.name: [sid for sid in g.server_ids() if sid not in used] for g in kinds}
    per_model = Counter(a.model for a in lay)
    twins = Counter((a.group, a.model, a.role, a.parallel) for a in lay)
    out: list[tuple[float, int, float, list[Assignment]]] = []  # (saving, twins, strength, layout)
    for a in lay:
        usd = device_usd_per_hour(a.accelerator, prices) * a.devices
        rest = [b for b in lay if b.server != a.server]
        if per_model[a.model] > 1:
            out.append((usd, twins[(a.group, a.model, a.role, a.parallel)], 0.0, rest))
        for g in kinds:
            for o in layouts.get((g.name, a.model, a.role), []):
                if g.name == a.group:
                    if o.parallel != a.parallel:
                        moved = msgspec.structs.replace(a, parallel=o.parallel)
                        out.append((0.0, 0, _strength(o), [moved if b.server == a.server else b for b in lay]))
                    continue
                for n in range(1, len(free[g.name]) + 1):
                    if n * o.usd_per_hour >= usd:
                        break
                    new = [Assignment(sid, g.name, g.accelerator, g.devices, a.model, a.role, o.parallel)
                           for sid in free[g.name][:n]]
                    out.append((usd - n * o.usd_per_hour, 0, n * _strength(o), rest + new))
    return [(saved, alt) for saved, _, _, alt in sorted(out, key=lambda t: (-t[0], -t[1], -t[2]))]


def _strength(o: Option) -> float:
    return o.capacity if o.role != Role.BOTH else max(o.capacity, o.prefill, o.decode)


def trim(p: Purchase, kinds: Sequence[ServerGroup], demands: Sequence[ModelDemand], trace: Trace,
         attainment: float, prices: Mapping[str, float] | None = None,
         efficiencies: Mapping[str, Efficiency] | None = None, limit: int = 24,
         opts: Sequence[Option] = (), sideways: bool = False,
         progress: Callable[[str], None] | None = None, sims: dict[tuple, dict | None] | None = None) -> Purchase:
    """Local search on a purchase that meets the SLOs (the solver sizes whole servers on estimates; this
    takes back what the estimates over-bought): from its neighbourhood (`_steps`: drop a server, swap one
    for one or more of a cheaper kind in its role, move one to another layout of its kind; `opts`: the
    kinds' options), the step that saves the most and has not been simulated yet, taken if the
    simulation says it still meets every model's SLOs (a step that saves nothing: if the worst-served
    model meets them better, or with `sideways` whenever it meets them: a layout move may open a
    drop that the old layout's simulations closed); until none is left or `limit` new simulations. A
    layout's simulation depends only on its shape (servers per kind, model, role and layout), so no
    shape is simulated twice (`sims`: shape -> summary, shared by the trims of one search)."""
    sims = {} if sims is None else sims
    lay = list(p.assignments)
    best = p
    seen: set[tuple[tuple[str, str, Role, str], ...]] = {_shape(lay)}
    tries = 0
    while tries < limit:
        step = next(((saved, alt) for saved, alt in _steps(lay, kinds, opts, prices) if _shape(alt) not in seen), None)
        if step is None:
            break
        saved, alt = step
        key = _shape(alt)
        seen.add(key)
        if key not in sims:  # only a new simulation counts against `limit`
            tries += 1
            if progress:
                progress(f"trimming ${best.usd_per_hour:,.0f}/h: step {tries} of at most {limit}")
            sims[key] = evaluate(alt, demands, kinds, trace, prices, efficiencies)
        sm = sims[key]
        if sm is None or (worst := attained(sm, demands)) < attainment:
            continue
        if saved <= 0 and not sideways and worst <= best.worst_attainment:
            continue
        lay = alt
        best = _purchase(kinds, alt, sm, p.served_share, attainment, demands)
    return best


def _shape(lay: Sequence[Assignment]) -> tuple[tuple[str, str, Role, str], ...]:
    return tuple(sorted((a.group, a.model, a.role, a.parallel) for a in lay))


def restrict(kinds: Sequence[ServerGroup], opts: Sequence[Option],
             names: Sequence[str]) -> tuple[list[ServerGroup], list[Option]]:
    """The kinds named and their options, renumbered: a smaller catalog without measuring again
    (a calibrated option is measured on its own kind's pool, whatever else the catalog holds)."""
    keep = [i for i, k in enumerate(kinds) if k.name in names]
    index = {old: new for new, old in enumerate(keep)}
    return ([kinds[i] for i in keep],
            [msgspec.structs.replace(o, group=index[o.group]) for o in opts if o.group in index])


def reprice(kinds: Sequence[ServerGroup], opts: Sequence[Option], prices: Mapping[str, float] | None) -> list[Option]:
    """The options at other prices (capacities do not depend on them)."""
    return [msgspec.structs.replace(o, usd_per_hour=device_usd_per_hour(kinds[o.group].accelerator, prices)
                                    * kinds[o.group].devices) for o in opts]


def _better(a: Purchase | None, b: Purchase | None) -> Purchase | None:
    """Of two purchases, the one that meets the SLOs at the lower $/hour; of two that miss, the closer."""
    if a is None or b is None:
        return a or b
    if a.meets != b.meets:
        return a if a.meets else b
    if a.meets:
        return a if a.usd_per_hour <= b.usd_per_hour else b
    return a if a.worst_attainment >= b.worst_attainment else b


def _catalogs(kinds: Sequence[ServerGroup], opts: Sequence[Option],
              alone: Sequence[str] | None = None) -> list[tuple[list[ServerGroup], list[Option]]]:
    """The whole catalog and each kind alone (those named in `alone`; None: every kind). The share
    search scales one share of the demand for every kind, so a kind whose measured capacity is
    overstated can win the program at every share while the simulation fails, and the search buys
    more of it than another kind alone needs; each kind alone as a candidate bounds the plan by the
    cheapest single kind that meets the SLOs."""
    names = [k.name for k in kinds if alone is None or k.name in alone] if len(kinds) > 1 else []
    alone_ = [restrict(kinds, opts, [n]) for n in names]
    return [(ks, os_) for ks, os_ in [(list(kinds), list(opts)), *alone_] if os_]


def _search(kinds: Sequence[ServerGroup], demands: Sequence[ModelDemand], opts: Sequence[Option], tr: Trace,
            attainment: float, prices: Mapping[str, float] | None, efficiencies: Mapping[str, Efficiency] | None,
            tries: int, measure: bool, progress: Callable[[str], None] | None = None) -> Purchase | None:
    """The share search of `cheapest` over one catalog."""
    tried: dict[float, Purchase | None] = {}

    def attempt(share: float) -> Purchase | None:
        if share not in tried:
            if progress:
                progress(f"sizing for {share:.2f}x the mean demand over {', '.join(k.name for k in kinds)}")
            s = solve(kinds, demands, opts, minimize_cost=True, served_share=share)
            lay = _servers(kinds, opts, s.counts) if s is not None else []
            sm = evaluate(lay, demands, kinds, tr, prices, efficiencies) if lay else None
            tried[share] = _purchase(kinds, lay, sm, share, attainment, demands) if sm is not None else None
        return tried[share]

    def _trimmed(got: Iterable[Purchase | None]) -> Purchase | None:
        # local search from the STARTS cheapest that meet the SLOs: different shares buy different mixes, and
        # the search from the cheapest alone often ends in a local minimum another start avoids
        meeting = sorted((p for p in got if p is not None and p.meets), key=lambda p: p.usd_per_hour)
        # (descending only, and across plateaus: a move that saves nothing may open a drop, or lead astray)
        out: Purchase | None = None
        sims: dict[tuple, dict | None] = {}
        for p in meeting[:STARTS]:
            for sideways in (False, True):
                out = _better(out, trim(p, kinds, demands, tr, attainment, prices, efficiencies, opts=opts,
                                        sideways=sideways, progress=progress, sims=sims))
        return out

    lo, hi = 1.0, 1.25 if measure else max(max(d.peak_rate / d.rate for d in demands if d.rate > 0), 1.25)
    first = attempt(lo)
    if first is not None and first.meets:
        for share in (0.8, 0.64):  # measured pools may be conservative for the whole fleet: try less
            got = attempt(share)
            if got is None or not got.meets:
                break
        return _trimmed(tried.values())
    while len(tried) < tries and not ((top := attempt(hi)) is not None and top.meets):
        if top is None:
            return first  # the solver cannot serve that much with what it may buy
        lo, hi = hi, hi * 2
    while len(tried) < tries and hi / lo > 1.1:
        mid = (lo * hi) ** 0.5
        got = attempt(mid)
        lo, hi = (lo, mid) if got is not None and got.meets else (mid, hi)
    if any(p is not None and p.meets for p in tried.values()):
        return _trimmed(tried.values())
    return max((p for p in tried.values() if p is not None), key=lambda p: p.worst_attainment, default=None)


def cheapest(kinds: Sequence[ServerGroup], demands: Sequence[ModelDemand], *, trace: Trace | None = None,
             attainment: float = 0.9, prices: Mapping[str, float] | None = None,
             efficiencies: Mapping[str, Efficiency] | None = None, check_duration_s: float = 300.0,
             tries: int = 8, measure: bool = True, seed: int = 0,
             opts: Sequence[Option] | None = None, alone: Sequence[str] | None = None,
             progress: Callable[[str], None] | None = None) -> Purchase | None:
    """The lowest-$/hour servers (at most `count` of each kind) on which every model's simulated SLO
    attainment on the demand is >= `attainment` (`attained`); None when even the most the solver may
    buy does not meet it.

    The solver sizes for a share of the mean demand; the simulation says whether that meets the
    SLOs. With `measure`, the capacities are first measured by simulation (`calibrate`); `opts`
    passes options already built (and measured) for these kinds, prices and trace instead. The
    share is searched between 1 (the mean) and the bursts' peak (ModelDemand.peak_rate),
    doubling past it while it fails, in at most `tries` simulations, for the whole catalog and
    for each kind alone (`_catalogs`; `alone` names the kinds worth trying alone, default all);
    the cheapest that meets the SLOs wins. With several models, each is bought on its own requests
    (`_apart`) and the search over all of them together runs only where that fails. `progress` is told
    what is being measured or simulated."""
    tr = trace or demand_trace(demands, check_duration_s, seed)
    if opts is None:
        opts = options(kinds, demands, prices, efficiencies)
        if measure:
            opts = calibrate(kinds, demands, opts, tr, attainment, prices, efficiencies, progress=progress)
    live = [d for d in demands if d.rate > 0]
    if len(live) > 1:
        apart = _apart(kinds, demands, live, opts, tr, attainment, prices, efficiencies, tries, measure, alone, progress)
        if apart is not None and apart.meets:
            return apart
    best: Purchase | None = None
    for ks, os_ in _catalogs(kinds, opts, alone):
        best = _better(best, _search(ks, demands, os_, tr, attainment, prices, efficiencies, tries, measure, progress))
    return best


def _apart(kinds: Sequence[ServerGroup], demands: Sequence[ModelDemand], live: Sequence[ModelDemand],
           opts: Sequence[Option], tr: Trace, attainment: float, prices: Mapping[str, float] | None,
           efficiencies: Mapping[str, Efficiency] | None, tries: int, measure: bool, alone: Sequence[str] | None,
           progress: Callable[[str], None] | None) -> Purchase | None:
    """Each model's cheapest servers on its own requests, bought together, checked on the whole trace. A
    server runs one model, so a model's attainment depends on its servers alone: the cheapest fleet is
    the cheapest per model, and the share search and trim of one model are not thrown off by another's
    (one share for all over-buys the model that needs less; a trim step is judged on the worst model's
    noise). None where a model's search fails or the kinds' counts cannot hold the parts together."""
    lay: list[Assignment] = []
    shares = []
    for d in live:
        mine = Trace([r for r in tr.requests if (r.model or demands[0].name) == d.name], tr.block_tokens, tr.name)
        got: Purchase | None = None
        for ks, os_ in _catalogs(kinds, [o for o in opts if o.model == d.name], alone):
            got = _better(got, _search(ks, [d], os_, mine, attainment, prices, efficiencies, tries, measure, progress))
        if got is None or not got.meets:
            return None
        lay += got.assignments
        shares.append(got.served_share)
    ids = {g.name: iter(g.server_ids()) for g in kinds}  # the parts numbered their servers apart
    try:
        lay = [msgspec.structs.replace(a, server=next(ids[a.group])) for a in lay]
    except StopIteration:
        return None
    if progress:
        progress("checking the models' purchases together")
    sm = evaluate(lay, demands, kinds, tr, prices, efficiencies)
    return None if sm is None else _purchase(kinds, lay, sm, max(shares), attainment, demands)


def pareto(kinds: Sequence[ServerGroup], demands: Sequence[ModelDemand], budgets: Sequence[float], *,
           trace: Trace | None = None, prices: Mapping[str, float] | None = None,
           efficiencies: Mapping[str, Efficiency] | None = None, check_duration_s: float = 300.0,
           seed: int = 0, progress: Callable[[str], None] | None = None) -> list[Purchase]:
    """For each $/hour budget, the most goodput the servers it buys deliver (simulated), from the
    same candidates as `cheapest` (the whole catalog and each kind alone); by $/hour, only the
    points that beat every cheaper one's goodput. `progress` is told which budget is being simulated."""
    opts = options(kinds, demands, prices, efficiencies)
    tr = trace or demand_trace(demands, check_duration_s, seed)
    got: list[Purchase] = []
    catalogs = _catalogs(kinds, opts)
    for b in budgets:
        if progress:
            progress(f"Pareto front: ${b:,.0f}/h")
        for ks, os_ in catalogs:
            s = solve(ks, demands, os_, budget_usd_h=b)
            if s is None or not s.counts:
                continue
            lay = _servers(ks, os_, s.counts)
            sm = evaluate(lay, demands, ks, tr, prices, efficiencies)
            if sm is not None:
                got.append(_purchase(ks, lay, sm, 1.0, 0.0, demands))
    out: list[Purchase] = []
    for p in sorted(got, key=lambda p: (p.usd_per_hour, -p.goodput_tok_s)):
        if not out or p.goodput_tok_s > out[-1].goodput_tok_s:
            out.append(p)
    return out


__all__ = ["Purchase", "cheapest", "pareto", "reprice", "restrict", "score"]
