"""Placement policies. Each is a small object: `place(request, workers) -> Decision | None`.

Policies may keep state of their own (a round-robin cursor) but do no I/O, so the live
scheduler and the offline simulator can run them unchanged. `None` means no worker can
take the request (no worker for the model, all excluded).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from hetmesh.placement.dynamo import Dynamo
from hetmesh.placement.llmd import LlmD
from hetmesh.placement.llmd_latency import LlmDLatency
from hetmesh.placement.state import Decision, RequestInfo, WorkerView
from hetmesh.protocol import Role


class Policy(Protocol):
    name: str

    def place(self, req: RequestInfo, workers: Sequence[WorkerView]) -> Decision | None: ...


def candidates(req: RequestInfo, workers: Sequence[WorkerView], role: Role) -> list[WorkerView]:
    return [w for w in workers if w.model == req.model and w.serves(role) and w.worker_id not in req.exclude]


def aggregated(decision: Decision, req: RequestInfo, workers: Sequence[WorkerView]) -> Decision | None:
    """`decision` run on one worker: for requests whose engine state cannot cross the P/D hand-over
    (a structured-output grammar restarts on the decode side). The chosen decode worker, else the
    prefill one, if it serves both roles; else the least utilised `both` worker of the model; None
    if the model has none."""
    if decision.prefill_worker is None:
        return decision
    by_id = {w.worker_id: w for w in workers}
    for wid in (decision.decode_worker, decision.prefill_worker):
        w = by_id.get(wid)
        if w is not None and w.role == Role.BOTH:
            break
    else:
        both = [w for w in candidates(req, workers, Role.BOTH) if w.role == Role.BOTH]
        if not both:
            return None
        w = min(both, key=_utilization)
    return Decision(mode="aggregated", decode_worker=w.worker_id, expected_cached_tokens=req.cached_tokens(w.worker_id),
                    reason=f"{decision.reason}; kept on one worker")


def _utilization(w: WorkerView) -> float:
    # Load per slot of batch, so an 8-GPU server with a big batch counts as less loaded than a
    # single-GPU one with the same number of requests.
    return w.load / max(w.max_batch, 1)


class _Aggregated:
    """Shared shape of the simple policies: pick one `both` worker, or else split P/D by `pick`."""

    name = "base"

    def pick(self, req: RequestInfo, pool: list[WorkerView]) -> WorkerView:
        raise NotImplementedError

    def place(self, req: RequestInfo, workers: Sequence[WorkerView]) -> Decision | None:
        both = [w for w in candidates(req, workers, Role.BOTH) if w.role == Role.BOTH]
        if both:
            w = self.pick(req, both)
            return Decision(mode="aggregated", decode_worker=w.worker_id,
                            expected_cached_tokens=req.cached_tokens(w.worker_id), reason=self.name)
        pre = [w for w in candidates(req, workers, Role.PREFILL) if w.role == Role.PREFILL]
        dec = [w for w in candidates(req, workers, Role.DECODE) if w.role == Role.DECODE]
        if not pre or not dec:
            return None
        p = self.pick(req, pre)
        d = self.pick(req, dec)
        return Decision(mode="disaggregated", prefill_worker=p.worker_id, decode_worker=d.worker_id,
                        expected_cached_tokens=req.cached_tokens(p.worker_id), reason=self.name)


class RoundRobin(_Aggregated):
    name = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0

    def pick(self, req: RequestInfo, pool: list[WorkerView]) -> WorkerView:
        pool = sorted(pool, key=lambda w: w.worker_id)
        w = pool[self._cursor % len(pool)]
        self._cursor += 1
        return w


class LeastLoaded(_Aggregated):
    name = "least_loaded"

    def pick(self, req: RequestInfo, pool: list[WorkerView]) -> WorkerView:
        return min(pool, key=lambda w: (_utilization(w), w.load, w.worker_id))


class PrefixAware(_Aggregated):
    """Most cached prefix blocks first; ties (and no hits) go to the least loaded."""

    name = "prefix_aware"

    def pick(self, req: RequestInfo, pool: list[WorkerView]) -> WorkerView:
        return min(pool, key=lambda w: (-req.cached_blocks.get(w.worker_id, 0), _utilization(w), w.load, w.worker_id))


def _cost_policy(**kwargs: Any) -> Policy:
    from hetmesh.placement.cost import CostPolicy  # the cost model is heavier; load on demand

    return CostPolicy(**kwargs)


POLICIES: dict[str, Callable[..., Policy]] = {
    RoundRobin.name: RoundRobin,
    LeastLoaded.name: LeastLoaded,
    PrefixAware.name: PrefixAware,
    "cost": _cost_policy,
    # The routers users come from, as their projects document them (benchmarks/anchors.py compares them).
    LlmD.name: LlmD,
    Dynamo.name: Dynamo,
    LlmDLatency.name: LlmDLatency,  # llm-d's predicted-latency routing: learned from observed TTFT/TPOT, no physics
}


def _factory(name: str) -> Callable[..., Policy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown placement policy {name!r}; choose from {sorted(POLICIES)}") from None


def policy_options(name: str) -> list[str]:
    """The options policy `name` takes."""
    factory = _factory(name)
    if factory is _cost_policy:
        from hetmesh.placement.cost import CostPolicy

        factory = CostPolicy  # type: ignore[assignment]
    return [p for p in inspect.signature(factory).parameters if p != "self"]


def check_options(name: str, options: Mapping[str, Any]) -> None:
    """A misspelled option is an error that names it, never silently dropped."""
    known = policy_options(name)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"placement policy {name!r} has no option {', '.join(map(repr, unknown))}; "
                         f"its options: {', '.join(known) or 'none'}")


def make_policy(name: str, **kwargs: Any) -> Policy:
    check_options(name, kwargs)
    return _factory(name)(**kwargs)
