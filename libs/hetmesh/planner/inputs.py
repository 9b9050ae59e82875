"""What the planner plans from: the servers you own or may buy, the models with their SLOs, and
the demand on each model. Plain frozen data; `demand_from_trace` measures a trace (or a window of
one) into the same shape live statistics will have."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from hetmesh.protocol import Role
from hetmesh.sim.traces import Trace

BURST_WINDOW_S = 30.0  # bursts shorter than this are what queues absorb; longer ones need capacity


class ServerGroup(msgspec.Struct, frozen=True, kw_only=True):
    """`count` identical servers. `model` / `role` / `parallel`: what they run now ("" model: nothing).
    `layouts`: the parallel layouts their engine can run (the vllm engine: tp only over several devices)."""

    name: str
    accelerator: str
    devices: int = 8
    count: int = 1
    model: str = ""
    role: Role = Role.BOTH
    parallel: str = "tp"
    max_batch: int = 64
    step_tokens: int = 8192
    layouts: tuple[str, ...] = ("tp", "ep", "dp")

    def server_ids(self) -> list[str]:
        return [f"{self.name}-{i}" for i in range(self.count)]


class ModelDemand(msgspec.Struct, frozen=True, kw_only=True):
    """One model: its cost-model spec, SLOs and priority, and the traffic on it (means over a window)."""

    name: str
    spec: str
    rate: float  # requests per second
    input_mean: float
    output_mean: float
    prefix_hit: float = 0.0  # share of prompt tokens a prefix cache can serve
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    priority: float = 1.0  # weight of this model's good tokens in the objective
    dtype: str | None = None
    peak_rate: float = 0.0  # 95th percentile of the rate over BURST_WINDOW_S windows (0: as `rate`)

    def scaled(self, factor: float) -> ModelDemand:
        return msgspec.structs.replace(self, rate=self.rate * factor)


def demand_from_trace(trace: Trace, *, name: str, spec: str, ttft_slo_s: float = 2.0, tpot_slo_s: float = 0.1,
                      priority: float = 1.0, dtype: str | None = None, start: float | None = None,
                      end: float | None = None) -> ModelDemand:
    """The demand a trace (requests for `name`, or all of a one-model trace) puts on one model in the
    window [start, end): its rate, mean lengths and the share of prompt blocks seen before in it."""
    reqs: Sequence = [r for r in trace.requests if (not r.model or r.model == name)
                      and (start is None or r.arrival >= start) and (end is None or r.arrival < end)]
    if not reqs:
        raise ValueError(f"no requests for model {name!r} in the trace window")
    t0 = start if start is not None else reqs[0].arrival
    t1 = end if end is not None else reqs[-1].arrival
    span = max(t1 - t0, 1e-9)
    arrivals = np.array([r.arrival for r in reqs])
    counts, _ = np.histogram(arrivals, bins=max(1, int(np.ceil(span / BURST_WINDOW_S))), range=(t0, t0 + span))
    peak = float(np.percentile(counts, 95)) / min(BURST_WINDOW_S, span) if span > BURST_WINDOW_S else 0.0
    seen: set[int] = set()
    hit = total = 0
    for r in reqs:
        for h in r.hash_ids:
            hit += h in seen
            seen.add(h)
        total += len(r.hash_ids)
    return ModelDemand(name=name, spec=spec, rate=len(reqs) / span,
                       input_mean=sum(r.input_len for r in reqs) / len(reqs),
                       output_mean=sum(r.output_len for r in reqs) / len(reqs),
                       prefix_hit=hit / total if total else 0.0, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s,
                       priority=priority, dtype=dtype, peak_rate=max(peak, len(reqs) / span))


def length_buckets(trace: Trace, demand: ModelDemand, n: int) -> list[ModelDemand]:
    """Mélange's request-size buckets: `demand`'s requests in `trace` split at their prompt- and
    output-length quantiles into up to n x n shapes, each with its share of the rate and its own mean
    lengths (same model and SLOs; names "model[i,j]"). Priced at the mean request, a kind's cost misses
    what the long tail costs it; bucketed, a kind can be cheapest for some shapes of a model only."""
    reqs = [r for r in trace.requests if (r.model or demand.name) == demand.name]
    if not reqs:
        raise ValueError(f"no requests for model {demand.name!r} in the trace")
    ins = np.array([r.input_len for r in reqs], dtype=float)
    outs = np.array([r.output_len for r in reqs], dtype=float)
    cuts = np.linspace(0.0, 1.0, n + 1)[1:-1]
    bi = np.searchsorted(np.quantile(ins, cuts), ins, side="right")
    bo = np.searchsorted(np.quantile(outs, cuts), outs, side="right")
    out = []
    for i in range(n):
        for j in range(n):
            sel = (bi == i) & (bo == j)
            if sel.any():
                share = float(sel.mean())
                out.append(msgspec.structs.replace(demand, name=f"{demand.name}[{i},{j}]", rate=demand.rate * share,
                                                   peak_rate=demand.peak_rate * share,
                                                   input_mean=float(ins[sel].mean()),
                                                   output_mean=float(outs[sel].mean())))
    return out
