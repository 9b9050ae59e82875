"""Worker: the asyncio shell around one engine (one accelerator instance: a GPU or a server).

It takes WorkItems from its direct and pool subjects through their durable consumers on the
JetStream work queue (`hetmesh.workqueue`: acked once the engine has taken the item, a redelivered
or re-published copy acked and dropped), streams TokenChunks straight to the
gateway, heartbeats its load, publishes its prefix cache's KV events, aborts on Cancel, and
plays its part in disaggregated serving: a PREFILL item ends by shipping the KV (kv-transfer
names the decode worker's KV port and the bytes go there directly, or kv-transfer relays them);
a DECODE item waits until its KV has landed, then continues the same completion.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time
import uuid
from typing import Any

import msgspec
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.context import Context

from hetmesh import config, engines, kvstream, metrics, subjects, telemetry
from hetmesh.bus import Batcher, Bus, EventBatcher, decode
from hetmesh.costmodel import CostModel, accelerator, model_spec
from hetmesh.engines.base import Engine, EngineError, EngineOutput, EngineRequest
from hetmesh.protocol import (
    Cancel,
    ErrorInfo,
    Finished,
    Heartbeat,
    KvEvent,
    KvLanded,
    KvResync,
    KvTransferAccept,
    KvTransferDone,
    KvTransferRequest,
    Phase,
    RequestError,
    Resume,
    Role,
    ServiceEvent,
    TokenChunk,
    Usage,
    WorkItem,
)
from hetmesh.runtime import run_service
from hetmesh.workqueue import RecentIds, WorkQueue, msg_id

from .replay import ReplayLog

log = logging.getLogger("hetmesh.worker")

KV_EVENT_PERIOD_S = 0.05  # coalescing window for KvEvent batches
KV_ACCEPT_TIMEOUT_S = 5.0
KV_HEADER_ROOM = 1024  # bytes kept free in each KV chunk message for its headers (and the relay's)
KV_FLUSH_EVERY = 16 << 20  # flush the connection every this many KV bytes: bounded client buffer
EARLY_LANDED_MAX = 10_000
RESYNC_BATCH = 20_000  # block hashes per KvEvent when republishing a whole cache (~400 KiB of JSON)
STALE_S = 120.0

_enc = msgspec.json.Encoder()


class _Decode:
    """A DECODE work item waiting for its KV."""

    __slots__ = ("future", "item")

    def __init__(self, item: WorkItem, future: asyncio.Future[KvLanded]) -> None:
        self.item = item
        self.future = future


class Worker:
    def __init__(self, cfg: config.ClusterConfig, worker_id: str, role: Role | None = None,
                 kv_landed_timeout_s: float = 30.0, drain_timeout_s: float = 10.0,
                 engine: Engine | None = None) -> None:
        self.cfg = cfg
        self.worker_id = worker_id
        self.group = cfg.group_of(worker_id)
        self.role = Role(role or self.group.role)
        self.model = cfg.model(self.group.model)
        self.cost = CostModel(accelerator(self.group.accelerator), model_spec(self.model.spec),
                              self.group.devices, self.group.parallel)
        self.engine: Engine = engine or engines.create(cfg, self.group, self.cost)
        self.kv_landed_timeout_s = kv_landed_timeout_s
        self.drain_timeout_s = drain_timeout_s
        vendor, accel = self.group.vendor, self.group.accelerator
        self.work_subject = subjects.work_direct(self.role.value, vendor, accel, worker_id)
        self.pool_subject = subjects.work_pool(self.role.value, vendor, accel)
        self.tracer = telemetry.setup("worker", worker_id)
        # Spans cost tens of microseconds each; make them only when someone collects them.
        self.tracing = telemetry.enabled()
        self.metrics = metrics.WorkerMetrics()
        self.metrics.registry.register(metrics.Snapshot(self._snapshot))
        self.http: metrics.MetricsServer | None = None
        self.received: dict[str, float] = {}  # request id -> when its WorkItem arrived (time.time())
        self.bus: Bus
        self.queue: WorkQueue
        self.taken = RecentIds()  # ids (msg_id) of the WorkItems this worker took: a copy is dropped
        self.events: EventBatcher
        self.finished_out: Batcher  # Finished records, batched: only the scheduler's bookkeeping reads them
        self.tasks: dict[str, asyncio.Task[None]] = {}  # request id -> the task serving it
        self.decodes: dict[str, _Decode] = {}  # waiting for KvLanded
        self.early_landed: dict[str, tuple[KvLanded, float]] = {}  # KvLanded that beat its WorkItem
        self.recv: dict[str, list[float]] = {}  # transfer id -> [bytes, chunks, last seen]
        self.recv_data: dict[str, tuple[list[bytes], int]] = {}  # real-KV engines: transfer id -> chunks, next seq
        self.kv_sinks: dict[str, kvstream.KvSink] = {}  # transfer id -> KV that streamed in, until its decode runs
        self.kv_port: kvstream.Receiver | None = None  # decode-capable workers under the direct data plane
        self.cancelled: set[str] = set()
        self.attempts: dict[str, int] = {}  # request id -> attempt being served
        self.superseded: set[str] = set()  # old attempts being dropped for a newer one
        self.early_cancels: dict[str, float] = {}  # Cancels that beat their WorkItem (client gave up at once)
        self.draining = False
        self._subs: list[Any] = []
        self._work_subs: list[Any] = []
        self._loops: list[asyncio.Task[None]] = []
        self.replay = ReplayLog()
        self.kv_bytes_sent = 0
        self.kv_bytes_received = 0
        self._zeros = b""
        self.kv_held: set[int] = set()  # what the engine's prefix cache holds, mirrored from its KV events

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.bus = await Bus.for_mesh(self.cfg.mesh, f"worker-{self.worker_id}")
        self.events = EventBatcher(self.bus, "worker")
        self.finished_out = Batcher(self.bus, subjects.FINISHED)
        await self.engine.start()
        nc = self.bus.nc
        self._subs += [
            await self.bus.subscribe(subjects.CANCEL, Cancel, self.on_cancel),
            await self.bus.subscribe(subjects.RESUME, Resume, self.on_resume),
            await self.bus.subscribe(subjects.kv_landed(self.worker_id), KvLanded, self.on_kv_landed),
            await self.bus.subscribe(subjects.KV_RESYNC, KvResync, self.on_kv_resync),
            await nc.subscribe(subjects.kv_recv(self.worker_id), cb=self.on_kv_recv,
                               pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30),
        ]
        kvc = self.cfg.kv_transfer
        if kvc.data_plane == "direct" and self.role != Role.PREFILL:
            self.kv_port = kvstream.Receiver(self.worker_id, self._open_sink, self._stream_landed,
                                             self._stream_failed, kvc.stream_idle_timeout_s,
                                             secret=kvc.secret.encode())
            await self.kv_port.start(kvc.listen_host, kvc.listen_port, kvc.advertise_host)
        # The index must forget whatever an earlier incarnation of this worker held.
        await self._publish_kv_events(force_cleared=True)
        # The stream may not exist yet (this worker started before any scheduler): make it, then the consumers.
        self.queue = WorkQueue(self.bus, self.cfg.work_queue)
        await self.queue.ensure()
        self._work_subs = [await self.queue.consume(self.work_subject, False, self.on_work_msg),
                           await self.queue.consume(self.pool_subject, True, self.on_work_msg)]
        await nc.flush()
        self._loops = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._kv_event_loop())]
        await self._heartbeat()
        self.http = metrics.serve_from_env(self.metrics.registry, self._ready)
        log.info("worker %s up: %s x%d, role %s, engine %s, subject %s", self.worker_id, self.group.accelerator,
                 self.group.devices, self.role, self.engine.name, self.work_subject)

    async def stop(self) -> None:
        """Graceful: no new work, no heartbeats, let in-flight requests finish, error the rest, drain."""
        self.draining = True
        if self.http is not None:
            self.http.close()
        for t in self._loops:
            t.cancel()
        for s in self._work_subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()
        pending = [t for t in self.tasks.values() if not t.done()]
        if pending:
            log.info("draining %d in-flight requests", len(pending))
            await asyncio.wait(pending, timeout=self.drain_timeout_s)
        for d in list(self.decodes.values()):
            if not d.future.done():
                d.future.set_exception(EngineError("worker shutting down"))
        if self.kv_port is not None:
            await self.kv_port.close()
        for sink in self.kv_sinks.values():
            sink.discard()
        self.kv_sinks.clear()
        await self.engine.close()  # aborts what is left; their tasks send RequestError
        rest = [t for t in self.tasks.values() if not t.done()]
        if rest:
            await asyncio.wait(rest, timeout=5.0)
        with contextlib.suppress(Exception):
            await self._publish_kv_events()
        await self.events.close()
        await self.finished_out.close()
        await self.bus.close()

    # ------------------------------------------------------------------ metrics and spans
    def _ready(self) -> dict[str, object]:
        ok = bool(self._loops) and not self.draining and self.bus.nc.is_connected
        return {"ready": ok, "worker_id": self.worker_id, "role": self.role.value, "engine": self.engine.name}

    def _snapshot(self) -> list[metrics.Row]:
        s = self.engine.stats()
        g: dict[str, str] = {}  # no labels: Prometheus adds the target
        return [
            ("hetmesh_worker_queue_depth", "Requests waiting: in the engine's queue or for their KV", "gauge", g,
             s.waiting + len(self.decodes)),
            ("hetmesh_worker_running_requests", "Requests in the running batch", "gauge", g, s.running),
            ("hetmesh_worker_max_batch", "Running batch limit", "gauge", g, s.max_batch),
            ("hetmesh_worker_kv_blocks_used", "KV blocks pinned by running requests", "gauge", g, s.kv_blocks_used),
            ("hetmesh_worker_kv_blocks_cached", "KV blocks holding a prefix", "gauge", g, s.kv_blocks_cached),
            ("hetmesh_worker_kv_blocks_total", "KV blocks of the engine", "gauge", g, s.kv_blocks_total),
            ("hetmesh_worker_generated_tokens", "Tokens generated", "counter", g, s.tokens_generated),
            # Prefix hit rate: rate(prompt_cached) / (rate(prompt_cached) + rate(prompt_computed)).
            ("hetmesh_worker_prompt_tokens_computed", "Prompt tokens prefilled", "counter", g,
             s.prompt_tokens_computed),
            ("hetmesh_worker_prompt_tokens_cached", "Prompt tokens served from the prefix cache", "counter", g,
             s.prompt_tokens_cached),
            ("hetmesh_worker_preempted_requests", "Requests whose KV was dropped to make room", "counter", g,
             s.preempted),
            ("hetmesh_worker_aborted_requests", "Requests aborted in the engine", "counter", g, s.aborted),
            ("hetmesh_worker_kv_transfer_sent_bytes", "KV bytes shipped to decode workers", "counter", g,
             self.kv_bytes_sent),
            ("hetmesh_worker_kv_transfer_received_bytes", "KV bytes landed from prefill workers", "counter", g,
             self.kv_bytes_received),
        ]

    def _observe_first(self, item: WorkItem, start: float, first: float, queued_s: float) -> None:
        """Queue wait and prefill of a FULL or PREFILL item (start: engine submit; first: its first token)."""
        m = self.metrics
        queued_s = min(queued_s, first - start)
        m.phase.labels("queue").observe(queued_s)
        m.phase.labels("prefill").observe(first - start - queued_s)
        recv = self.received.get(item.request.request_id, start)
        m.ttft.labels("observed").observe(first - recv)
        p = item.placement.predicted_ttft_s
        if p is not None:
            m.ttft.labels("predicted").observe(p / self.cfg.mesh.time_scale)
        if self.tracing:
            self._span("queue_wait", start, start + queued_s)
            self._span("prefill", start + queued_s, first, **{"hetmesh.phase": item.phase.value})

    def _observe_decode(self, item: WorkItem, first: float, end: float, tokens: int) -> None:
        """Decode of a FULL or DECODE item: `tokens` generated between `first` and `end`."""
        m = self.metrics
        m.phase.labels("decode").observe(end - first)
        if tokens > 0:
            m.tpot.labels("observed").observe((end - first) / tokens)
        p = item.placement.predicted_tpot_s
        if p:
            m.tpot.labels("predicted").observe(p / self.cfg.mesh.time_scale)
        if self.tracing:
            self._span("decode", first, end, **{"hetmesh.decode_tokens": tokens})

    def _span(self, name: str, start: float, end: float, **attrs: str | int | float) -> None:
        """A finished child of the current span (the work item's), from time.time() stamps."""
        span = self.tracer.start_span(name, start_time=telemetry.s_to_ns(start),
                                      attributes={"hetmesh.worker_id": self.worker_id, **attrs})
        span.end(end_time=telemetry.s_to_ns(end))

    # ------------------------------------------------------------------ helpers
    async def _event(self, request_id: str, kind: str, **detail: str | int | float | bool | None) -> None:
        detail["worker_id"] = self.worker_id
        self.events.add(ServiceEvent(service="worker", instance=self.worker_id, request_id=request_id, kind=kind,
                                     ts=time.time(), detail=detail))

    def _chunk(self, rid: str, out: EngineOutput, cached_tokens: int) -> TokenChunk:
        """An engine output as a TokenChunk; the last one carries the request's usage."""
        usage = None
        if out.finished:
            usage = Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                          cached_tokens=cached_tokens)
        return TokenChunk(request_id=rid, worker_id=self.worker_id, index=out.index, token_ids=out.token_ids,
                          text=out.text, finish_reason=out.finish_reason, usage=usage)

    async def _send(self, subject: str, msg: msgspec.Struct) -> None:
        # Per-request traffic goes without headers: the request id is in every body, and header
        # encoding plus trace-context injection would cost more CPU than the message itself.
        data = _enc.encode(msg)
        if type(msg) is TokenChunk:  # kept, to be sent again if the stream gets a hole (on_resume)
            self.replay.add(subject, msg.index, len(msg.token_ids), data)
        await self.bus.nc.publish(subject, data)

    async def on_resume(self, r: Resume, _m: Msg) -> None:
        """A gateway lost part of a stream (a bus gap): publish what this worker sent on it again."""
        for data in self.replay.since(r.reply_subject, r.from_index):
            await self.bus.nc.publish(r.reply_subject, data)

    async def _error(self, item: WorkItem, message: str, *, retryable: bool, status: int = 500,
                     code: str | None = None, etype: str = "server_error") -> None:
        rid = item.request.request_id
        await self._send(item.request.reply_subject, RequestError(
            request_id=rid, error=ErrorInfo(message=message, type=etype, code=code, status=status),
            retryable=retryable))
        await self._event(rid, "error", phase=item.phase.value, message=message, retryable=retryable)

    async def _finished(self, rid: str, reason: str, completion_tokens: int) -> None:
        self.finished_out.add(Finished(request_id=rid, worker_id=self.worker_id, finish_reason=reason, ts=time.time(),
                                       completion_tokens=completion_tokens))

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
                await self._event(item.request.request_id, "duplicate_work", phase=item.phase.value,
                                  attempt=item.request.attempt, deliveries=m.metadata.num_delivered)
        except Exception:
            log.exception("taking work item %s failed", m.subject)
        finally:
            with contextlib.suppress(Exception):
                await m.ack()

    async def on_work(self, item: WorkItem, m: Msg) -> None:
        rid = item.request.request_id
        received = time.time()
        if self.draining:
            await self._error(item, f"worker {self.worker_id} is shutting down", retryable=True, status=503)
            return
        if rid in self.tasks and not await self._supersede(item):
            log.warning("duplicate work item for %s ignored", rid)
            return
        if item.request.model != self.group.model:
            await self._error(item, f"worker {self.worker_id} serves {self.group.model!r}, not "
                              f"{item.request.model!r}", retryable=True, status=500, code="misrouted")
            await self._finished(rid, "error", 0)
            return
        if self.early_cancels.pop(rid, None) is not None:
            await self._event(rid, "aborted", phase=item.phase.value, completion_tokens=0, before_start=True)
            await self._finished(rid, "abort", 0)
            return
        ctx = telemetry.extract(m.headers) if self.tracing else Context()
        serve = self._serve_decode if item.phase == Phase.DECODE else self._serve_compute
        if item.phase == Phase.DECODE:
            # Register before yielding: the KvLanded may already be on its way.
            fut: asyncio.Future[KvLanded] = asyncio.get_running_loop().create_future()
            self.decodes[rid] = _Decode(item, fut)
            early = self.early_landed.pop(rid, None)
            if early is not None:
                fut.set_result(early[0])
        elif not await self._submit(item, self._engine_request(item)):
            # Submitted here rather than in the task: one event-loop hop less before the prefill starts.
            self.metrics.requests.labels(item.phase.value, "error").inc()
            return
        self.received[rid] = received
        task = asyncio.create_task(self._traced(serve, item, ctx), name=f"req-{rid}")
        self.tasks[rid] = task
        self.attempts[rid] = item.request.attempt
        task.add_done_callback(lambda t, rid=rid: self._done(rid, t))
        await self._event(rid, "accepted", phase=item.phase.value, role=self.role.value,
                          prompt_tokens=len(item.request.prompt_tokens), attempt=item.request.attempt)

    def _done(self, rid: str, task: asyncio.Task[None]) -> None:
        if self.tasks.get(rid) is not task:  # a newer attempt already took the id over
            return
        del self.tasks[rid]
        self.received.pop(rid, None)
        self.attempts.pop(rid, None)
        self.decodes.pop(rid, None)
        self.cancelled.discard(rid)
        self.superseded.discard(rid)

    async def _supersede(self, item: WorkItem) -> bool:
        """A newer attempt of a request this worker still holds (e.g. its other half's worker died and
        the gateway resubmitted): drop the old one quietly so that the new one can take the id."""
        rid = item.request.request_id
        if item.request.attempt <= self.attempts.get(rid, 0):
            return False
        task = self.tasks[rid]
        self.superseded.add(rid)
        d = self.decodes.get(rid)
        if d is not None and not d.future.done():
            task.cancel()
        else:
            await self.engine.abort(rid)
        await asyncio.wait([task], timeout=5.0)
        return rid not in self.tasks

    async def _traced(self, serve: Any, item: WorkItem, ctx: Context) -> None:
        if not self.tracing:
            try:
                await serve(item)
            except Exception as exc:
                log.exception("serving %s failed", item.request.request_id)
                with contextlib.suppress(Exception):
                    await self._error(item, f"worker {self.worker_id} failed: {exc}", retryable=False)
                    await self._finished(item.request.request_id, "error", 0)
            return
        span = self.tracer.start_span(f"worker.{item.phase.value}", context=ctx, attributes={
            "hetmesh.request_id": item.request.request_id, "hetmesh.worker_id": self.worker_id,
            "hetmesh.prompt_tokens": len(item.request.prompt_tokens)})
        with trace.use_span(span, end_on_exit=True):
            try:
                await serve(item)
            except Exception as exc:  # never leave the client hanging
                log.exception("serving %s failed", item.request.request_id)
                span.record_exception(exc)
                with contextlib.suppress(Exception):
                    await self._error(item, f"worker {self.worker_id} failed: {exc}", retryable=False)
                    await self._finished(item.request.request_id, "error", 0)

    def _engine_request(self, item: WorkItem, first: list[int] | None = None) -> EngineRequest:
        r = item.request
        return EngineRequest(request_id=r.request_id, prompt_tokens=r.prompt_tokens, block_hashes=r.block_hashes,
                             sampling=r.sampling, phase=item.phase, first_token_ids=first or [])

    async def _submit(self, item: WorkItem, er: EngineRequest) -> bool:
        try:
            await self.engine.submit(er)
            return True
        except EngineError as exc:
            await self._error(item, str(exc), retryable=False, status=400, etype="invalid_request_error")
            await self._finished(er.request_id, "error", 0)
            return False

    async def _on_abort(self, item: WorkItem, out: EngineOutput, streamed: int) -> None:
        rid = item.request.request_id
        if rid in self.superseded:
            await self._event(rid, "superseded", phase=item.phase.value, attempt=item.request.attempt)
            return
        if out.finish_reason == "error":
            await self._error(item, f"engine on {self.worker_id} failed", retryable=streamed == 0)
            await self._finished(rid, "error", out.completion_tokens)
            return
        if rid in self.cancelled:
            await self._event(rid, "aborted", phase=item.phase.value, completion_tokens=out.completion_tokens)
        else:  # aborted by shutdown, not by the client
            await self._error(item, f"worker {self.worker_id} shut down", retryable=streamed == 0, status=503)
        await self._finished(rid, "abort", out.completion_tokens)

    # ------------------------------------------------------------------ FULL and PREFILL
    async def _serve_compute(self, item: WorkItem) -> None:
        req = item.request
        rid = req.request_id
        streamed = 0
        last: EngineOutput | None = None
        start = self.received.get(rid, time.time())  # the engine took it in on_work
        first = 0.0
        async for out in self.engine.stream(rid):  # submitted by on_work
            last = out
            if out.finish_reason in ("abort", "error"):
                await self._on_abort(item, out, streamed)
                return
            if not first:
                first = time.time()
                self._observe_first(item, start, first, out.queued_s)
            if out.finished and item.phase == Phase.PREFILL:
                break
            await self._send(req.reply_subject, self._chunk(rid, out, out.cached_tokens))
            streamed += len(out.token_ids)
        assert last is not None and last.finished
        self.metrics.requests.labels(item.phase.value, last.finish_reason or "prefill_done").inc()
        if item.phase == Phase.FULL:
            self._observe_decode(item, first, time.time(), last.completion_tokens - 1)
            await self._event(rid, "decode_done", phase="full", completion_tokens=last.completion_tokens,
                              finish_reason=last.finish_reason, cached_tokens=last.cached_tokens)
            await self._finished(rid, last.finish_reason or "stop", last.completion_tokens)
            return
        await self._prefill_handoff(item, last)

    async def _prefill_handoff(self, item: WorkItem, out: EngineOutput) -> None:
        req = item.request
        rid = req.request_id
        usage = None
        if out.finish_reason is not None:  # e.g. max_tokens == 1: the decode side has nothing left to add
            usage = Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                          cached_tokens=out.cached_tokens)
        await self._send(req.reply_subject, TokenChunk(
            request_id=rid, worker_id=self.worker_id, index=out.index, token_ids=out.token_ids, text=out.text,
            finish_reason=out.finish_reason, usage=usage))
        await self._event(rid, "prefill_done", phase="prefill", prompt_tokens=out.prompt_tokens,
                          cached_tokens=out.cached_tokens, first_tokens=len(out.token_ids),
                          finish_reason=out.finish_reason, decode_worker=item.placement.decode_worker)
        # Ship the KV even when prefill already finished the request, so the decode side ends cleanly.
        await self._transfer(item, out)
        await self._finished(rid, out.finish_reason or "prefill_done", out.completion_tokens)

    async def _transfer(self, item: WorkItem, out: EngineOutput) -> None:
        req = item.request
        rid = req.request_id
        dst = item.placement.decode_worker
        kvc = self.cfg.kv_transfer
        # A real engine (vLLM) hands over its KV cache's bytes; the sim engine's are only a size.
        data = self.engine.take_kv(rid) if self.engine.real_kv else None
        if data is not None:
            nbytes = len(data)
        else:
            nbytes = self.cost.kv_bytes_per_token() * len(req.prompt_tokens)
            if kvc.max_wire_bytes > 0:
                nbytes = min(nbytes, kvc.max_wire_bytes)
        # NATS refuses messages over the server's max_payload (1 MiB by default), headers included.
        chunk = max(1, min(kvc.chunk_bytes, self.bus.nc.max_payload - KV_HEADER_ROOM))
        treq = KvTransferRequest(
            transfer_id=f"{rid}.{uuid.uuid4().hex[:8]}", request_id=rid, model=req.model, src_worker=self.worker_id,
            dst_worker=dst, num_tokens=len(req.prompt_tokens), nbytes=nbytes, chunk_bytes=chunk,
            first_token_ids=out.token_ids, first_text=out.text, cached_tokens=out.cached_tokens)
        t0 = time.perf_counter()
        span = trace.INVALID_SPAN
        if self.tracing:  # the kv-transfer service's span becomes this one's child (bus.request injects it)
            span = self.tracer.start_span("kv_send", attributes={
                "hetmesh.transfer_id": treq.transfer_id, "hetmesh.dst": dst, "hetmesh.nbytes": nbytes,
                "hetmesh.chunk_bytes": chunk})
        try:
            with trace.use_span(span, end_on_exit=True):
                accept = await self.bus.request(subjects.KV_TRANSFER, treq, KvTransferAccept, KV_ACCEPT_TIMEOUT_S,
                                                rid)
                if self.engine.real_kv and data is None:
                    raise EngineError(f"engine left no KV for {rid}")
                if accept.endpoint:
                    chunks = 1
                    span.set_attribute("hetmesh.endpoint", accept.endpoint)
                    await self._stream_kv(accept.endpoint, treq, data, t0)
                else:
                    chunks = await self._send_kv(accept.data_subject, nbytes, chunk, data)
                span.set_attribute("hetmesh.chunks", chunks)
        except Exception as exc:
            # Tell the decode worker right away instead of letting it wait for its timeout.
            msg = f"KV transfer {self.worker_id} -> {dst} failed: {exc!r}"
            log.warning("%s", msg)
            await self.bus.publish(subjects.kv_landed(dst), KvLanded.of(
                treq, duration_s=time.perf_counter() - t0, ok=False, error=msg), rid)
            await self._event(rid, "kv_failed", phase="prefill", dst=dst, message=msg)
            return
        self.kv_bytes_sent += nbytes
        self.metrics.kv_transfer_seconds.observe(time.perf_counter() - t0)
        await self._event(rid, "kv_sent", phase="prefill", transfer_id=treq.transfer_id, dst=dst, nbytes=nbytes,
                          chunks=chunks, chunk_bytes=chunk, duration_s=time.perf_counter() - t0,
                          direct=bool(accept.endpoint))

    async def _stream_kv(self, endpoint: str, treq: KvTransferRequest, data: bytes | memoryview | None,
                         t0: float) -> None:
        """The direct data plane: the bytes go to the decode worker's KV port; kv-transfer hears how it went."""
        kvc = self.cfg.kv_transfer
        try:
            await kvstream.send(endpoint, treq, data, kvc.stream_idle_timeout_s, kvc.secret.encode())
        except Exception as exc:
            await self._kv_done(treq, t0, repr(exc))
            raise
        await self._kv_done(treq, t0, None)

    async def _kv_done(self, treq: KvTransferRequest, t0: float, error: str | None) -> None:
        await self.bus.publish(subjects.KV_DONE, KvTransferDone(
            transfer_id=treq.transfer_id, request_id=treq.request_id, nbytes=0 if error else treq.nbytes,
            duration_s=time.perf_counter() - t0, ok=error is None, error=error), treq.request_id)

    async def _send_kv(self, subject: str, nbytes: int, chunk: int, kv: bytes | None = None) -> int:
        """Put nbytes of KV on the wire in chunks: the engine's own bytes, or (sim) zeros of the real size."""
        if kv is None and len(self._zeros) < chunk:
            self._zeros = bytes(chunk)
        view = memoryview(kv) if kv is not None else None
        nc = self.bus.nc
        seq = sent = since_flush = 0
        while True:
            n = min(chunk, nbytes - sent)
            last = sent + n >= nbytes
            if view is not None:
                data = view[sent:sent + n]
            else:
                data = self._zeros if n == len(self._zeros) else self._zeros[:n]
            await nc.publish(subject, data, headers={"Kv-Seq": str(seq), "Kv-Last": "1" if last else "0"})
            seq += 1
            sent += n
            since_flush += n
            if last:
                break
            if since_flush >= KV_FLUSH_EVERY:
                await nc.flush(timeout=30)
                since_flush = 0
        await nc.flush(timeout=30)
        return seq

    # ------------------------------------------------------------------ DECODE
    async def _serve_decode(self, item: WorkItem) -> None:
        req = item.request
        rid = req.request_id
        d = self.decodes[rid]
        try:
            landed = await asyncio.wait_for(d.future, self.kv_landed_timeout_s)
        except TimeoutError:
            landed = KvLanded(transfer_id="", request_id=rid, src_worker="", nbytes=0, chunks=0, duration_s=0.0,
                              first_token_ids=[], ok=False,
                              error=f"KV did not land within {self.kv_landed_timeout_s:g}s")
        except asyncio.CancelledError:
            if rid in self.superseded:
                return
            if rid not in self.cancelled:
                raise
            await self._event(rid, "aborted", phase="decode", completion_tokens=0, waiting_for_kv=True)
            await self._finished(rid, "abort", 0)
            return
        except EngineError as exc:  # shutdown while waiting
            await self._error(item, str(exc), retryable=False, status=503)
            await self._finished(rid, "error", 0)
            return
        finally:
            self.decodes.pop(rid, None)
        if not landed.ok:
            local = await self._prefill_locally(item, landed.error or "KV transfer failed")
            if local is None:
                return
            landed = local
        received = await self._received(landed) if landed.transfer_id else 0
        sink = self.kv_sinks.pop(landed.transfer_id, None) if landed.direct else None
        if sink is not None:
            sink.commit()  # the engine takes the streamed KV as it lies
        elif self.engine.real_kv and landed.transfer_id:
            kv = self.recv_data.pop(landed.transfer_id, None)
            if kv is None or received != landed.nbytes or kv[1] != landed.chunks:
                local = await self._prefill_locally(item, f"KV arrived incomplete ({received} of {landed.nbytes} bytes)")
                if local is None:
                    return
                landed = local
            else:
                self.engine.put_kv(rid, b"".join(kv[0]))
        if rid in self.cancelled:  # cancelled between landing and submit
            await self._event(rid, "aborted", phase="decode", completion_tokens=0)
            await self._finished(rid, "abort", 0)
            return
        await self._event(rid, "kv_landed", phase="decode", transfer_id=landed.transfer_id, src=landed.src_worker,
                          nbytes=landed.nbytes, bytes_received=received, chunks=landed.chunks,
                          duration_s=landed.duration_s)
        landed_at = time.time()
        waited = landed_at - self.received.get(rid, landed_at)
        self.metrics.phase.labels("kv_wait").observe(waited)
        if self.tracing:
            self._span("kv_wait", landed_at - waited, landed_at, **{
                "hetmesh.transfer_id": landed.transfer_id, "hetmesh.src": landed.src_worker,
                "hetmesh.nbytes": landed.nbytes, "hetmesh.kv_transfer_s": landed.duration_s})
        first = list(landed.first_token_ids)
        if not await self._submit(item, self._engine_request(item, first)):
            return
        streamed = 0
        last: EngineOutput | None = None
        async for out in self.engine.stream(rid):
            last = out
            if out.finish_reason in ("abort", "error"):
                await self._on_abort(item, out, streamed)
                return
            if out.finished and not out.token_ids and out.completion_tokens == len(first):
                break  # the first tokens already ended it and the prefill worker told the client
            # The prefix hit happened on the prefill side; the decode engine saw the KV land instead.
            await self._send(req.reply_subject, self._chunk(rid, out, landed.cached_tokens))
            streamed += len(out.token_ids)
        assert last is not None and last.finished
        self.metrics.requests.labels("decode", last.finish_reason or "stop").inc()
        self._observe_decode(item, landed_at, time.time(), last.completion_tokens - len(first))
        await self._event(rid, "decode_done", phase="decode", completion_tokens=last.completion_tokens,
                          finish_reason=last.finish_reason, cached_tokens=landed.cached_tokens)
        await self._finished(rid, last.finish_reason or "stop", last.completion_tokens)

    async def _prefill_locally(self, item: WorkItem, why: str) -> KvLanded | None:
        """The KV never arrived (kv-transfer died, the transfer failed or timed out): compute the prefill
        here instead and continue as if it had landed. The first token is the same one the prefill worker
        sent (deterministic for the request); sending it again is harmless, the gateway drops duplicates.
        None when the request is over (finished here, failed, or cancelled)."""
        req = item.request
        rid = req.request_id
        await self._event(rid, "kv_fallback", phase="decode", reason=why)
        log.warning("request %s: %s; prefilling locally on %s", rid, why, self.worker_id)
        pre = WorkItem(request=req, phase=Phase.PREFILL, placement=item.placement)
        if rid in self.cancelled or not await self._submit(pre, self._engine_request(pre)):
            return None
        last: EngineOutput | None = None
        async for out in self.engine.stream(rid):
            last = out
            if out.finish_reason in ("abort", "error"):
                await self._on_abort(item, out, 0)
                return None
            if out.finished:
                break
        assert last is not None
        usage = None
        if last.finish_reason is not None:
            usage = Usage(prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens,
                          cached_tokens=last.cached_tokens)
        await self._send(req.reply_subject, TokenChunk(
            request_id=rid, worker_id=self.worker_id, index=last.index, token_ids=last.token_ids, text=last.text,
            finish_reason=last.finish_reason, usage=usage))
        if last.finish_reason is not None:
            await self._event(rid, "decode_done", phase="decode", completion_tokens=last.completion_tokens,
                              finish_reason=last.finish_reason, cached_tokens=last.cached_tokens, local_prefill=True)
            await self._finished(rid, last.finish_reason, last.completion_tokens)
            return None
        if self.engine.real_kv:  # the local prefill's KV: the decode below loads it like a landed one
            kv = self.engine.take_kv(rid)
            if kv is not None:
                self.engine.put_kv(rid, kv)
        return KvLanded(transfer_id="", request_id=rid, src_worker=self.worker_id, nbytes=0, chunks=0, duration_s=0.0,
                        first_token_ids=last.token_ids, first_text=last.text, cached_tokens=last.cached_tokens)

    async def _received(self, landed: KvLanded) -> int:
        """Bytes seen on kv_recv for this transfer; the relay's chunks may still sit in their subscription queue."""
        deadline = time.monotonic() + 2.0
        while True:
            got = self.recv.get(landed.transfer_id)
            n = int(got[0]) if got else 0
            if n >= landed.nbytes or time.monotonic() > deadline:
                self.recv.pop(landed.transfer_id, None)
                return n
            await asyncio.sleep(0.002)

    async def on_kv_landed(self, landed: KvLanded, _m: Msg) -> None:
        self._landed(landed)

    def _open_sink(self, header: KvTransferRequest) -> kvstream.KvSink:
        if self.draining:
            raise ValueError("worker draining")
        return self.engine.kv_sink(header.request_id, header.nbytes)

    async def _stream_landed(self, header: KvTransferRequest, sink: kvstream.KvSink, seconds: float) -> None:
        tid = header.transfer_id
        self.kv_sinks[tid] = sink
        self.recv[tid] = [float(header.nbytes), 1.0, time.monotonic()]
        self.kv_bytes_received += header.nbytes
        self._landed(KvLanded.of(header, nbytes=header.nbytes, chunks=1, duration_s=seconds, direct=True))

    async def _stream_failed(self, header: KvTransferRequest, why: str) -> None:
        self._landed(KvLanded.of(header, ok=False, error=why))

    def _landed(self, landed: KvLanded) -> None:
        d = self.decodes.get(landed.request_id)
        if d is not None and not d.future.done():
            d.future.set_result(landed)
            return
        if len(self.early_landed) >= EARLY_LANDED_MAX:
            self.early_landed.pop(next(iter(self.early_landed)))
        self.early_landed[landed.request_id] = (landed, time.monotonic())

    async def on_kv_recv(self, m: Msg) -> None:
        tid = (m.headers or {}).get("Kv-Transfer", "")
        e = self.recv.get(tid)
        if e is None:
            e = self.recv[tid] = [0, 0, 0.0]
        e[0] += len(m.data)
        e[1] += 1
        e[2] = time.monotonic()
        self.kv_bytes_received += len(m.data)
        if self.engine.real_kv:  # keep the bytes (in order: one relay publishes them on one subject)
            d = self.recv_data.get(tid)
            if d is None:
                d = self.recv_data[tid] = ([], 0)
            if int((m.headers or {}).get("Kv-Seq", "-1")) == d[1]:
                d[0].append(m.data)
                self.recv_data[tid] = (d[0], d[1] + 1)

    # ------------------------------------------------------------------ cancel
    async def on_cancel(self, c: Cancel, _m: Msg) -> None:
        rid = c.request_id
        task = self.tasks.get(rid)
        if task is None:
            # Every worker sees every Cancel; remember a few in case this one's WorkItem is still in flight.
            if len(self.early_cancels) >= EARLY_LANDED_MAX:
                self.early_cancels.pop(next(iter(self.early_cancels)))
            self.early_cancels[rid] = time.monotonic()
            return
        self.cancelled.add(rid)
        d = self.decodes.get(rid)
        if d is not None and not d.future.done():
            task.cancel()  # still waiting for KV: nothing in the engine yet
            return
        await self.engine.abort(rid)

    # ------------------------------------------------------------------ heartbeats and KV events
    async def _heartbeat(self) -> None:
        s = self.engine.stats()
        g = self.group
        await self.bus.publish(subjects.heartbeat(self.worker_id), Heartbeat(
            worker_id=self.worker_id, model=g.model, accelerator=g.accelerator, vendor=g.vendor, devices=g.devices,
            role=self.role, engine=self.engine.name, work_subject=self.work_subject,
            queue_depth=s.waiting + len(self.decodes), running=s.running, max_batch=s.max_batch,
            kv_blocks_total=s.kv_blocks_total, kv_blocks_used=s.kv_blocks_used, block_size=s.block_size,
            ts=time.time(), tokens_generated=s.tokens_generated, prompt_tokens_computed=s.prompt_tokens_computed,
            prompt_tokens_cached=s.prompt_tokens_cached, aborted=s.aborted,
            kv_endpoint=self.kv_port.endpoint if self.kv_port is not None else ""))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.mesh.heartbeat_interval_s)
            try:
                await self._heartbeat()
                self._sweep()
            except Exception:
                log.exception("heartbeat failed")

    def _sweep(self) -> None:
        now = time.monotonic()
        for tid in [t for t, e in self.recv.items() if now - e[2] > STALE_S]:
            del self.recv[tid]
            self.recv_data.pop(tid, None)
            sink = self.kv_sinks.pop(tid, None)
            if sink is not None:  # streamed in for a decode that never came
                sink.discard()
        for rid in [r for r, (_, ts) in self.early_landed.items() if now - ts > STALE_S]:
            del self.early_landed[rid]
        for rid in [r for r, ts in self.early_cancels.items() if now - ts > STALE_S]:
            del self.early_cancels[rid]

    async def _publish_kv_events(self, force_cleared: bool = False) -> None:
        b = self.engine.kv_events()
        if b.cleared:
            self.kv_held.clear()
        self.kv_held.difference_update(b.removed)
        self.kv_held.update(b.stored)
        if b or force_cleared:
            await self.bus.publish(subjects.kv_events(self.worker_id), KvEvent(
                worker_id=self.worker_id, model=self.group.model, stored=b.stored, removed=b.removed,
                cleared=b.cleared or force_cleared, ts=time.time()))

    async def on_kv_resync(self, r: KvResync, _m: Msg) -> None:
        """The prefix index was lost (e.g. Redis restarted): publish everything the cache holds."""
        await self._publish_kv_events()  # bring kv_held up to date first
        held = list(self.kv_held)
        for i in range(0, max(len(held), 1), RESYNC_BATCH):
            await self.bus.publish(subjects.kv_events(self.worker_id), KvEvent(
                worker_id=self.worker_id, model=self.group.model, stored=held[i:i + RESYNC_BATCH], cleared=i == 0,
                ts=time.time()))
        await self._event("", "kv_resynced", blocks=len(held), reason=r.reason)

    async def _kv_event_loop(self) -> None:
        while True:
            await asyncio.sleep(KV_EVENT_PERIOD_S)
            try:
                await self._publish_kv_events()
            except Exception:
                log.exception("publishing KV events failed")


def main(default_role: Role | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hetmesh.worker", description=__doc__)
    ap.add_argument("--cluster", help="cluster file (TOML)")
    ap.add_argument("--worker-id", required=True, help="<worker group name>-<index>, e.g. h100-0")
    ap.add_argument("--role", choices=[r.value for r in Role], default=default_role.value if default_role else None,
                    help="override the worker group's role")
    ap.add_argument("--kv-landed-timeout-s", type=float,
                    default=float(os.environ.get("HETMESH_KV_LANDED_TIMEOUT_S", "30")),
                    help="a DECODE item whose KV has not landed by then ends with an error")
    ap.add_argument("--drain-timeout-s", type=float, default=10.0)
    args = ap.parse_args()
    cfg = config.load(args.cluster)
    run_service(lambda: Worker(cfg, args.worker_id, Role(args.role) if args.role else None,
                               args.kv_landed_timeout_s, args.drain_timeout_s))
