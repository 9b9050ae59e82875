"""The planner's integer program (SciPy's HiGHS): how many servers of each group run each
(model, parallel layout, role) option.

A `both` server's time may go to aggregated requests, prefills or decodes in any mix (continuous split
variables under its integer count); a `prefill` or `decode` server does only that. Every model with
demand keeps at least one server where the fleet allows (none would be an outage). Stage 1 maximises
priority-weighted output tokens/s (price and moves only break ties); stage 2 keeps those rates and spends
what is left on headroom. Capacities come from hetmesh.planner.capacity. See docs/planner.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec
import numpy as np

from hetmesh.planner.inputs import ModelDemand, ServerGroup
from hetmesh.protocol import Role

PRICE_WEIGHT = 1e-6  # $/h against tokens/s: only breaks ties
MOVE_WEIGHT = 1e-4  # per server moved, in the objective's tokens/s: only breaks ties
ROLE_WEIGHT = 1e-5  # a fixed role where `both` does as well: keep the policy's freedom


class Option(msgspec.Struct, frozen=True):
    """One way to run a server of `group`: `model` in `role` over `parallel`. Capacities in req/s
    within the model's SLOs: `capacity` in its role; a `both` server also `prefill` and `decode`."""

    group: int  # index into the groups
    model: str
    role: Role
    parallel: str
    capacity: float
    usd_per_hour: float  # of one server
    prefill: float = 0.0
    decode: float = 0.0


class Solution(msgspec.Struct, frozen=True):
    counts: dict[int, int]  # option index -> servers
    served: dict[str, float]  # model -> req/s the layout serves of its demand
    headroom: float  # stage 2's common growth factor u (served * (1 + u) still fits)
    objective: float
    usd_per_hour: float = 0.0  # of the servers in use (fractional servers' worth when `relaxed`)


class _Program:
    """Columns: x_j (servers per option, integer), then per `both` option its aggregated / prefill /
    decode shares (servers' worth), then a_m and d_m per model, then u."""

    def __init__(self, groups: Sequence[ServerGroup], demands: Sequence[ModelDemand], opts: Sequence[Option],
                 flexible: bool) -> None:
        self.n = len(opts)
        self.both = [j for j, o in enumerate(opts) if o.role == Role.BOTH]
        k = self.n
        self.share = {}
        for j in self.both:
            self.share[j] = (k, k + 1, k + 2)
            k += 3
        self.a = {d.name: k + i for i, d in enumerate(demands)}
        k += len(demands)
        self.d = {d.name: k + i for i, d in enumerate(demands)}
        k += len(demands)
        self.u = k
        self.nv = k + 1
        self.rows: list[np.ndarray] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.ub = np.full(self.nv, np.inf)
        if not flexible:  # `both` servers only serve aggregated requests
            for j in self.both:
                self.ub[self.share[j][1]] = self.ub[self.share[j][2]] = 0.0

    def row(self, coefs: Mapping[int, float], lo: float, hi: float) -> int:
        r = np.zeros(self.nv)
        for k, v in coefs.items():
            r[k] += v
        self.rows.append(r)
        self.lo.append(lo)
        self.hi.append(hi)
        return len(self.rows) - 1

    def capacity_terms(self, opts: Sequence[Option], model: str, role: Role) -> dict[int, float]:
        """Minus the req/s of `model` in `role` the layout offers (dedicated servers and `both` shares)."""
        out: dict[int, float] = {}
        for j, o in enumerate(opts):
            if o.model != model:
                continue
            if o.role == role and role != Role.BOTH:
                out[j] = -o.capacity
            elif o.role == Role.BOTH:
                agg, pf, dc = self.share[j]
                if role == Role.BOTH:
                    out[agg] = -o.capacity
                elif role == Role.PREFILL:
                    out[pf] = -o.prefill
                else:
                    out[dc] = -o.decode
        return out


