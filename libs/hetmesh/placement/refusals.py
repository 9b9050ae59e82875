"""Why the scheduler turns a request away, as pure functions of its view: each returns the metric's reason and
the OpenAI-shaped error the client gets, or None to go on. The scheduler's `place` only awaits between them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from msgspec import Struct

from hetmesh.placement.admission import REFUSED, retry_wait_s
from hetmesh.placement.state import Decision, WorkerView, back_in_s, moving, pool_full
from hetmesh.protocol import ErrorInfo, Heartbeat


class Refusal(Struct, frozen=True):
    reason: str  # hetmesh_scheduler_rejected_total{reason}
    error: ErrorInfo
    admission: bool = False  # the mesh is full (admission), not missing workers
    counted: bool = True  # a valid request turned away: in the metric, and demand the planner should plan for


def over_capacity(model: str, views: Sequence[WorkerView], queue_factor: float, retry_after_s: float) -> Refusal | None:
    """Before placing: the model's pool already holds all it may queue."""
    if not pool_full(model, views, queue_factor):
        return None
    return Refusal("overloaded", ErrorInfo(message=f"The workers of model {model!r} are at capacity; please retry.",
                                           type="server_error", code="overloaded", status=503,
                                           retry_after_s=retry_after_s), admission=True)


def refused(model: str, decision: Decision | None, retry_after_s: float) -> Refusal | None:
    """SLO-aware admission said no (after any hold): served this late it would miss its SLO and delay others."""
    if decision is None or decision.mode != REFUSED:
        return None
    return Refusal("slo", ErrorInfo(
        message=f"The workers of model {model!r} cannot serve this request within its latency SLO now "
                f"({decision.reason}); please retry.", type="server_error", code="slo_unattainable", status=429,
        retry_after_s=retry_wait_s(decision, retry_after_s)), admission=True)


def switching(model: str, decision: Decision | None, heartbeats: Iterable[Heartbeat],
              retry_after_s: float) -> Refusal | None:
    """Nobody could take it because the model's workers are switching role or model (the planner)."""
    if decision is not None or not (busy := moving(model, heartbeats)):
        return None
    return Refusal("moving", ErrorInfo(
        message=f"no worker can take a request of model {model!r} right now: " + ", ".join(
            f"{hb.worker_id} is switching to {hb.moving_model or hb.model}/{hb.moving_to}" for hb in busy)
        + "; please retry.", type="server_error", code="model_moving", status=503,
        retry_after_s=back_in_s(model, busy, retry_after_s)))


def flow_refused(model: str, tenant: str, why: str, retry_after_s: float) -> Refusal:
    """Flow control turned it away: its tenant is over its share of a full fleet (hetmesh.placement.flow)."""
    return Refusal("flow", ErrorInfo(
        message=f"The workers of model {model!r} are full and tenant {tenant!r} is over its share ({why}); please "
                "retry.", type="server_error", code="tenant_over_share", status=429, retry_after_s=retry_after_s),
        admission=True)


def unknown_tenant(tenant: str, header: str) -> Refusal:
    """A request named a tenant the cluster file does not have."""
    return Refusal("unknown_tenant", ErrorInfo(
        message=f"unknown tenant {tenant!r}: not a [[tenants]] name of the cluster file", type="invalid_request_error",
        code="unknown_tenant", param=header, status=400), counted=False)


def no_worker(model: str, decision: Decision | None) -> Refusal | None:
    """Still nobody after waiting a heartbeat timeout for one."""
    if decision is not None:
        return None
    return Refusal("no_capacity", ErrorInfo(message=f"no live worker can serve model {model!r} right now",
                                            type="server_error", code="no_capacity", status=503))


def structured_split(model: str) -> Refusal:
    """A structured-output grammar would restart on the decode side: it needs one worker serving both roles."""
    return Refusal("unsupported", ErrorInfo(
        message=f"structured outputs need a worker of model {model!r} that serves both roles (prefill and decode)",
        type="invalid_request_error", code="unsupported_parameter", param="response_format", status=400),
        counted=False)
