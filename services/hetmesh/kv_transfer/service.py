"""kv-transfer: moves a request's KV cache from its prefill worker to its decode worker.

Direct data plane (the default): the decode worker's KV port usually comes with the placement, and
the prefill worker streams the bytes there over TCP (hetmesh.kvstream) at once; its KvTransferRequest
(with `endpoint` set) is then a notice that opens the record here, unanswered. Without one (an older
scheduler) it asks, and this service answers with the endpoint it knows from the heartbeats. Either
way the prefill worker reports the outcome on `hetmesh.kv.done`, which ends the record.

Relay (`kv_transfer.data_plane = "nats"`, or a decode worker with no KV port): subscribe the
transfer's data subject, accept, relay every chunk to the decode worker's receive subject as it
arrives (nothing is buffered, so memory stays bounded by NATS' per-subscription limits), check
that every byte and every sequence number arrived, then tell the decode worker with KvLanded.
Replicas share requests as a queue group.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque

from msgspec import Struct
from nats.aio.msg import Msg
from opentelemetry import trace

from hetmesh import config, metrics, subjects, telemetry
from hetmesh.bus import Bus, EventBatcher, encode_error
from hetmesh.protocol import (
    Cancel,
    Heartbeat,
    KvLanded,
    KvTransferAccept,
    KvTransferDone,
    KvTransferRequest,
    ServiceEvent,
)
from hetmesh.runtime import run_service

log = logging.getLogger("hetmesh.kv_transfer")

EARLY_DONE_MAX = 10_000
EARLY_DONE_S = 30.0  # a notice and its outcome arrive on two subscriptions: the outcome may be handled first


class TransferRecord(Struct, kw_only=True):
    transfer_id: str
    request_id: str
    src: str
    dst: str
    nbytes: int
    chunks: int
    duration_s: float
    ok: bool
    error: str | None = None
    direct: bool = False


class _Transfer:
    __slots__ = ("bytes", "chunks", "direct", "done", "error", "last_seen", "req", "started")

    def __init__(self, req: KvTransferRequest, direct: bool) -> None:
        self.req = req
        self.direct = direct
        self.bytes = 0
        self.chunks = 0
        self.error: str | None = None
        self.done = asyncio.Event()
        self.started = self.last_seen = time.monotonic()


class KvTransferService:
    def __init__(self, cfg: config.ClusterConfig, instance: str, idle_timeout_s: float = 10.0,
                 max_concurrent: int = 512, history: int = 1000) -> None:
        self.cfg = cfg
        self.instance = instance
        self.idle_timeout_s = idle_timeout_s
        self.max_concurrent = max_concurrent
        self.active: dict[str, _Transfer] = {}  # transfer id ->
        self.endpoints: dict[str, str] = {}  # worker id -> its KV port, from heartbeats
        # Outcomes of direct streams whose notice is not handled yet (or that another replica records).
        self.early_done: dict[str, tuple[KvTransferDone, float]] = {}
        self.records: deque[TransferRecord] = deque(maxlen=history)
        self.total_bytes = 0
        self.total_transfers = 0
        self.tracer = telemetry.setup("kv-transfer", instance)
        self.metrics = metrics.KvTransferMetrics()
        self.http: metrics.MetricsServer | None = None
        self.started = False
        self.bus: Bus
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.bus = await Bus.for_mesh(self.cfg.mesh, f"kv-transfer-{self.instance}")
        await self.bus.subscribe(subjects.KV_TRANSFER, KvTransferRequest, self.on_request,
                                 queue=subjects.KV_TRANSFER_QUEUE)
        await self.bus.subscribe(subjects.CANCEL, Cancel, self.on_cancel)
        if self.cfg.kv_transfer.data_plane == "direct":
            await self.bus.subscribe(subjects.HEARTBEAT_ALL, Heartbeat, self.on_heartbeat)
            await self.bus.subscribe(subjects.KV_DONE, KvTransferDone, self.on_done)
        self.events = EventBatcher(self.bus, "kv-transfer")
        await self.bus.nc.flush()
        self.started = True
        self.http = metrics.serve_from_env(self.metrics.registry, self._ready)
        log.info("kv-transfer %s up", self.instance)

    def _ready(self) -> dict[str, object]:
        return {"ready": self.started and self.bus.nc.is_connected, "instance": self.instance,
                "active": len(self.active)}

    async def stop(self) -> None:
        if self.http is not None:
            self.http.close()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.idle_timeout_s)
        await self.events.close()
        await self.bus.close()

    async def on_request(self, req: KvTransferRequest, m: Msg) -> None:
        if len(self.active) >= self.max_concurrent or req.transfer_id in self.active:
            why = (f"transfer {req.transfer_id} already in progress" if req.transfer_id in self.active
                   else f"kv-transfer {self.instance} busy: {len(self.active)} transfers")
            if m.reply:
                await m.respond(encode_error(why))
            else:  # a notice: the stream goes on regardless, only this record is lost
                log.warning("not recording transfer %s: %s", req.transfer_id, why)
            return
        # A notice names the endpoint the source already streams to; a question gets the one we know.
        endpoint = req.endpoint or self.endpoints.get(req.dst_worker, "")
        t = _Transfer(req, direct=bool(endpoint))
        self.active[req.transfer_id] = t
        self.metrics.active.inc()
        sub = None
        data_subject = ""
        if not endpoint:
            data_subject = subjects.kv_data(req.transfer_id)
            sub = await self.bus.nc.subscribe(data_subject, cb=self._relay(t), pending_msgs_limit=100_000,
                                              pending_bytes_limit=512 << 20)
        task = asyncio.create_task(self._finish(t, sub, telemetry.extract(m.headers)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        early = self.early_done.pop(req.transfer_id, None)
        if early is not None:
            self._close(t, early[0])
        if m.reply:
            await self.bus.respond(m, KvTransferAccept(transfer_id=req.transfer_id, data_subject=data_subject,
                                                       endpoint=endpoint))

    async def on_heartbeat(self, hb: Heartbeat, _m: Msg) -> None:
        if hb.kv_endpoint:
            self.endpoints[hb.worker_id] = hb.kv_endpoint
        else:
            self.endpoints.pop(hb.worker_id, None)

    async def on_done(self, d: KvTransferDone, _m: Msg) -> None:
        t = self.active.get(d.transfer_id)
        if t is None:
            self._keep_early(d)
            return
        self._close(t, d)

    def _close(self, t: _Transfer, d: KvTransferDone) -> None:
        if t.done.is_set():
            return
        t.bytes, t.chunks, t.last_seen = d.nbytes, 1 if d.ok else 0, time.monotonic()
        if not d.ok:
            t.error = d.error or "stream failed"
        t.done.set()

    def _keep_early(self, d: KvTransferDone) -> None:
        """An outcome with no record (yet): its notice waits behind another callback, or another replica
        took it. Kept briefly, oldest dropped first (insertion order is arrival order)."""
        now = time.monotonic()
        early = self.early_done
        while early:
            oldest = next(iter(early))
            if len(early) < EARLY_DONE_MAX and now - early[oldest][1] < EARLY_DONE_S:
                break
            del early[oldest]
        early[d.transfer_id] = (d, now)

    def _relay(self, t: _Transfer):  # type: ignore[no-untyped-def]
        recv = subjects.kv_recv(t.req.dst_worker)
        tid = t.req.transfer_id
        nc = self.bus.nc

        async def cb(m: Msg) -> None:
            if t.done.is_set():
                return
            h = m.headers or {}
            seq = int(h.get("Kv-Seq", "-1"))
            if seq != t.chunks and t.error is None:
                t.error = f"chunk {t.chunks} missing (got seq {seq})"
            t.chunks += 1
            t.bytes += len(m.data)
            t.last_seen = time.monotonic()
            last = h.get("Kv-Last") == "1"
            await nc.publish(recv, m.data, headers={"Kv-Transfer": tid, "Kv-Seq": str(seq),
                                                    "Kv-Last": "1" if last else "0"})
            if last:
                t.done.set()

        return cb

    async def _finish(self, t: _Transfer, sub: object | None, ctx: object) -> None:
        req = t.req
        span = self.tracer.start_span("kv_transfer", context=ctx, attributes={  # type: ignore[arg-type]
            "hetmesh.request_id": req.request_id, "hetmesh.transfer_id": req.transfer_id,
            "hetmesh.src": req.src_worker, "hetmesh.dst": req.dst_worker, "hetmesh.nbytes": req.nbytes,
            "hetmesh.direct": t.direct})
        try:
            # An idle timeout rather than a total one: a large transfer on a slow link is fine while it moves.
            # A direct stream shows no progress here; the prefill worker's own stream timeout bounds it.
            idle = self.idle_timeout_s * (6 if t.direct else 1)
            while not t.done.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(t.done.wait(), idle)
                if not t.done.is_set() and time.monotonic() - t.last_seen >= idle:
                    t.error = t.error or (f"timed out after {idle:g}s idle with {t.bytes} of "
                                          f"{req.nbytes} bytes in {t.chunks} chunks")
                    break
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()  # type: ignore[attr-defined]
            if t.error is None and t.bytes != req.nbytes:
                t.error = f"byte count mismatch: got {t.bytes}, expected {req.nbytes}"
            duration = time.monotonic() - t.started
            ok = t.error is None
            if not t.direct:  # a direct stream's receiver already knows; the relay tells it here
                # Flush the relayed chunks before KvLanded so they are ahead of it on the wire.
                await self.bus.nc.flush(timeout=30)
                await self.bus.publish(subjects.kv_landed(req.dst_worker), KvLanded.of(
                    req, nbytes=t.bytes, chunks=t.chunks, duration_s=duration, ok=ok, error=t.error), req.request_id)
            rec = TransferRecord(transfer_id=req.transfer_id, request_id=req.request_id, src=req.src_worker,
                                 dst=req.dst_worker, nbytes=t.bytes, chunks=t.chunks, duration_s=duration, ok=ok,
                                 error=t.error, direct=t.direct)
            self.records.append(rec)
            self.total_transfers += 1
            self.total_bytes += t.bytes
            if not ok:
                log.warning("transfer %s failed: %s", req.transfer_id, t.error)
            self.events.add(ServiceEvent(
                service="kv-transfer", instance=self.instance, request_id=req.request_id, kind="kv_transferred",
                ts=time.time(), detail={"transfer_id": req.transfer_id, "src": req.src_worker, "dst": req.dst_worker,
                                        "nbytes": t.bytes, "expected_nbytes": req.nbytes, "chunks": t.chunks,
                                        "duration_s": duration, "num_tokens": req.num_tokens, "ok": ok,
                                        "error": t.error, "direct": t.direct,
                                        "bytes_per_s": t.bytes / duration if duration > 0 else 0.0}))
            m = self.metrics
            m.transfers.labels("ok" if ok else "failed").inc()
            m.bytes.inc(t.bytes)
            m.seconds.observe(duration)
            m.size.observe(t.bytes)
            span.set_attribute("hetmesh.ok", ok)
            span.set_attribute("hetmesh.bytes_relayed", t.bytes)
            span.set_attribute("hetmesh.chunks", t.chunks)
            span.set_attribute("hetmesh.duration_s", duration)
            if not ok:
                span.set_status(trace.Status(trace.StatusCode.ERROR, t.error or "failed"))
        finally:
            span.end()
            self.active.pop(req.transfer_id, None)
            self.metrics.active.dec()

    async def on_cancel(self, c: Cancel, _m: Msg) -> None:
        for t in self.active.values():
            if t.req.request_id == c.request_id and not t.done.is_set() and (
                    not c.worker_id or c.worker_id in (t.req.src_worker, t.req.dst_worker)):
                t.error = f"cancelled: {c.reason}"
                t.done.set()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m hetmesh.kv_transfer", description=__doc__)
    ap.add_argument("--cluster", help="cluster file (TOML)")
    ap.add_argument("--instance", default=f"kvx-{uuid.uuid4().hex[:6]}")
    ap.add_argument("--idle-timeout-s", type=float, default=10.0,
                    help="a transfer with no chunk for this long fails (KvLanded ok=False)")
    args = ap.parse_args()
    cfg = config.load(args.cluster)
    run_service(lambda: KvTransferService(cfg, args.instance, args.idle_timeout_s))