def solve(groups: Sequence[ServerGroup], demands: Sequence[ModelDemand], options: Sequence[Option], *,
          flexible: bool = True, modes: frozenset[str] = frozenset({"aggregated", "disaggregated"}),
          counts: Mapping[int, int] | None = None, minimize_cost: bool = False, served_share: float = 1.0,
          budget_usd_h: float = np.inf, time_limit_s: float = 5.0, relaxed: bool = False) -> Solution | None:
    """The best layout, or None when nothing can serve. `flexible`: `both` servers may prefill or
    decode P/D requests too (the cost policy's freedom). `modes`: which request modes may carry
    demand. `counts`: servers per group where they differ from the groups' (capacity planning
    passes the most it may buy). `minimize_cost`: serve `served_share` of every model's demand at
    the lowest $/hour instead of the most goodput. `budget_usd_h`: servers in use cost at most this.
    `relaxed`: servers may be bought in fractions (the linear relaxation): a bound on what any whole
    layout over these options can reach, which `usd_per_hour` then reports (`counts` are rounded)."""
    p = _Program(groups, demands, options, flexible)
    if budget_usd_h < np.inf:
        p.row({j: o.usd_per_hour for j, o in enumerate(options)}, 0.0, budget_usd_h)
    servers = [counts.get(gi, g.count) if counts else g.count for gi, g in enumerate(groups)]
    for gi, n in enumerate(servers):
        p.row({j: 1.0 for j, o in enumerate(options) if o.group == gi}, 0.0, float(n))
    for j in p.both:
        p.row({**{s: 1.0 for s in p.share[j]}, j: -1.0}, -np.inf, 0.0)
    wanted = [d for d in demands if d.rate > 0 and any(o.model == d.name for o in options)]
    if budget_usd_h == np.inf and len(wanted) <= sum(servers):
        for d in wanted:  # no model with demand left without a server
            p.row({j: 1.0 for j, o in enumerate(options) if o.model == d.name}, 1.0, np.inf)
    cap_rows: list[tuple[int, int]] = []  # (row, served-rate column) for stage 2
    for d in demands:
        for role, var in ((Role.BOTH, p.a[d.name]), (Role.PREFILL, p.d[d.name]), (Role.DECODE, p.d[d.name])):
            cap_rows.append((p.row({var: 1.0, **p.capacity_terms(options, d.name, role)}, -np.inf, 0.0), var))
        if minimize_cost:
            p.row({p.a[d.name]: 1.0, p.d[d.name]: 1.0}, d.rate * served_share, np.inf)
        else:
            p.row({p.a[d.name]: 1.0, p.d[d.name]: 1.0}, 0.0, d.rate)
        if "aggregated" not in modes:
            p.ub[p.a[d.name]] = 0.0
        if "disaggregated" not in modes:
            p.ub[p.d[d.name]] = 0.0
    p.ub[p.u] = 0.0
    price = np.array([o.usd_per_hour for o in options])
    cur = np.array([float(groups[o.group].model == o.model and groups[o.group].role == o.role
                          and groups[o.group].parallel == o.parallel) for o in options])
    fixed_role = np.array([float(o.role != Role.BOTH) for o in options])
    ties = PRICE_WEIGHT * price + MOVE_WEIGHT * (1.0 - cur) + ROLE_WEIGHT * fixed_role
    c = np.zeros(p.nv)
    if minimize_cost:
        c[:p.n] = price + ties
    else:
        for d in demands:
            c[p.a[d.name]] = c[p.d[d.name]] = -d.priority * d.output_mean
        c[:p.n] = ties
    integrality = np.zeros(p.nv)
    integrality[:p.n] = 0 if relaxed else 1
    A = np.array(p.rows)
    opts = {"time_limit": time_limit_s, "presolve": True}
    # Imported here: only a solve needs scipy, and its import slows the start of every service.
    from scipy.optimize import Bounds, LinearConstraint, milp

    r1 = milp(c, constraints=LinearConstraint(A, p.lo, p.hi), integrality=integrality, bounds=Bounds(0, p.ub),
              options=opts)
    if r1.x is None:
        return None
    x = r1.x
    served = {d.name: float(x[p.a[d.name]] + x[p.d[d.name]]) for d in demands}
    headroom = 0.0
    if not minimize_cost:
        # Stage 2: fix the served rates; rate * (1 + u) <= capacity, maximise u (cheap and unmoved at a tie).
        lo2, hi2 = list(p.lo), list(p.hi)
        A2 = A.copy()
        ub2 = p.ub.copy()
        for row, var in cap_rows:
            amount = float(x[var])
            A2[row, var] = 0.0
            A2[row, p.u] = amount
            hi2[row] = -amount
        for d in demands:
            ub2[p.a[d.name]] = ub2[p.d[d.name]] = 0.0  # their amounts now sit in the rows' bounds
        ub2[p.u] = 100.0
        c2 = np.zeros(p.nv)
        c2[p.u] = -1.0
        c2[:p.n] = ties
        r2 = milp(c2, constraints=LinearConstraint(A2, lo2, hi2), integrality=integrality, bounds=Bounds(0, ub2),
                  options=opts)
        if r2.x is not None:
            x = r2.x
            headroom = float(x[p.u])
    chosen = {j: round(x[j]) for j in range(p.n) if round(x[j]) > 0}
    return Solution(counts=chosen, served=served, headroom=headroom, objective=float(-r1.fun),
                    usd_per_hour=float(price @ x[:p.n]))
