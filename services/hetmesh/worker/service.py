"""Worker: the asyncio shell around one engine (one accelerator instance: a GPU or a server).

It takes WorkItems from its direct and pool subjects on the JetStream work queue (`hetmesh.workqueue`),
streams TokenChunks straight to the gateway, heartbeats its load, publishes its prefix cache's KV
events, aborts on Cancel; a PREFILL item ends by shipping the KV to the decode worker, a DECODE item
waits until its KV has landed, then continues the same completion.

This module is the wiring: subscriptions, tasks, timers. The rules live in pure state
(`requests.RequestBook`: intake, cancel, supersede, the KV wait; `kv`: landed KV, the prefix-cache
mirror, transfer planning); serving an item is `phases`, shipping KV `transfer`, KV landing here and the
prefix cache's events `kvbus`, what goes out `outbox`, its Prometheus rows `scrape`, and the planner's role
and model switches `switch`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.context import Context

from hetmesh import config, engines, kvstream, metrics, subjects, telemetry, wiring
from hetmesh.bus import Bus, decode
from hetmesh.costmodel import learn
from hetmesh.costmodel.model import CostModel
from hetmesh.engines.base import Engine, EngineError, EngineStats
from hetmesh.protocol import (
    Cancel,
    Heartbeat,
    KvLanded,
    KvResync,
    Phase,
    Resume,
    Role,
    WorkerCommand,
    WorkItem,
)
from hetmesh.runtime import run_service
from hetmesh.workqueue import RecentIds, WorkQueue, msg_id

from . import intake, scrape
from .gateways import GatewayWatch
from .kv import CacheMirror, KvInbox
from .kvbus import KvBus
from .outbox import Outbox
from .phases import Phases, Run
from .replay import ReplayLog
from .requests import Request, RequestBook, Stop, Verdict
from .switch import Switch
from .transfer import KvShipper

log = logging.getLogger("hetmesh.worker")

SUPERSEDE_WAIT_S = 5.0  # how long a newer attempt waits for the old one to let go of the request id
RESEND_S = 5.0  # after its own reconnect, the streams published on this recently are sent again (a killed node)


class Worker:
    def __init__(self, cfg: config.ClusterConfig, worker_id: str, role: Role | None = None,
                 kv_landed_timeout_s: float = 30.0, drain_timeout_s: float | None = None,
                 engine: Engine | None = None) -> None:
        self.cfg = cfg
        self.worker_id = worker_id
        self.instance = os.urandom(6).hex()  # this run's, in every heartbeat (Heartbeat.instance)
        self.group = cfg.group_of(worker_id)
        self.role = Role(role or self.group.role)
        self.model = cfg.model(self.group.model)
        self.cost = wiring.cost_model(cfg, self.group)
        self.engine: Engine = engine or engines.create(cfg, self.group, self.cost)
        self.kv_landed_timeout_s = kv_landed_timeout_s
        self.drain_timeout_s = cfg.worker.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        vendor, accel = self.group.vendor, self.group.accelerator
        self.work_subject = subjects.work_direct(self.role.value, vendor, accel, worker_id)
        self.pool_subject = subjects.work_pool(self.role.value, vendor, accel)  # both again in _take_work
        self.tracer = telemetry.setup("worker", worker_id)
        # Spans cost tens of microseconds each; make them only when someone collects them.
        self.tracing = telemetry.enabled()
        self.metrics = metrics.WorkerMetrics()
        self.metrics.registry.register(metrics.Snapshot(self._snapshot))
        self.http: metrics.MetricsServer | None = None
        self.book: RequestBook[Run] = RequestBook(self.group.model)
        self.inbox: KvInbox[kvstream.KvSink] = KvInbox(keep_bytes=self.engine.real_kv)
        self.taken = RecentIds()  # ids (msg_id) of the WorkItems this worker took: a copy is dropped
        self.replay = ReplayLog()
        self.gateways = GatewayWatch(cfg.mesh.heartbeat_timeout_s)  # a dead gateway's requests are cancelled
        self._steps_sent = 0.0  # when the engine's steps last rode a heartbeat (monotonic)
        self._beats = 0  # heartbeats sent by this run (Heartbeat.seq)
        self.kv_port: kvstream.Receiver | None = None  # decode-capable workers under the direct data plane
        # Made in start(), once the bus is up.
        self.bus: Bus
        self.queue: WorkQueue
        self.out: Outbox
        self.shipper: KvShipper
        self.phases: Phases
        self._subs: list[Any] = []
        self._work_subs: list[Any] = []
        self._loops: list[asyncio.Task[None]] = []
        self.switch = Switch(self)  # the planner's role and model switches (switch.py)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.bus = await Bus.for_mesh(self.cfg.mesh, f"worker-{self.worker_id}")
        self.out = Outbox(self.bus, self.worker_id, self.replay)
        self.kv = KvBus(self.bus, self.worker_id, self.book, self.inbox, self.out, lambda: self.engine,
                        lambda: self.group.model)

        async def gap() -> None:  # the gateways' beats it missed meanwhile say nothing; its last chunks may be lost
            self.gateways.bus_gap(now := time.monotonic())
            await self.out.resend_recent(now - RESEND_S)

        self.bus.on_reconnect.append(gap)
        self._wire_engine()
        await self.engine.start()
        nc = self.bus.nc
        self._subs += [
            await self.bus.subscribe(subjects.CANCEL, Cancel, self.on_cancel),
            await self.bus.subscribe(subjects.RESUME, Resume, self.on_resume),
            await nc.subscribe(subjects.GATEWAY_ALIVE_ALL, cb=self.on_gateway_alive),
            await self.bus.subscribe(subjects.kv_landed(self.worker_id), KvLanded, self.kv.on_kv_landed),
            await self.bus.subscribe(subjects.KV_RESYNC, KvResync, self.kv.on_kv_resync),
            await self.bus.subscribe(subjects.worker_command(self.worker_id), WorkerCommand, self.switch.on_command),
            await nc.subscribe(subjects.kv_recv(self.worker_id), cb=self.kv.on_kv_recv,
                               pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30),
        ]
        await self._open_kv_port()
        # The index must forget whatever an earlier incarnation of this worker held.
        await self.kv.publish_events(force_cleared=True)
        # The stream may not exist yet (this worker started before any scheduler): make it, then the consumers.
        self.queue = WorkQueue(self.bus, self.cfg.work_queue)
        await self.queue.ensure()
        await self._take_work()
        await nc.flush()
        self._loops = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self.kv.event_loop())]
        await self.heartbeat()
        self.http = metrics.serve_from_env(self.metrics.registry, self._ready)
        log.info("worker %s up: %s x%d, role %s, engine %s, subject %s", self.worker_id, self.group.accelerator,
                 self.group.devices, self.role, self.engine.name, self.work_subject)

    async def stop(self) -> None:
        """The drain (SIGTERM): take no new work and say so in the heartbeats (the scheduler places nothing
        here, and does not count the worker lost while it finishes), let running requests finish within
        worker.drain_timeout_s, hand the rest over (a retryable error: the gateway migrates each stream to
        another worker after its last token), then leave. The planner's role and model switches drain the
        same way."""
        t0 = time.monotonic()
        await self.switch.cancel()  # a role or model switch's drain gives way to this one
        self.out.event("", "draining", running=len(self._pending_tasks()), drain_timeout_s=self.drain_timeout_s)
        handed = await self.drain_work()
        self.out.event("", "drained", handed_over=handed, seconds=round(time.monotonic() - t0, 3))
        if self.http is not None:
            self.http.close()
        for t in self._loops:
            t.cancel()
        if self.kv_port is not None:
            await self.kv_port.close()
        await self.release_engine()
        with contextlib.suppress(Exception):
            await self.kv.publish_events()
        await self.out.close()
        await self.bus.close()

    async def drain_work(self, settle_s: float | None = None) -> int:
        """Take no new work and say so at once in a heartbeat (the scheduler places nothing more here), leave
        the pool, let running requests finish within worker.drain_timeout_s and hand the rest over, then let
        go of the direct subscription once its consumer is empty, and not before `settle_s` (default: one
        heartbeat interval) after that heartbeat. Meanwhile an item still arriving (placed before the
        scheduler heard of the drain) is handed over at once (on_work); intake.py says why it is done this
        way. Returns how many running requests were handed over."""
        self.book.draining = True
        t0 = time.monotonic()
        with contextlib.suppress(Exception):
            await self.heartbeat()
        direct, pool = self._work_subs or [None, None]
        self._work_subs = []
        await intake.leave(self.queue, pool, self.pool_subject)
        pending = self._pending_tasks()
        if pending:
            log.info("draining %d in-flight requests", len(pending))
            await asyncio.wait(pending, timeout=self.drain_timeout_s)
        left = self.book.hand_over()
        for r, how in left:  # out of time: each ends with a retryable error, and the gateway migrates it
            if how == Stop.KV_WAIT and r.handle.kv is not None and not r.handle.kv.done():
                r.handle.kv.set_exception(EngineError(f"worker {self.worker_id} is draining"))
            elif how == Stop.SHIPPING and r.handle.task is not None:
                r.handle.task.cancel()
            elif how == Stop.ENGINE:
                await self.engine.abort(r.request_id)
        rest = self._pending_tasks()
        if rest:
            await asyncio.wait(rest, timeout=5.0)
        settle = self.cfg.mesh.heartbeat_interval_s if settle_s is None else settle_s
        stranded = await intake.leave_when_empty(self.queue, direct, self.work_subject, t0 + settle,
                                                 self.cfg.mesh.heartbeat_timeout_s)
        if stranded:  # still placed here after a heartbeat timeout: a scheduler that missed every heartbeat
            log.warning("left %d work items undelivered on %s", stranded, self.work_subject)
            self.out.event("", "work_left", items=stranded, subject=self.work_subject)
        return len(left)

    async def _open_kv_port(self) -> None:
        kvc = self.cfg.kv_transfer
        if kvc.data_plane == "direct" and self.role != Role.PREFILL and self.kv_port is None:
            self.kv_port = kvstream.Receiver(self.worker_id, self.kv.open_sink, self.kv.stream_landed,
                                             self.kv.stream_failed, kvc.stream_idle_timeout_s,
                                             secret=kvc.secret.encode())
            await self.kv_port.start(kvc.listen_host, kvc.listen_port, kvc.advertise_host)

    async def _take_work(self) -> None:
        """Read this role's direct and pool work subjects."""
        vendor, accel = self.group.vendor, self.group.accelerator
        self.work_subject = subjects.work_direct(self.role.value, vendor, accel, self.worker_id)
        self.pool_subject = subjects.work_pool(self.role.value, vendor, accel)
        self._work_subs = [await self.queue.consume(self.work_subject, False, self.on_work_msg),
                           await self.queue.consume(self.pool_subject, True, self.on_work_msg)]

    # ------------------------------------------------------------------ moves (switch.Host: what a Switch uses)
    @property
    def draining(self) -> bool:
        return self.book.draining

    async def serve(self, role: Role) -> None:
        """Serve `role` from now on (after drain_work): its KV port if it takes decodes, its work subjects."""
        self.role = role
        await self._open_kv_port()
        await self._take_work()

    async def rejoin(self) -> None:
        """Take work again after a move's drain (reading the work subjects unless the move already does)."""
        if not self._work_subs:
            await self._take_work()
        self.book.draining = False

    async def release_engine(self) -> None:
        """Let go of the engine and the KV it held (landed for decodes that will not come here now)."""
        for sink in self.inbox.drain():
            sink.discard()
        await self.engine.close()

    async def adopt_engine(self, group: config.WorkerGroup, cost: CostModel, engine: Engine) -> None:
        """Serve `group` on `engine` (started) from now on, the old one released: rewire the parts that call
        the engine. Its prefix cache starts empty, so the index forgets what the old one held."""
        self.group, self.model, self.cost, self.engine = group, self.cfg.model(group.model), cost, engine
        self.book.model = group.model
        self.kv.cache = CacheMirror()
        sent = self.shipper.bytes_sent
        self._wire_engine()
        self.shipper.bytes_sent = sent  # a counter: it goes on across engines
        await self.kv.publish_events(force_cleared=True)

    def _wire_engine(self) -> None:
        """The parts that call the engine; made again when a ModelSwitch replaced it (adopt_engine)."""
        self.shipper = KvShipper(self.cfg.kv_transfer, self.bus, self.worker_id, self.engine,
                                 self.cost.kv_bytes_per_token(), self.out, self.metrics, self.tracer, self.tracing)
        self.phases = Phases(self.worker_id, self.engine, self.book, self.inbox, self.out, self.shipper, self.metrics,
                             self.tracer, self.tracing, self.cfg.mesh.time_scale, self.kv_landed_timeout_s)

    def _pending_tasks(self) -> list[asyncio.Task[None]]:
        return [r.handle.task for r in self.book.live() if r.handle.task is not None and not r.handle.task.done()]

    # ------------------------------------------------------------------ metrics (served once start() is done)
    def _ready(self) -> dict[str, object]:
        ok = bool(self._loops) and not self.book.draining and self.bus.nc.is_connected
        return {"ready": ok, "worker_id": self.worker_id, "role": self.role.value, "engine": self.engine.name}

    def _snapshot(self) -> list[metrics.Row]:
        return scrape.rows(self.engine.stats(), self.book.kv_waiting, self.shipper.bytes_sent,
                           self.inbox.bytes_received, len(self.inbox))

    # ------------------------------------------------------------------ work intake
    async def on_work_msg(self, m: Msg) -> None:
        """One delivery from the work queue. Acked after on_work: by then the engine has the item (or the
        item was answered with an error), and a worker that dies later is the scheduler's WorkerLost case."""
        try:
            item = decode(m.data, WorkItem)
        except msgspec.DecodeError as exc:
            log.warning("dropping an undecodable work item on %s: %s", m.subject, exc)
            await m.term()  # never redelivered
            return
        try:
            if self.taken.add(msg_id(item)):
                await self.on_work(item, m)
            else:  # redelivered (its ack was lost or late) or published again: its side effects happened
                self.out.event(item.request.request_id, "duplicate_work", phase=item.phase.value,
                               attempt=item.request.attempt, deliveries=m.metadata.num_delivered)
        except Exception:
            log.exception("taking work item %s failed", m.subject)
        finally:
            with contextlib.suppress(Exception):
                await m.ack()

    async def on_work(self, item: WorkItem, m: Msg) -> None:
        rid = item.request.request_id
        received = time.time()
        verdict = self.book.verdict(item)
        if verdict == Verdict.SUPERSEDE:
            await self._supersede(rid)
            verdict = self.book.verdict(item)
            if verdict == Verdict.SUPERSEDE:  # the old attempt did not let go in time
                verdict = Verdict.DUPLICATE
        if verdict == Verdict.DRAINING:  # placed before the scheduler heard of the drain: hand it over at once
            await self.out.error(item, f"worker {self.worker_id} is draining", retryable=True, status=503,
                                 code="worker_draining")
            self.out.event(rid, "handed_over", phase=item.phase.value, completion_tokens=0, streamed=0, queued=True)
            self.out.finished(rid, "abort", 0)  # the scheduler's record of it here ends
            return
        if verdict == Verdict.DUPLICATE:
            log.warning("duplicate work item for %s ignored", rid)
            return
        if verdict == Verdict.MISROUTED:
            await self.out.error(item, f"worker {self.worker_id} serves {self.group.model!r}, not "
                                 f"{item.request.model!r}", retryable=True, status=500, code="misrouted")
            self.out.finished(rid, "error", 0)
            return
        if verdict == Verdict.CANCELLED:
            self.out.event(rid, "aborted", phase=item.phase.value, completion_tokens=0, before_start=True)
            self.out.finished(rid, "abort", 0)
            return
        if verdict == Verdict.WITHDRAWN:  # its scheduler took it back before it came: placed anew
            await self.phases.withdrawn(item)
            return
        ctx = telemetry.extract(m.headers) if self.tracing else Context()
        run = Run()
        if item.phase == Phase.DECODE:
            # Held before yielding: its KV may already be on its way.
            run.kv = asyncio.get_running_loop().create_future()
            serve = self.phases.serve_decode
        elif await self.phases.submit(item, self.phases.engine_request(item)):
            # Submitted here rather than in the task: one event-loop hop less before the prefill starts.
            serve = self.phases.serve_compute
        else:
            self.metrics.requests.labels(item.phase.value, "error").inc()
            return
        r, early = self.book.accept(item, received, run)
        if early is not None and run.kv is not None:
            run.kv.set_result(early)
        run.task = asyncio.create_task(self._traced(serve, r, ctx), name=f"req-{rid}")
        run.task.add_done_callback(lambda _t, rid=rid, run=run: self.book.finish(rid, run))
        self.out.event(rid, "accepted", phase=item.phase.value, role=self.role.value,
                       prompt_tokens=len(item.request.prompt_tokens), attempt=item.request.attempt)

    async def _supersede(self, rid: str) -> None:
        """A newer attempt of a request this worker still holds (e.g. its other half's worker died and
        the gateway resubmitted): drop the old one quietly so that the new one can take the id."""
        r = self.book.get(rid)
        if r is None or r.handle.task is None:
            return
        await self._stop(rid, self.book.supersede(rid), r.handle)
        await asyncio.wait([r.handle.task], timeout=SUPERSEDE_WAIT_S)

    async def _stop(self, rid: str, how: Stop, run: Run) -> None:
        if how in (Stop.KV_WAIT, Stop.SHIPPING) and run.task is not None:
            # Waiting for KV: nothing in the engine yet. Shipping: the engine is done with it; cancelling the
            # task closes the KV stream, and the receiving worker drops what it got.
            run.task.cancel()
        elif how == Stop.ENGINE:
            await self.engine.abort(rid)

    async def _traced(self, serve: Callable[[Request[Run]], Awaitable[None]], r: Request[Run], ctx: Context) -> None:
        item = r.item
        if not self.tracing:
            try:
                await serve(r)
            except Exception as exc:
                await self._failed(item, exc)
            return
        span = self.tracer.start_span(f"worker.{item.phase.value}", context=ctx, attributes={
            "hetmesh.request_id": item.request.request_id, "hetmesh.worker_id": self.worker_id,
            "hetmesh.prompt_tokens": len(item.request.prompt_tokens)})
        with trace.use_span(span, end_on_exit=True):
            try:
                await serve(r)
            except Exception as exc:
                span.record_exception(exc)
                await self._failed(item, exc)

    async def _failed(self, item: WorkItem, exc: Exception) -> None:
        """Never leave the client hanging."""
        log.exception("serving %s failed", item.request.request_id)
        with contextlib.suppress(Exception):
            await self.out.error(item, f"worker {self.worker_id} failed: {exc}", retryable=False)
            self.out.finished(item.request.request_id, "error", 0)

    # ------------------------------------------------------------------ cancel and resume
    async def on_cancel(self, c: Cancel, _m: Msg | None = None) -> None:
        """Every worker sees every Cancel: whatever phase the request is in here, all of it goes now (the
        engine's blocks, a KV stream going out or coming in, KV that landed and its sink or spool file). One
        for another worker (Cancel.worker_id) is not for this one; one naming a phase (Cancel.phase) stops
        only that item of the request (RequestBook.cancel); a withdrawal of a FULL or PREFILL item is this
        worker's to arbitrate (RequestBook.withdraw: dropped only if the engine has not started it)."""
        if c.worker_id and c.worker_id != self.worker_id:
            return
        rid = c.request_id
        r = self.book.get(rid)
        if c.reason == "withdrawn" and c.phase in (Phase.FULL, Phase.PREFILL):  # this worker is the arbiter
            how = self.book.withdraw(rid, c.phase, c.attempt, time.time(), self.engine.started)
        else:  # (a withdrawn P/D placement's DECODE half ends as withdrawn)
            how = self.book.cancel(rid, time.time(), c.phase, c.attempt, withdrawn=c.reason == "withdrawn")
        if r is not None:
            await self._stop(rid, how, r.handle)
        if self.book.was_cancelled(rid):
            for sink in self.inbox.cancel(rid):
                sink.discard()

    async def on_gateway_alive(self, m: Msg) -> None:
        self.gateways.heard(m.subject, time.monotonic())

    async def _drop_orphans(self) -> None:
        """Cancel what a dead gateway placed here: its client is gone with it, nobody reads the tokens."""
        now = time.monotonic()
        if not self.bus.nc.is_connected:
            self.gateways.bus_gap(now)
            return
        dead = await self.gateways.sweep(self.bus.nc, now)
        live = [(r.request_id, r.item.request.reply_subject) for r in self.book.live() if not r.cancelled]
        for rid in self.gateways.orphans(live, dead):
            log.info("request %s: its gateway is gone; cancelled", rid)
            await self.on_cancel(Cancel(request_id=rid, reason="gateway_gone"))

    async def on_resume(self, r: Resume, _m: Msg) -> None:
        await self.out.resend(r)

    # ------------------------------------------------------------------ heartbeats and KV events
    async def heartbeat(self) -> EngineStats:
        """Publish this worker's heartbeat; the engine stats it was made from."""
        s = self.engine.stats()
        g = self.group
        steps, gaps = [], []
        if (now := time.monotonic()) - self._steps_sent >= learn.REPORT_S:
            steps, self._steps_sent = self.engine.step_log(), now
            gaps, self.phases.gaps = self.phases.gaps, []
        self._beats += 1
        await self.bus.publish(subjects.heartbeat(self.worker_id), Heartbeat(
            worker_id=self.worker_id, model=g.model, accelerator=g.accelerator, vendor=g.vendor, devices=g.devices,
            role=self.role, engine=self.engine.name, work_subject=self.work_subject,
            queue_depth=s.waiting + self.book.kv_waiting, running=s.running, max_batch=s.max_batch,
            kv_blocks_total=s.kv_blocks_total, kv_blocks_used=s.kv_blocks_used, block_size=s.block_size,
            ts=time.time(), tokens_generated=s.tokens_generated, prompt_tokens_computed=s.prompt_tokens_computed,
            prompt_tokens_cached=s.prompt_tokens_cached, aborted=s.aborted,
            kv_endpoint=self.kv_port.endpoint if self.kv_port is not None else "", parallel=g.parallel,
            step_tokens=g.step_tokens, draining=self.book.draining,
            moving_to=self.switch.moving_to.value if self.switch.moving_to is not None else "",
            moving_model=self.switch.moving_model, ready_in_s=self.switch.ready_in_s(), instance=self.instance,
            seq=self._beats, steps=steps, first_token_gaps=gaps))
        return s

    async def _heartbeat_loop(self) -> None:
        mesh = self.cfg.mesh
        every = max(round(mesh.stall_timeout_s / 4 / mesh.heartbeat_interval_s), 1)  # beats between `Working`s
        beats, last = 0, (-1, -1, -1, -1)
        while True:
            await asyncio.sleep(mesh.heartbeat_interval_s)
            try:
                stats = await self.heartbeat()
                self._sweep()
                await self._drop_orphans()
                beats += 1
                if beats % every == 0:
                    last = await self.out.working(self.book.live(), stats, last)
            except Exception:
                log.exception("heartbeat failed")

    def _sweep(self) -> None:
        now = time.time()
        for sink in self.inbox.sweep(now):  # streamed in for a decode that never came
            sink.discard()
        self.book.sweep(now)


def main(default_role: Role | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hetmesh.worker", description=__doc__)
    ap.add_argument("--cluster", help="cluster file (TOML)")
    ap.add_argument("--worker-id", required=True, help="<worker group name>-<index>, e.g. h100-0")
    ap.add_argument("--role", choices=[r.value for r in Role], default=default_role.value if default_role else None,
                    help="override the worker group's role")
    ap.add_argument("--kv-landed-timeout-s", type=float,
                    default=float(os.environ.get("HETMESH_KV_LANDED_TIMEOUT_S", "30")),
                    help="a DECODE item whose KV has not landed by then ends with an error")
    ap.add_argument("--drain-timeout-s", type=float, default=None,
                    help="SIGTERM: how long running requests may finish before the rest migrate "
                         "(default: the cluster file's worker.drain_timeout_s)")
    args = ap.parse_args()
    cfg = config.load(args.cluster)
    run_service(lambda: Worker(cfg, args.worker_id, Role(args.role) if args.role else None,
                               args.kv_landed_timeout_s, args.drain_timeout_s))
