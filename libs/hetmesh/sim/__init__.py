"""Offline cluster simulator: replay a trace through the scheduler's own placement policies
against cost-model workers, in virtual time.

    from hetmesh.sim import ClosedLoop, SimConfig, pool, simulate
    workers = pool("mi300x", 1, "amd-mi300x") + pool("mi308x", 2, "amd-mi308x")
    summary, result = simulate(workers, "least_loaded", ClosedLoop(concurrency=24, total=600))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hetmesh.placement import Policy, make_policy
from hetmesh.sim.cluster import Simulator
from hetmesh.sim.metrics import Slo, summarize
from hetmesh.sim.results import RequestRecord, SimResult
from hetmesh.sim.spec import SimConfig, WorkerSpec, pool, workers_from_config
from hetmesh.sim.traces import ClosedLoop, Trace, TraceRequest, load, load_azure, load_mooncake, synthetic


def policy_for(name: str, workers: Sequence[WorkerSpec], slo: Slo | Mapping[str, Slo] = Slo(),
               **kwargs: Any) -> Policy:
    """A policy as the scheduler would build it (the cost policy gets the model specs and SLOs:
    one for all, or each model's own)."""
    if name == "cost":
        one = slo if isinstance(slo, Slo) else Slo()
        kw: dict[str, Any] = {"models": {w.model: w.spec for w in workers},
                              "dtypes": {w.model: w.dtype for w in workers if w.dtype},
                              "ttft_slo_s": one.ttft_s, "tpot_slo_s": one.tpot_s}
        if isinstance(slo, Mapping):
            kw["slos"] = {m: (s.ttft_s, s.tpot_s) for m, s in slo.items()}
        kw.update(kwargs)
        return make_policy(name, **kw)
    if name == "llm_d_latency" and isinstance(slo, Slo):  # its headroom scorer reads the request's SLOs
        kwargs = {"ttft_slo_s": slo.ttft_s, "tpot_slo_s": slo.tpot_s, **kwargs}
    return make_policy(name, **kwargs)


def simulate(workers: Sequence[WorkerSpec], policy: str | Policy, trace: Trace | ClosedLoop,
             config: SimConfig | None = None, slo: Slo | Mapping[str, Slo] = Slo(),
             progress: Callable[[int, int], None] | None = None, prices: Mapping[str, float] | None = None,
             **policy_kwargs: Any) -> tuple[dict[str, Any], SimResult]:
    if policy == "cost" and config is not None and config.efficiencies:
        policy_kwargs.setdefault("efficiencies", config.efficiencies)  # predict with the factors it runs on
    pol = policy_for(policy, workers, slo, **policy_kwargs) if isinstance(policy, str) else policy
    if isinstance(trace, ClosedLoop):  # a closed loop is stateful: give each run a fresh one
        trace = ClosedLoop(**{k: getattr(trace, k) for k in ("concurrency", "total", "input_len", "output_len",
                                                            "block_tokens", "seed", "shared_prefix_tokens",
                                                            "name")})
    res = Simulator(workers, pol, config).run(trace, progress)
    return summarize(res, slo, prices), res


__all__ = [
    "ClosedLoop",
    "RequestRecord",
    "SimConfig",
    "SimResult",
    "Simulator",
    "Slo",
    "Trace",
    "TraceRequest",
    "WorkerSpec",
    "load",
    "load_azure",
    "load_mooncake",
    "policy_for",
    "pool",
    "simulate",
    "summarize",
    "synthetic",
    "workers_from_config",
]
