"""Options with capacities measured by simulation (`calibrate`): the steady state (capacity.py) misses
bursts, pools and the cost policy's routing, so capacity planning sizes on what a simulated pool of
each option sustains on the demand's own trace."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import msgspec

from hetmesh.costmodel import Efficiency, server_model
from hetmesh.planner.capacity import ceiling
from hetmesh.planner.inputs import ModelDemand, ServerGroup
from hetmesh.planner.plan import Assignment, evaluate
from hetmesh.planner.solve import Option
from hetmesh.protocol import Role
from hetmesh.sim.traces import Trace

PARTNER_HEADROOM = 2.0  # a prefill (decode) pool's partners are sized for this many times the rate tried


def _strongest(opts: Sequence[Option]) -> dict[tuple[str, Role], Option]:
    """Per (model, role): the option one server of which sustains the most (a measured pool's partner)."""
    out: dict[tuple[str, Role], Option] = {}
    for o in opts:
        key = (o.model, o.role)
        if o.role != Role.BOTH and o.capacity > 0 and (key not in out or o.capacity > out[key].capacity):
            out[key] = o
    return out


def _pool(g: ServerGroup, model: str, role: Role, parallel: str, n: int, tag: str = "") -> list[Assignment]:
    return [Assignment(f"{g.name}{tag}-{i}", g.name, g.accelerator, g.devices, model, role, parallel) for i in range(n)]


def calibrate(kinds: Sequence[ServerGroup], demands: Sequence[ModelDemand], opts: Sequence[Option], trace: Trace,
              attainment: float, prices: Mapping[str, float] | None = None,
              efficiencies: Mapping[str, Efficiency] | None = None, requests: int = 1000,
              steps: int = 3, max_pool: int = 8, progress: Callable[[str], None] | None = None) -> list[Option]:
    """`opts` with each capacity replaced by the highest rate at which a pool of its servers meets
    `attainment` on the model's own requests (the trace's arrivals sped up or slowed down: its
    bursts included, which the steady state misses), per server. The pool is as large as the steady
    state says the model's bursts need (ModelDemand.peak_rate; at most `max_pool`): a pool absorbs
    bursts that one server cannot. A `both` pool runs aggregated; a prefill (decode) pool is paired
    with ample servers of the strongest decode (prefill) option for the model, so that its own role
    binds: a chip that cannot serve a model aggregated within its SLOs (long prompts on the
    bandwidth-rich, compute-poor MI308X) may still be the cheapest decoder behind a prefill
    specialist. A `both` option's `prefill` and `decode` (the time a `both` server lends to P/D)
    scale with its own pool's measurement: the cost policy mixes both kinds of work on such a
    server, and pools measured apart in each role overstate it (a `both` option that cannot serve
    aggregated at all is a P/D server: its role pools scale it). No measurement exceeds the steady
    state with the SLOs set aside (capacity.ceiling): a pool that holds a short trace at once meets
    it at any rate. `progress` is told which option is being measured."""
    dem = {d.name: d for d in demands}
    partners = _strongest(opts)
    ratio: dict[tuple[int, str, str, Role], float] = {}
    for i, o in enumerate(opts):
        key = (o.group, o.model, o.parallel, o.role)
        d = dem[o.model]
        if key in ratio or o.capacity <= 0 or d.rate <= 0:
            continue
        other = None
        if o.role != Role.BOTH:
            other = partners.get((o.model, Role.DECODE if o.role == Role.PREFILL else Role.PREFILL))
            if other is None:
                continue
        mine = Trace([r for r in trace.requests if (r.model or o.model) == o.model][:requests], trace.block_tokens)
        if not mine.requests:
            continue
        g = kinds[o.group]
        if progress:
            progress(f"measuring {g.name} {o.model} {o.role} {o.parallel} (option {i + 1} of {len(opts)})")
        n = max(1, min(g.count, max_pool, math.ceil(max(d.peak_rate, d.rate) / o.capacity)))
        pool = _pool(g, o.model, o.role, o.parallel, n)
        guess = o.capacity * n  # req/s of the pool
        cm = server_model(g.accelerator, d.spec, devices=g.devices, parallel=o.parallel, dtype=d.dtype,
                          efficiencies=efficiencies)
        top = ceiling(cm, d, o.role, g.max_batch, g.step_tokens) * n

        def meets(rate: float, pool: list[Assignment] = pool, other: Option | None = other, mine: Trace = mine,
                  d: ModelDemand = d) -> bool:
            lay = pool
            if other is not None:
                h = kinds[other.group]
                lay = pool + _pool(h, d.name, other.role, other.parallel,
                                      math.ceil(PARTNER_HEADROOM * rate / other.capacity), "-partner")
            sm = evaluate(lay, [d], kinds, mine.scaled(rate / d.rate), prices, efficiencies)
            return sm is not None and sm["slo_attainment"] >= attainment

        ratio[key] = min(_bracket(meets, guess, steps, min(top, guess * 64)), top) / guess
    out = []
    for o in opts:
        r = ratio.get((o.group, o.model, o.parallel, o.role), 1.0)
        pf = dc = r
        if o.role == Role.BOTH and o.capacity <= 0:  # never aggregated: a P/D server, as its role pools measured
            pf = ratio.get((o.group, o.model, o.parallel, Role.PREFILL), 1.0)
            dc = ratio.get((o.group, o.model, o.parallel, Role.DECODE), 1.0)
        out.append(msgspec.structs.replace(o, capacity=o.capacity * r, prefill=o.prefill * pf, decode=o.decode * dc))
    return [o for o in out if max(o.capacity, o.prefill, o.decode) > 0]


def _bracket(meets: Callable[[float], bool], guess: float, steps: int, top: float) -> float:
    """The highest rate `meets` (a predicate on req/s) accepts: bracketed by doubling up to `top` or
    halving from `guess`, then bisected geometrically `steps` times; 0 when even guess/256 fails."""
    lo, hi = 0.0, guess
    if meets(guess):
        lo, hi = guess, guess * 2
        while lo < top and meets(hi):
            lo, hi = hi, hi * 2
    else:
        while hi > guess / 256:
            hi, lo = hi / 2, 0.0
            if meets(hi):
                lo, hi = hi, hi * 2
                break
    for _ in range(steps if 0 < lo < top else 0):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo
