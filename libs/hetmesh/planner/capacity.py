"""How many requests per second one server sustains in one role within a model's SLOs, from its
cost model alone (closed-form steady state, no simulation). The planner's solver adds these up;
the simulator then checks the layouts it picks.

Steady state at rate lam on a server whose steps last T: each step carries lam*T prompts' worth of
prefill tokens and lam*T*O decoding sequences (Little's law), so T must satisfy
T >= step_time(prefill lam*T*I_new, decode lam*T*O at context I + O/2). The TPOT is T; prefill-only
servers queue prompts, so their TTFT bound sets a utilisation cap (M/D/1 waiting time).
"""

from __future__ import annotations

import math

import msgspec

from hetmesh.costmodel import CostModel
from hetmesh.planner.inputs import ModelDemand
from hetmesh.protocol import Role

MAX_UTILIZATION = 0.95  # no queue runs stably at 1.0
UNBOUNDED_S = 1e9  # an SLO that never binds (finite: the M/D/1 bound divides by it)


def _pairs(new: float, cached: float) -> float:
    return new * cached + new * (new + 1) / 2


def mdl_utilization(service_s: float, bound_s: float) -> float:
    """Highest utilisation at which an M/D/1 queue's mean wait plus service stays within `bound_s`:
    s + rho*s/(2(1-rho)) <= bound  <=>  rho <= 2(x-1)/(2x-1), x = bound/s."""
    if service_s <= 0:
        return MAX_UTILIZATION
    x = bound_s / service_s
    if x <= 1.0:
        return 0.0
    return min(2 * (x - 1) / (2 * x - 1), MAX_UTILIZATION)


def prefill_capacity(cm: CostModel, d: ModelDemand, step_tokens: int) -> float:
    new = max(d.input_mean * (1.0 - d.prefix_hit), 1.0)
    cached = d.input_mean - new
    alone = cm.step_time_totals(int(new), 1, _pairs(new, cached), int(cached), 0, 0)
    k = max(step_tokens / new, 1.0)  # prompts one full step holds
    per_req = min(alone, cm.step_time_totals(int(new * k), math.ceil(k), k * _pairs(new, cached),
                                             int(cached * k), 0, 0) / k)
    lam = mdl_utilization(alone, d.ttft_slo_s) / per_req
    kv_bytes = d.input_mean * cm.kv_bytes_per_token()  # the server's NICs ship every prompt's KV
    nic = cm.accel.scaleout_bw * cm.devices
    return min(lam, nic / kv_bytes * MAX_UTILIZATION) if kv_bytes else lam


def _decode_batch_limit(cm: CostModel, d: ModelDemand, max_batch: int) -> int:
    return min(max_batch, cm.max_kv_tokens() // max(int(d.input_mean + d.output_mean), 1))


def decode_capacity(cm: CostModel, d: ModelDemand, max_batch: int) -> float:
    out = max(d.output_mean, 1.0)
    ctx = d.input_mean + out / 2
    hi = _decode_batch_limit(cm, d, max_batch)
    if hi < 1 or cm.decode_step_time(1, int(ctx)) > d.tpot_slo_s:
        return 0.0
    lo = 1
    while lo < hi:  # largest batch whose step stays within the TPOT SLO
        mid = (lo + hi + 1) // 2
        if cm.decode_step_time(mid, int(mid * ctx)) <= d.tpot_slo_s:
            lo = mid
        else:
            hi = mid - 1
    return lo / (out * cm.decode_step_time(lo, int(lo * ctx))) * MAX_UTILIZATION


def both_capacity(cm: CostModel, d: ModelDemand, max_batch: int, step_tokens: int) -> float:
    """Aggregated: prefill chunks ride in the decode steps, so the TPOT pays for them."""
    new = max(d.input_mean * (1.0 - d.prefix_hit), 1.0)
    cached = d.input_mean - new
    out = max(d.output_mean, 1.0)
    ctx = d.input_mean + out / 2
    b_max = _decode_batch_limit(cm, d, max_batch)
    if b_max < 1:
        return 0.0

    def fits(lam: float, t: float) -> bool:
        k = lam * t  # prompts started per step
        b = k * out
        if b > b_max or k * new + b > step_tokens:
            return False
        step = cm.step_time_totals(int(k * new), math.ceil(k), k * _pairs(new, cached), int(k * cached),
                                   max(int(b), 1), int(max(b, 1) * ctx))
        # TTFT: a prompt waits about a step, then takes its chunks at the step budget left by decodes
        ttft = t * (1 + math.ceil(new / max(step_tokens - b, 1.0)))
        return step <= t and ttft <= d.ttft_slo_s

    best = 0.0
    for frac in (0.25, 0.5, 0.75, 1.0):  # longer steps amortise more, until a limit binds
        t = d.tpot_slo_s * frac
        lo, hi = 0.0, b_max / (out * t)
        if not fits(1e-9, t):
            continue
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if fits(mid, t) else (lo, mid)
        best = max(best, lo)
    return best * MAX_UTILIZATION


def _no_room(cm: CostModel, d: ModelDemand) -> bool:
    """The weights leave no room for one sequence's KV."""
    return cm.max_kv_tokens() <= d.input_mean + d.output_mean


def ceiling(cm: CostModel, d: ModelDemand, role: Role, max_batch: int = 64, step_tokens: int = 8192) -> float:
    """Requests/s of `d`'s shape one server of `cm` sustains in `role` with the SLOs set aside (full
    batches, full prefill steps; an aggregated server can beat neither role alone): what no measurement
    may exceed. A pool offered a short trace faster than this can still meet the SLOs by holding every
    request at once, which says nothing of the rate it sustains."""
    if _no_room(cm, d):
        return 0.0
    loose = msgspec.structs.replace(d, ttft_slo_s=UNBOUNDED_S, tpot_slo_s=UNBOUNDED_S)
    if role == Role.PREFILL:
        return prefill_capacity(cm, loose, step_tokens)
    dec = decode_capacity(cm, loose, max_batch)
    return dec if role == Role.DECODE else min(dec, prefill_capacity(cm, loose, step_tokens))


def capacity(cm: CostModel, d: ModelDemand, role: Role, max_batch: int = 64, step_tokens: int = 8192) -> float:
    """Requests/s of `d`'s shape that one server of `cm` sustains in `role` within `d`'s SLOs."""
    if _no_room(cm, d):
        return 0.0
    if role == Role.PREFILL:
        return prefill_capacity(cm, d, step_tokens)
    if role == Role.DECODE:
        return decode_capacity(cm, d, max_batch)
    return both_capacity(cm, d, max_batch, step_tokens)
