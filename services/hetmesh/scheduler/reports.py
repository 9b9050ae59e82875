"""What the scheduler (hetmesh.scheduler.service) reports about its view, as functions of it: its
Prometheus rows, its answer on the status subject, and the attributes of its `placement` span. Kept
apart from the service's handlers, which only call them and send the result.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import trace

from hetmesh import metrics, wiring
from hetmesh.costmodel.economics import device_usd_per_hour
from hetmesh.placement import ClusterState, Decision, RequestInfo, WorkerView
from hetmesh.protocol import InferenceRequest, SchedulerStatus, SubmitReply, WorkerStatus


def metric_rows(state: ClusterState, prices: Mapping[str, float], in_flight: int,
                kv_queue_depth: int) -> list[metrics.Row]:
    """The scheduler's gauges: workers by role, the live fleet's $ per hour, requests in flight, KV index backlog."""
    # Runs in the metrics thread: a heartbeat handled meanwhile may change the view under it.
    views: list[WorkerView] = []
    for _ in range(3):
        try:
            views = list(state.views())
            break
        except RuntimeError:
            continue
    by_role: dict[str, int] = defaultdict(int)
    usd: dict[tuple[str, str], float] = defaultdict(float)
    for v in views:
        by_role[v.role.value] += 1
        try:
            usd[(v.model, v.accelerator)] += device_usd_per_hour(v.accelerator, prices) * v.devices
        except KeyError:  # an accelerator outside the catalog has no price: leave it out
            pass
    rows: list[metrics.Row] = [("hetmesh_scheduler_workers", "Workers in the scheduler's view", "gauge",
                                {"role": role}, n) for role, n in sorted(by_role.items())]
    # $/Mtok = sum(this) / (sum(rate(hetmesh_gateway_completion_tokens_total[5m])) * 3600 / 1e6)
    rows += [("hetmesh_fleet_usd_per_hour", "$ per hour of the live workers (catalog list prices or the "
              "cluster file's [prices])", "gauge", {"model": m, "accelerator": a}, v)
             for (m, a), v in sorted(usd.items())]
    rows.append(("hetmesh_scheduler_requests_in_flight", "Placed requests not finished yet", "gauge", {},
                 in_flight))
    rows.append(("hetmesh_scheduler_kv_index_queue_depth", "KV events waiting for the Redis prefix index",
                 "gauge", {}, kv_queue_depth))
    return rows


def status(state: ClusterState, instance: str, policy: str, in_flight: int, now: float,
           fit: Callable[[str], Mapping[str, Any]] = lambda _w: {}) -> SchedulerStatus:
    """The answer on the status subject: every worker in the view (`now`: wall time, for heartbeat ages), with
    `fit(worker)`: its learned speed (WorkerStatus's fields)."""
    details = []
    for v in sorted(state.every_view(), key=lambda v: v.worker_id):
        hb = state.heartbeat(v.worker_id)
        assert hb is not None
        details.append(WorkerStatus(
            worker_id=v.worker_id, model=v.model, accelerator=v.accelerator, role=v.role, engine=hb.engine,
            devices=v.devices, queue_depth=v.queue_depth, running=v.running, max_batch=v.max_batch,
            kv_blocks_used=v.kv_blocks_used, kv_blocks_total=v.kv_blocks_total,
            heartbeat_age_s=max(now - hb.ts, 0.0), tokens_generated=hb.tokens_generated,
            kv_endpoint=hb.kv_endpoint, draining=hb.draining, moving_to=hb.moving_to,
            moving_model=hb.moving_model, parallel=hb.parallel, wedged=state.is_wedged(v.worker_id),
            **fit(v.worker_id)))
    return SchedulerStatus(instance=instance, policy=policy, workers=[d.worker_id for d in details],
                           details=details, in_flight=in_flight)


def placement_attributes(span: trace.Span, policy: str, info: RequestInfo, d: Decision | None) -> None:
    """The candidates the policy weighed (with the cost model's predictions) and the one it chose."""
    span.set_attribute("hetmesh.policy", policy)
    span.set_attribute("hetmesh.prompt_tokens", info.prompt_len)
    span.set_attribute("hetmesh.cached_blocks", [f"{w}={n}" for w, n in sorted(info.cached_blocks.items())])
    if d is None:
        span.set_status(trace.Status(trace.StatusCode.ERROR, "no placement"))
        return
    span.set_attribute("hetmesh.candidates", [f"{p}->{dw} ttft={ttft:.6f}s tpot={tpot:.6f}s e2e={e2e:.6f}s"
                                              for p, dw, ttft, tpot, e2e in d.candidates])
    span.set_attribute("hetmesh.candidate_count", len(d.candidates))
    span.set_attribute("hetmesh.mode", d.mode)
    span.set_attribute("hetmesh.decode_worker", d.decode_worker)
    if d.prefill_worker is not None:
        span.set_attribute("hetmesh.prefill_worker", d.prefill_worker)
    span.set_attribute("hetmesh.expected_cached_tokens", d.expected_cached_tokens)
    if d.predicted_ttft_s is not None:
        span.set_attribute("hetmesh.predicted_ttft_s", d.predicted_ttft_s)
    if d.predicted_tpot_s is not None:
        span.set_attribute("hetmesh.predicted_tpot_s", d.predicted_tpot_s)


def schedule_attributes(span: trace.Span, req: InferenceRequest, reply: SubmitReply | None = None) -> None:
    """The submit's span: the request before it is placed; with `reply`, where it went or why not."""
    if reply is None:
        span.set_attribute("hetmesh.request_id", req.request_id)
        span.set_attribute("hetmesh.attempt", req.attempt)
        span.set_attribute("hetmesh.tenant", req.tenant or wiring.DEFAULT_TENANT)
    elif reply.placement is not None:
        span.set_attribute("hetmesh.mode", reply.placement.mode)
        span.set_attribute("hetmesh.decode_worker", reply.placement.decode_worker)
    elif reply.error is not None:
        span.set_status(trace.Status(trace.StatusCode.ERROR, reply.error.message))
