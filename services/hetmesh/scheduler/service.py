"""Scheduler: a thin asyncio shell around the pure placement core.

It folds worker heartbeats into a `ClusterState`, mirrors workers' KV events into the Redis
prefix index, and for each submitted request asks the configured policy for a placement,
then publishes `WorkItem`s to the chosen workers' direct subjects on the JetStream work queue
(`hetmesh.workqueue`: it answers the submit once the stream has stored them). A worker whose heartbeats
stop leaves the view; every request it held gets a `WorkerLost` on its reply subject, so the
gateway can resubmit it (nothing streamed yet) or end it with an error — never a hang.

Admission: a model's pool takes a bounded number of requests (`pool_full`); past it a submit gets 503 +
Retry-After. With SLO-aware admission on (cost policy, `admission_margin`), a request the cost model predicts
over margin x its SLO (hetmesh.placement.admission) gets 429 + Retry-After (the predicted excess wait).

This module is the service itself (the cluster view, placement and dispatch); beside it lie reconcile (its
in-flight books), bookings and withdraw (the other schedulers: their placements, their beats, who writes the
KV index; own placements their bookings move), prefix_mirror (the Redis prefix index), flowgate (flow
control), learning (the online fit) and reports (metrics rows, the status answer, the placement span).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
import uuid

import msgspec
import nats.errors
from nats.aio.msg import Msg

from hetmesh import config, metrics, subjects, telemetry, wiring
from hetmesh.beats import overslept
from hetmesh.bus import REQUEST_ID, Batcher, Bus, EventBatcher, encode, headers_for
from hetmesh.kvindex.index import PrefixIndex
from hetmesh.placement import REFUSED, ClusterState, Decision, RequestInfo, aggregated, exclusion, refusals
from hetmesh.planner.live import DemandWindow
from hetmesh.protocol import (
    Booked,
    BookedBatch,
    Cancel,
    ErrorInfo,
    FinishedBatch,
    Heartbeat,
    InferenceRequest,
    Phase,
    Placement,
    ServiceEvent,
    SubmitReply,
    TurnedAway,
    WorkerLost,
    WorkItem,
)
from hetmesh.runtime import run_service
from hetmesh.workqueue import Stored, WorkQueue, msg_id, withdrawals

from .bookings import Peers, beat, sift
from .demand import publish_demand
from .flowgate import FlowGate
from .holding import hold
from .learning import Learning
from .prefix_mirror import PrefixMirror
from .reconcile import InFlight
from .reports import metric_rows, placement_attributes, schedule_attributes, status
from .withdraw import Withdrawals

log = logging.getLogger("hetmesh.scheduler")
BOOKING_BATCH_S = 0.0  # its placements go out to the other schedulers this soon

PREFIX_POLICIES = {"prefix_aware", "cost", "llm_d", "dynamo"}  # policies that read the prefix index
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, passed on untouched when not tracing


class Scheduler:
    def __init__(self, cfg: config.ClusterConfig, instance: str) -> None:
        self.cfg = cfg
        self.instance = instance
        self.state = ClusterState(cfg.mesh.heartbeat_timeout_s, cfg.mesh.wedge_s)
        sc = cfg.scheduler
        self.policy = wiring.policy(cfg)
        # Flow control ([[tenants]]): requests it cannot place yet wait in one fair queue (hetmesh.placement.flow)
        q = wiring.flow(cfg)
        place = lambda i: self.policy.place(i, self.state.views())  # noqa: E731
        self.flow = FlowGate(cfg, q, place, self.state) if q is not None else None  # (an empty queue is falsy)
        # its placements that another scheduler's earlier booking, heard late, may move (withdraw.py)
        self.withdrawals = Withdrawals(self.policy, self.state, instance, cfg.mesh.heartbeat_interval_s,
                                       cfg.mesh.time_scale, enabled=self.flow is None)
        self.learning = Learning(self.policy, cfg.mesh.time_scale)  # each worker's speed from its engine's steps
        self.uses_prefix = sc.policy in PREFIX_POLICIES
        self.block_size = {m.name: m.block_size for m in cfg.models}
        self.inflight = InFlight(4 * cfg.mesh.heartbeat_timeout_s)  # what it placed, by request and by worker
        self.draining: set[str] = set()  # workers whose heartbeats say they are draining: placed on no more
        self.tracer = telemetry.setup("scheduler", instance)
        # Spans, context extraction and injection cost more than the rest of a placement; without an
        # exporter nobody sees them, so then the scheduler only passes the caller's trace headers on.
        self.tracing = telemetry.enabled()
        self.metrics = metrics.SchedulerMetrics()
        self.metrics.registry.register(metrics.Snapshot(self._snapshot))
        self.http: metrics.MetricsServer | None = None
        self.started = False
        self._submits: set[asyncio.Task[None]] = set()  # submits being placed and dispatched
        self.events: EventBatcher
        self.bus: Bus
        self.queue: WorkQueue
        self.prefix: PrefixMirror
        self.placed = 0
        self.refused = 0
        self.peers = Peers(cfg.mesh.heartbeat_timeout_s)  # the schedulers heard beating: whose bookings count
        self.reconnects = 0
        # what the planner plans from (hetmesh.sched.demand), SLOs judged in engine time
        self.demand = DemandWindow(cfg.planner.window_s, {m.name: cfg.slo(m.name) for m in cfg.models},
                                   cfg.mesh.time_scale)

    async def start(self) -> None:
        self.bus = await Bus.connect(self.cfg.mesh.nats_url, f"scheduler-{self.instance}", no_echo=True,  # not
                                     **config.nats_options(self.cfg.mesh))  # its own bookings back: a wake-up each
        self.bus.on_reconnect.append(self._on_reconnect)
        self.events = EventBatcher(self.bus, "scheduler")
        # What it places, for the other schedulers: at once (what it places in one turn of its loop, as one message)
        self.bookings = Batcher(self.bus, subjects.SCHED_BOOKED, BOOKING_BATCH_S)
        self.prefix = PrefixMirror(self.bus, PrefixIndex.for_mesh(self.cfg.mesh, self.cfg.scheduler.prefix_ttl_s),
                                   self.events, self.instance)
        self.queue = WorkQueue(self.bus, self.cfg.work_queue)
        await self.queue.ensure()  # before taking requests: their WorkItems need the stream
        await self.prefix.probe()
        await self.bus.nc.subscribe(subjects.SCHED_ALIVE_ALL, cb=self.peers.on_alive)
        await self.bus.subscribe(subjects.HEARTBEAT_ALL, Heartbeat, self.on_heartbeat)
        await self.bus.subscribe(subjects.FINISHED, FinishedBatch, self.on_finished)
        await self.bus.subscribe(subjects.SCHED_BOOKED, BookedBatch, self.on_booked)
        await self.bus.subscribe(subjects.CANCEL, Cancel, self.on_cancel)
        await self.bus.subscribe(subjects.TURNED_AWAY, TurnedAway, self.on_turned_away, queue=subjects.SCHEDULER_QUEUE)
        # A restarted scheduler knows no workers yet: gather a round of heartbeats before taking requests,
        # so that gateways keep waiting (no responders) instead of getting "no capacity".
        await asyncio.sleep(self.cfg.mesh.heartbeat_interval_s * 1.5)
        await self._kv_role()  # the other schedulers' beats heard meanwhile say whether it writes the KV index
        await self.bus.subscribe(subjects.SUBMIT, InferenceRequest, self.on_submit, queue=subjects.SCHEDULER_QUEUE)
        # Its own subject too: a gateway that sent a request here watches this scheduler's beats, and sends it
        # to another scheduler should these stop before the answer came.
        await self.bus.subscribe(subjects.sched_submit(self.instance), InferenceRequest, self.on_submit)
        # Last: an answer on the status subject means every subscription above is in place.
        await self.bus.nc.subscribe(subjects.SCHED_STATUS, queue=subjects.SCHEDULER_QUEUE, cb=self.on_status)
        loops = (self._expire_loop(), self.prefix.writer(), self.prefix.probe_loop(),
                 publish_demand(self.bus, self.instance, self.demand, self.cfg.planner.interval_s),
                 beat(self.bus, self.instance, self.cfg.mesh.heartbeat_interval_s, lambda: self.reconnects,
                      self._kv_role))
        self._tasks = [asyncio.create_task(c) for c in loops]
        self.started = True
        self.http = metrics.serve_from_env(self.metrics.registry, self._ready)
        log.info("scheduler %s up, policy %s", self.instance, self.policy.name)

    async def stop(self) -> None:
        if self.http is not None:
            self.http.close()
        for t in self._tasks:
            t.cancel()
        await self.events.close()
        await self.bookings.close()
        await self.bus.close()
        await self.prefix.close()

    def _ready(self) -> dict[str, object]:
        ok = self.started and self.bus.nc.is_connected
        return {"ready": ok, "instance": self.instance, "workers": len(self.state)}

    def _snapshot(self) -> list[metrics.Row]:
        return (metric_rows(self.state, self.cfg.prices, len(self.inflight), self.prefix.queue.qsize())
                + self.prefix.rows() + self.learning.rows() + (self.flow.rows() if self.flow is not None else []))

    async def on_status(self, m: Msg) -> None:
        st = status(self.state, self.instance, self.policy.name, len(self.inflight), time.time(), self.learning.status)
        if self.flow is not None:
            st.tenants = self.flow.status()
        await self.bus.respond(m, st)

    # --- cluster view -------------------------------------------------------------------
    async def on_heartbeat(self, hb: Heartbeat, _m: Msg) -> None:
        seen = self.state.observe(hb, time.monotonic())
        if seen == "stale":  # sent before one already heard (delayed on the bus): it says nothing new
            self.metrics.bad_input.labels("stale_heartbeat").inc()
            return
        if hb.draining:
            self.draining.add(hb.worker_id)
        elif self.draining:
            self.draining.discard(hb.worker_id)
        self.inflight.idle.observe(hb.worker_id, hb.running + hb.queue_depth, time.monotonic())
        if seen == "restarted":  # back before its silence expired: the last run's requests are lost all the same
            await self.worker_lost(hb.worker_id, seen)
        for rid in self.inflight.back(hb.worker_id, seen):  # what was failed over from it meanwhile: dropped there
            await self.bus.publish(subjects.CANCEL, Cancel(request_id=rid, reason="failed_over", worker_id=hb.worker_id))
        if seen:
            log.info("worker %s %s (%s x%d, %s)", hb.worker_id, seen, hb.accelerator, hb.devices, hb.role)
            await self._event("", "worker_joined", worker_id=hb.worker_id, accelerator=hb.accelerator, how=seen)
        if hb.steps and (alarm := self.learning.heartbeat(hb, self.state.view(hb.worker_id), time.monotonic())):
            ratio = self.learning.status(hb.worker_id).get("vs_peers", 1.0)
            log.warning("worker %s %s: its steps take %.2fx its peers'", hb.worker_id, alarm, ratio)
            await self._event("", f"worker_{alarm}", worker_id=hb.worker_id, vs_peers=round(ratio, 3))

    async def _on_reconnect(self) -> None:
        self.reconnects += 1  # in its beats: gateways send again what they still wait on (it may be lost)
        # The workers reconnect too, each on its own backoff: one more heartbeat timeout from now before
        # silence counts again, rather than failing their streams for the bus's outage.
        self.state.touch_all(time.monotonic() + self.cfg.mesh.heartbeat_timeout_s)
        self.inflight.idle.reset()

    async def _expire_loop(self) -> None:
        period = max(self.cfg.mesh.heartbeat_interval_s / 2, 0.05)
        was_down = False
        last = time.monotonic()
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            if away := overslept(last, period, now):  # this process did not run: the beats wait unread
                self.state.paused(away, now)
                self.peers.paused(away, now)
            last = now
            if not self.bus.nc.is_connected:
                was_down = True  # no heartbeats can arrive: silence now says nothing about the workers
                continue
            if was_down:  # back before the reconnect hook ran: same grace
                was_down = False
                await self._on_reconnect()
                continue
            for worker_id in self.state.expire(now):
                await self.worker_lost(worker_id)
            for worker_id in self.state.wedged(now):
                await self.worker_lost(worker_id, "wedged")
            self._reconcile()

    def _reconcile(self) -> None:
        """Forget what the workers' heartbeats say they no longer hold (their Finished lost on the bus)."""
        stale, gone = self.inflight.reconcile()
        if self.flow is not None:  # their cost leaves their tenants' shares as a Finished would take it
            for rid in gone:
                self.flow.done(rid)
        if stale:
            log.info("in flight: %d request(s) no worker holds any more dropped (Finished lost)", stale)

    async def worker_lost(self, worker_id: str, why: str = "silent") -> None:
        """Every request `worker_id` held gets a WorkerLost (its gateway migrates or resubmits it). `why`:
        silent (heartbeats stopped), restarted (a new run of its process), wedged (heartbeats on, engine still:
        it stays in the view, placed on no more until it moves)."""
        held = self.inflight.lost(worker_id, why == "silent")
        self.draining.discard(worker_id)
        log.warning("worker %s lost (%s); %d requests affected", worker_id, why, len(held))
        self.metrics.workers_lost.inc()
        await self._event("", "worker_lost", worker_id=worker_id, requests=len(held), why=why)
        for rid, reply_subject in held:
            if self.flow is not None:
                self.flow.done(rid)
            if reply_subject is not None:
                await self.bus.publish(reply_subject, WorkerLost(request_id=rid, worker_id=worker_id), rid)
        await self.prefix.drop_worker(worker_id)

    # --- placement ----------------------------------------------------------------------
    async def on_submit(self, req: InferenceRequest, m: Msg) -> None:
        # Each submit in a task of its own: nats-py runs one subscription's callbacks one at a time, and a
        # submit waits on Redis and on the work queue's PubAck; placement stays atomic all the same (`place`).
        t = asyncio.create_task(self._submit(req, m))
        self._submits.add(t)
        t.add_done_callback(self._submits.discard)

    async def _submit(self, req: InferenceRequest, m: Msg) -> None:
        try:
            await self._answer(req, m)
        except Exception:
            log.exception("submit %s failed", req.request_id)

    async def _answer(self, req: InferenceRequest, m: Msg) -> None:
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
            schedule_attributes(span, req)
            reply = await self.place(req)
            schedule_attributes(span, req, reply)
        await self.bus.respond(m, reply)

    async def place(self, req: InferenceRequest, headers: dict[str, str] | None = None) -> SubmitReply:
        """Place `req` and dispatch its WorkItems. `headers`: what they carry (default: the request id
        and the current span's trace context).

        Submits run concurrently: from reading the view to recording the assignment (`_dispatch` does
        it first thing) there is no await, so two submits never place on the same stale view."""
        t0 = time.perf_counter()
        since = time.monotonic()  # its TTFT runs from here, any time held included
        sc = self.cfg.scheduler
        cached: dict[str, int] = {}
        if self.uses_prefix and req.block_hashes and self.prefix.ok:
            cached = await self.prefix.lookup(req.model, req.block_hashes, self.state.worker_ids())
        views = self.state.views()
        if no := refusals.over_capacity(req.model, views, sc.queue_factor, sc.retry_after_s):
            return self._refuse(req, no)
        info = RequestInfo(
            request_id=req.request_id, model=req.model, prompt_len=len(req.prompt_tokens),
            max_tokens=req.sampling.max_tokens, cached_blocks=cached,
            block_size=self.block_size.get(req.model, 16),
            exclude=exclusion(req.model, views, req.exclude_workers, self.draining),
            # The policy's clock is the engines' (virtual) time: a sim cluster at time_scale k runs k x wall.
            arrival=req.arrival_ts * self.cfg.mesh.time_scale,
            waited_s=req.waited_s * self.cfg.mesh.time_scale,  # a retry's earlier tries: its TTFT runs from them
        )
        booked = False  # flow control's pump booked it in the view already
        if self.flow is not None:  # held, when it must be, in the fair queue rather than on its own
            if no := self.flow.unknown(req):
                return self._refuse(req, no)
            out = await self.flow.place(req, info, max(cached.values(), default=0) * info.block_size)
            if isinstance(out, refusals.Refusal):
                return self._refuse(req, out)
            decision, booked = out
        elif self.tracing:
            with self.tracer.start_as_current_span("placement") as span:
                decision = self.policy.place(info, views)
                placement_attributes(span, self.policy.name, info, decision)
        else:
            decision = self.policy.place(info, views)
        if self.flow is None and decision is not None and decision.mode == REFUSED and decision.hold_s is not None:
            decision = await hold(info, decision, lambda i: self.policy.place(i, self.state.views()),
                                  self.cfg.mesh.time_scale, self.cfg.gateway.hold_limit_s, self.metrics.held.inc)
        if no := (refusals.refused(req.model, decision, sc.retry_after_s)
                  or refusals.switching(req.model, decision, self.state.heartbeats(), sc.retry_after_s)):
            return self._refuse(req, no)
        if decision is None:
            # Nobody fit in the view (workers restarting, the bus just came back, the one left excluded):
            # wait one heartbeat timeout for heartbeats rather than refuse at once.
            deadline = time.monotonic() + self.cfg.mesh.heartbeat_timeout_s
            while decision is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                views = self.state.views()  # a worker this retry avoids may be the one back
                info = msgspec.structs.replace(info, exclude=exclusion(req.model, views, req.exclude_workers,
                                                                       self.draining))
                decision = self.policy.place(info, views)
        if no := refusals.no_worker(req.model, decision):
            return self._refuse(req, no)
        assert decision is not None
        if decision.prefill_worker is not None and req.sampling.structured is not None:
            # A structured-output grammar would restart on the decode side after the first token: one worker.
            decision = aggregated(decision, info, self.state.views())
            if decision is None:
                return self._refuse(req, refusals.structured_split(req.model))
        kv_endpoint = ""
        if decision.prefill_worker is not None:
            # The decode worker's KV port rides the placement: the prefill worker streams there at once.
            hb = self.state.heartbeat(decision.decode_worker)
            kv_endpoint = hb.kv_endpoint if hb is not None else ""
        placement = Placement(mode=decision.mode, decode_worker=decision.decode_worker,
                              prefill_worker=decision.prefill_worker,
                              expected_cached_tokens=decision.expected_cached_tokens,
                              policy=self.policy.name, reason=decision.reason,
                              predicted_ttft_s=decision.predicted_ttft_s, predicted_tpot_s=decision.predicted_tpot_s,
                              decode_kv_endpoint=kv_endpoint)
        try:
            await self._dispatch(req, info, decision, placement, headers, booked)
        except Exception as exc:  # the work queue did not store it within publish_timeout_s (bus away, stream full)
            log.warning("request %s: work queue refused its WorkItem: %r", req.request_id, exc)
            self.inflight.forget(req.request_id)
            if self.flow is not None:  # never dispatched: its cost leaves its tenant's share
                self.flow.done(req.request_id)
            # A decode half may already be queued: no worker should run it for a client that got a 503.
            await self.bus.publish(subjects.CANCEL, Cancel(request_id=req.request_id), req.request_id)
            self.metrics.rejected.labels("work_queue").inc()
            return SubmitReply(request_id=req.request_id, error=ErrorInfo(
                message=f"the work queue did not take the request: {exc!r}", type="server_error",
                code="work_queue_unavailable", status=503, retry_after_s=sc.retry_after_s))
        if req.attempt == 0:
            self.demand.submitted(req.request_id, req.model, since, len(req.prompt_tokens),
                                  req.sampling.max_tokens, decision.expected_cached_tokens)
        m = self.metrics
        m.placements.labels(self.policy.name, decision.mode).inc()
        m.placement_seconds.observe(time.perf_counter() - t0)
        if decision.predicted_ttft_s is not None:
            m.predicted.labels("ttft").observe(decision.predicted_ttft_s)
        if decision.predicted_tpot_s:
            m.predicted.labels("tpot").observe(decision.predicted_tpot_s)
        return SubmitReply(request_id=req.request_id, placement=placement)

    def _refuse(self, req: InferenceRequest, no: refusals.Refusal) -> SubmitReply:
        if no.admission:
            self.refused += 1
        if no.counted:
            self.metrics.rejected.labels(no.reason).inc()
            if req.attempt == 0:  # a retry's arrival was counted with its first attempt
                self.demand.refused(req.model, time.monotonic(), len(req.prompt_tokens), req.sampling.max_tokens)
        return SubmitReply(request_id=req.request_id, error=no.error)

    async def _dispatch(self, req: InferenceRequest, info: RequestInfo, d: Decision, placement: Placement,
                        headers: dict[str, str] | None, booked: bool = False) -> None:
        if not booked:
            self.state.assigned(d)
        now = time.time()
        self.bookings.add(Booked(scheduler=self.instance, request_id=req.request_id, decode_worker=d.decode_worker,
                                 prefill_worker=d.prefill_worker, booking=d.booking, placed_at=now))
        self.withdrawals.placed(req, info, d, now)
        self.inflight.record(req.request_id, req.reply_subject, set(d.workers), time.monotonic(), req.attempt)
        rid = req.request_id
        if d.prefill_worker is None:
            await self._send(d.decode_worker, WorkItem(request=req, phase=Phase.FULL, placement=placement), headers)
        else:
            # Decode first (it can reserve KV space before the prefill side starts shipping): both go out in
            # this order on the one connection, and their two PubAcks are awaited together, not one by one.
            pre = WorkItem(request=req, phase=Phase.PREFILL, placement=placement)
            dec, pre_stored = await asyncio.gather(
                self._send(d.decode_worker, WorkItem(request=req, phase=Phase.DECODE, placement=placement), headers),
                self._send(d.prefill_worker, pre, headers))
            if dec.held_before and not pre_stored.ack.duplicate:
                # Another placement streams this attempt (a FULL shares the DECODE's id): these workers hold
                # none of it, and this prefill would feed nobody.
                self.inflight.forget(rid)
                if self.flow is not None:
                    self.flow.done(rid)
                for c in withdrawals(pre):
                    await self.bus.publish(subjects.CANCEL, c, rid)
                with contextlib.suppress(nats.errors.Error):  # still queued: out of the stream too
                    await self.queue.withdraw(pre_stored)
        self.placed += 1
        await self._event(rid, "placed", mode=d.mode, prefill_worker=d.prefill_worker,
                          decode_worker=d.decode_worker, cached_tokens=d.expected_cached_tokens,
                          policy=self.policy.name, attempt=req.attempt)

    async def on_turned_away(self, msg: TurnedAway, _m: Msg) -> None:
        self.demand.refused(msg.model, time.monotonic(), msg.prompt_tokens, msg.max_tokens)

    async def _send(self, worker_id: str, item: WorkItem, headers: dict[str, str] | None) -> Stored:
        hb = self.state.heartbeat(worker_id)
        assert hb is not None, "policies only pick workers from the view"
        if headers is None:
            headers = headers_for(item.request.request_id) or {}
        stored = await self.queue.publish(hb.work_subject, encode(item), headers, msg_id(item))
        if stored.ack.duplicate:  # stored already: a re-publish after a bus gap, or another placement of the attempt
            self.metrics.bad_input.labels("duplicate_placement").inc()
            await self._event(item.request.request_id, "duplicate_placement", worker_id=worker_id,
                              phase=item.phase.value, attempt=item.request.attempt)
        return stored

    # --- bookkeeping --------------------------------------------------------------------
    async def on_booked(self, batch: BookedBatch, _m: Msg) -> None:
        """Other schedulers' placements, counted as its own: on their workers until their next heartbeats, and in
        the policy's bookkeeping (the cost policy's prefill backlog); bookings.py says which count. Its own
        placements they move are taken back (withdraw.py)."""
        now, wall = time.monotonic(), time.time()
        got = sift(batch, self.instance, lambda s: self.peers.alive(s, now), self.state.__contains__, wall)
        for lag in got.lags:
            self.metrics.booking_lag.observe(lag)
        kept, taken = self.withdrawals.count(got.booked, got.withdrawn, wall)
        self.metrics.rechecked.labels("kept").inc(kept)
        for t in taken:  # each placed anew as its next attempt, maybe by another scheduler
            self.metrics.rechecked.labels("withdrawn").inc()
            self.bookings.add(t.booked)
            await self.bus.publish(subjects.CANCEL, t.cancel, t.request_id)
            await self._event(t.request_id, "withdrawn", worker_id=t.cancel.worker_id, attempt=t.cancel.attempt)
        self.metrics.bad_input.labels("unknown_scheduler").inc(got.unknown_scheduler)
        self.metrics.bad_input.labels("unknown_worker").inc(got.unknown_worker)

    async def on_finished(self, batch: FinishedBatch, _m: Msg) -> None:
        for f in batch:
            if f.finish_reason == "withdrawn":  # un-booked already (on_booked); its next attempt is placed anew
                self.inflight.withdrawn(f.worker_id, f.request_id, f.attempt)
                continue
            self.state.finished(f.worker_id, f.ts)
            over = self.inflight.finished(f.worker_id, f.request_id)
            if over:
                met = self.demand.finished(f.request_id, time.monotonic(), f.completion_tokens, f.finish_reason)
                if self.flow is not None:
                    self.flow.done(f.request_id, met)
            elif over is False and f.finish_reason == "prefill_done":  # P/D: the decode side streams on from the first token
                self.demand.first_token(f.request_id, time.monotonic())

    async def _kv_role(self) -> None:  # one scheduler of those beating writes the KV index (bookings.Peers.writer)
        await self.prefix.role(self.peers.writer(self.instance, time.monotonic()))

    async def on_cancel(self, c: Cancel, _m: Msg) -> None:
        if c.worker_id:  # one worker's leftovers of a request that goes on elsewhere
            return
        self.inflight.forget(c.request_id)
        if self.flow is not None:
            self.flow.done(c.request_id)

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
