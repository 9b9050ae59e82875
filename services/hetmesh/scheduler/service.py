"""Scheduler: a thin asyncio shell around the pure placement core.

It folds worker heartbeats into a `ClusterState`, mirrors workers' KV events into the Redis
prefix index, and for each submitted request asks the configured policy for a placement,
then publishes `WorkItem`s to the chosen workers' direct subjects. A worker whose heartbeats
stop leaves the view; every request it held gets a `WorkerLost` on its reply subject, so the
gateway can resubmit it (nothing streamed yet) or end it with an error — never a hang.

Admission: a model's pool takes a bounded number of requests (`pool_full`); past it a submit
gets 503 + Retry-After. Redis is optional at run time: while it is unreachable placement runs on
load alone, and when it is back (or restarted empty) the scheduler asks every worker to
republish its whole prefix cache (`hetmesh.kv.resync`), which rebuilds the index.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
import uuid
from collections import defaultdict

from nats.aio.msg import Msg

from hetmesh import config, subjects, telemetry
from hetmesh.bus import REQUEST_ID, Bus, EventBatcher, encode
from hetmesh.kvindex.index import PrefixIndex
from hetmesh.placement import ClusterState, Decision, RequestInfo, make_policy, pool_full
from hetmesh.protocol import (
    Cancel,
    ErrorInfo,
    FinishedBatch,
    Heartbeat,
    InferenceRequest,
    KvEvent,
    KvResync,
    Phase,
    Placement,
    SchedulerStatus,
    ServiceEvent,
    SubmitReply,
    WorkerLost,
    WorkItem,
)
from hetmesh.runtime import run_service

log = logging.getLogger("hetmesh.scheduler")

PREFIX_POLICIES = {"prefix_aware", "cost"}  # policies that read the prefix index
REDIS_PROBE_S = 1.0  # how often the scheduler checks Redis (down -> up, or restarted empty)
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, passed on untouched when not tracing


class _InFlight:
    __slots__ = ("reply_subject", "workers")

    def __init__(self, reply_subject: str, workers: set[str]) -> None:
        self.reply_subject = reply_subject
        self.workers = workers


class Scheduler:
    def __init__(self, cfg: config.ClusterConfig, instance: str) -> None:
        self.cfg = cfg
        self.instance = instance
        self.state = ClusterState(cfg.mesh.heartbeat_timeout_s)
        sc = cfg.scheduler
        kwargs = {}
        if sc.policy == "cost":
            kwargs = {"models": {m.name: m.spec for m in cfg.models}, "objective": sc.objective,
                      "ttft_slo_s": sc.ttft_slo_s, "tpot_slo_s": sc.tpot_slo_s}
        self.policy = make_policy(sc.policy, **kwargs)
        self.uses_prefix = sc.policy in PREFIX_POLICIES
        self.block_size = {m.name: m.block_size for m in cfg.models}
        self.inflight: dict[str, _InFlight] = {}
        self.by_worker: dict[str, set[str]] = defaultdict(set)
        self.kv_queue: asyncio.Queue[KvEvent] = asyncio.Queue(maxsize=100_000)
        self.tracer = telemetry.setup("scheduler", instance)
        # Spans, context extraction and injection cost more than the rest of a placement; without an
        # exporter nobody sees them, so then the scheduler only passes the caller's trace headers on.
        self.tracing = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
        self.events: EventBatcher
        self.bus: Bus
        self.index: PrefixIndex
        self.placed = 0
        self.refused = 0
        self.redis_ok = False
        self.redis_run_id = ""  # a different one means Redis restarted (empty: no persistence)

    async def start(self) -> None:
        self.bus = await Bus.for_mesh(self.cfg.mesh, f"scheduler-{self.instance}")
        self.index = PrefixIndex.for_mesh(self.cfg.mesh, self.cfg.scheduler.prefix_ttl_s)
        self.events = EventBatcher(self.bus, "scheduler")
        await self._probe_redis()
        await self.bus.subscribe(subjects.HEARTBEAT_ALL, Heartbeat, self.on_heartbeat)
        await self.bus.subscribe(subjects.KV_EVENTS_ALL, KvEvent, self.on_kv_event)
        await self.bus.subscribe(subjects.FINISHED, FinishedBatch, self.on_finished)
        await self.bus.subscribe(subjects.CANCEL, Cancel, self.on_cancel)
        # A restarted scheduler knows no workers yet: gather a round of heartbeats before taking requests,
        # so that gateways keep waiting (no responders) instead of getting "no capacity".
        await asyncio.sleep(self.cfg.mesh.heartbeat_interval_s * 1.5)
        await self.bus.subscribe(subjects.SUBMIT, InferenceRequest, self.on_submit, queue=subjects.SCHEDULER_QUEUE)
        # Last: an answer on the status subject means every subscription above is in place.
        await self.bus.nc.subscribe(subjects.SCHED_STATUS, queue=subjects.SCHEDULER_QUEUE, cb=self.on_status)
        self._tasks = [asyncio.create_task(self._expire_loop()), asyncio.create_task(self._kv_writer()),
                       asyncio.create_task(self._redis_loop())]
        log.info("scheduler %s up, policy %s", self.instance, self.policy.name)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await self.events.close()
        await self.bus.close()
        await self.index.close()

    async def on_status(self, m: Msg) -> None:
        await self.bus.respond(m, SchedulerStatus(instance=self.instance, policy=self.policy.name,
                                                  workers=sorted(self.state.worker_ids())))

    # --- cluster view -------------------------------------------------------------------
    async def on_heartbeat(self, hb: Heartbeat, _m: Msg) -> None:
        if self.state.observe(hb, time.monotonic()):
            log.info("worker %s joined (%s x%d, %s)", hb.worker_id, hb.accelerator, hb.devices, hb.role)
            await self._event("", "worker_joined", worker_id=hb.worker_id, accelerator=hb.accelerator)

    async def _expire_loop(self) -> None:
        period = max(self.cfg.mesh.heartbeat_interval_s / 2, 0.05)
        while True:
            await asyncio.sleep(period)
            for worker_id in self.state.expire(time.monotonic()):
                await self.worker_lost(worker_id)

    async def worker_lost(self, worker_id: str) -> None:
        held = self.by_worker.pop(worker_id, set())
        log.warning("worker %s lost; %d requests affected", worker_id, len(held))
        await self._event("", "worker_lost", worker_id=worker_id, requests=len(held))
        for rid in held:
            fl = self.inflight.pop(rid, None)
            if fl is None:
                continue
            for w in fl.workers:
                self.by_worker.get(w, set()).discard(rid)
            await self.bus.publish(fl.reply_subject, WorkerLost(request_id=rid, worker_id=worker_id), rid)
        if self.redis_ok:
            try:
                await self.index.drop_worker(worker_id)
            except Exception as exc:
                self._redis_down(exc)

    # --- prefix index -------------------------------------------------------------------
    def _redis_down(self, exc: BaseException) -> None:
        if self.redis_ok:
            log.warning("Redis unreachable (%s): placing on load alone until it is back", exc)
            self.events.add(ServiceEvent(service="scheduler", instance=self.instance, request_id="",
                                         kind="redis_down", ts=time.time(), detail={"error": str(exc)}))
        self.redis_ok = False

    async def _probe_redis(self) -> None:
        try:
            run_id = str((await self.index.r.info("server"))["run_id"])
        except Exception as exc:
            self._redis_down(exc)
            return
        if not self.redis_ok or run_id != self.redis_run_id:
            # Back, or restarted (and empty): every worker republishes what its cache holds.
            was = "restarted" if self.redis_ok else "up"
            self.redis_ok, self.redis_run_id = True, run_id
            log.info("Redis %s: asking workers to republish their prefix caches", was)
            await self.bus.publish(subjects.KV_RESYNC, KvResync(reason=f"redis {was}"))
            self.events.add(ServiceEvent(service="scheduler", instance=self.instance, request_id="",
                                         kind="kv_resync", ts=time.time(), detail={"reason": f"redis {was}"}))

    async def _redis_loop(self) -> None:
        while True:
            await asyncio.sleep(REDIS_PROBE_S)
            await self._probe_redis()

    async def on_kv_event(self, ev: KvEvent, _m: Msg) -> None:
        if not self.redis_ok:
            return  # lost either way; the resync when Redis is back rebuilds the index
        try:
            self.kv_queue.put_nowait(ev)
        except asyncio.QueueFull:
            log.warning("kv index writer behind; dropping an event from %s", ev.worker_id)

    async def _kv_writer(self) -> None:
        # One writer keeps each worker's stored/removed events in order.
        while True:
            ev = await self.kv_queue.get()
            if not self.redis_ok:
                continue
            try:
                await self.index.apply(ev)
            except Exception as exc:
                self._redis_down(exc)

    # --- placement ----------------------------------------------------------------------
    async def on_submit(self, req: InferenceRequest, m: Msg) -> None:
        if not self.tracing:
            headers = {REQUEST_ID: req.request_id}
            if m.headers:
                for h in TRACE_HEADERS:
                    if h in m.headers:
                        headers[h] = m.headers[h]
            reply = await self.place(req, headers)
            # Not m.respond(): that echoes the request's headers back, for the gateway to parse for nothing.
            await self.bus.nc.publish(m.reply, encode(reply))
            return
        ctx = telemetry.extract(m.headers)
        with self.tracer.start_as_current_span("schedule", context=ctx) as span:
            span.set_attribute("hetmesh.request_id", req.request_id)
            reply = await self.place(req)
            if reply.placement is not None:
                span.set_attribute("hetmesh.mode", reply.placement.mode)
                span.set_attribute("hetmesh.decode_worker", reply.placement.decode_worker)
        await self.bus.respond(m, reply)

    async def place(self, req: InferenceRequest, headers: dict[str, str] | None = None) -> SubmitReply:
        """Place `req` and dispatch its WorkItems. `headers`: what they carry (default: the request id
        and the current span's trace context)."""
        views = self.state.views()
        sc = self.cfg.scheduler
        if pool_full(req.model, views, sc.queue_factor):
            self.refused += 1
            return SubmitReply(request_id=req.request_id, error=ErrorInfo(
                message=f"The workers of model {req.model!r} are at capacity; please retry.", type="server_error",
                code="overloaded", status=503, retry_after_s=sc.retry_after_s))
        cached: dict[str, int] = {}
        if self.uses_prefix and req.block_hashes and self.redis_ok:
            try:
                cached = await self.index.lookup(req.model, req.block_hashes, self.state.worker_ids())
            except Exception as exc:
                self._redis_down(exc)
        info = RequestInfo(
            request_id=req.request_id, model=req.model, prompt_len=len(req.prompt_tokens),
            max_tokens=req.sampling.max_tokens, cached_blocks=cached,
            block_size=self.block_size.get(req.model, 16), exclude=frozenset(req.exclude_workers),
            # The policy's clock is the engines' (virtual) time: a sim cluster at time_scale k runs k x wall.
            arrival=req.arrival_ts * self.cfg.mesh.time_scale,
        )
        decision = self.policy.place(info, views)
        if decision is None:
            return SubmitReply(request_id=req.request_id, error=ErrorInfo(
                message=f"no live worker can serve model {req.model!r} right now", type="server_error",
                code="no_capacity", status=503))
        placement = Placement(mode=decision.mode, decode_worker=decision.decode_worker,
                              prefill_worker=decision.prefill_worker,
                              expected_cached_tokens=decision.expected_cached_tokens,
                              policy=self.policy.name, reason=decision.reason)
        await self._dispatch(req, decision, placement, headers)
        return SubmitReply(request_id=req.request_id, placement=placement)

    async def _dispatch(self, req: InferenceRequest, d: Decision, placement: Placement,
                        headers: dict[str, str] | None) -> None:
        self.state.assigned(d)
        workers = set(d.workers)
        self.inflight[req.request_id] = _InFlight(req.reply_subject, workers)
        for w in workers:
            self.by_worker[w].add(req.request_id)
        rid = req.request_id
        if d.prefill_worker is None:
            await self._send(d.decode_worker, WorkItem(request=req, phase=Phase.FULL, placement=placement), headers)
        else:
            # Decode first: it can reserve KV space before the prefill side starts shipping.
            await self._send(d.decode_worker, WorkItem(request=req, phase=Phase.DECODE, placement=placement), headers)
            await self._send(d.prefill_worker, WorkItem(request=req, phase=Phase.PREFILL, placement=placement),
                             headers)
        self.placed += 1
        await self._event(rid, "placed", mode=d.mode, prefill_worker=d.prefill_worker,
                          decode_worker=d.decode_worker, cached_tokens=d.expected_cached_tokens,
                          policy=self.policy.name, attempt=req.attempt)

    async def _send(self, worker_id: str, item: WorkItem, headers: dict[str, str] | None) -> None:
        hb = self.state.heartbeat(worker_id)
        assert hb is not None, "policies only pick workers from the view"
        if headers is None:
            await self.bus.publish(hb.work_subject, item, item.request.request_id)
        else:
            await self.bus.nc.publish(hb.work_subject, encode(item), headers=headers)

    # --- bookkeeping --------------------------------------------------------------------
    async def on_finished(self, batch: FinishedBatch, _m: Msg) -> None:
        for f in batch:
            self.state.finished(f.worker_id, f.ts)
            fl = self.inflight.get(f.request_id)
            if fl is None:
                continue
            fl.workers.discard(f.worker_id)
            self.by_worker.get(f.worker_id, set()).discard(f.request_id)
            if not fl.workers:
                del self.inflight[f.request_id]

    async def on_cancel(self, c: Cancel, _m: Msg) -> None:
        fl = self.inflight.pop(c.request_id, None)
        if fl is not None:
            for w in fl.workers:
                self.by_worker.get(w, set()).discard(c.request_id)

    async def _event(self, request_id: str, kind: str, **detail: str | int | float | bool | None) -> None:
        self.events.add(ServiceEvent(service="scheduler", instance=self.instance, request_id=request_id, kind=kind,
                                     ts=time.time(), detail=detail))


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m hetmesh.scheduler", description=__doc__)
    ap.add_argument("--cluster", help="cluster file (TOML)")
    ap.add_argument("--instance", default=f"sched-{uuid.uuid4().hex[:6]}")
    args = ap.parse_args()
    cfg = config.load(args.cluster)
    run_service(lambda: Scheduler(cfg, args.instance))
