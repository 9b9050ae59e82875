"""The prefill side of a disaggregated request: ship the KV of a finished prefill to its decode worker.

Direct data plane: the decode worker's KV port comes with the placement, so the bytes go there at
once over TCP (hetmesh.kvstream); kv-transfer hears of it beside the stream (a notice before, the
outcome on `hetmesh.kv.done` after) and keeps the records. Without an endpoint in the placement the
worker asks kv-transfer first (request/reply), which names the port or a relay subject.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from opentelemetry import trace

from hetmesh import kvstream, metrics, subjects
from hetmesh.bus import Bus
from hetmesh.config import KvTransferConfig
from hetmesh.engines.base import Engine, EngineError, EngineOutput
from hetmesh.protocol import KvLanded, KvTransferAccept, KvTransferDone, KvTransferRequest, WorkItem

from . import kv
from .outbox import Outbox

log = logging.getLogger("hetmesh.worker")

KV_ACCEPT_TIMEOUT_S = 5.0
KV_FLUSH_EVERY = 16 << 20  # flush the connection every this many relayed bytes: bounded client buffer


class KvShipper:
    def __init__(self, cfg: KvTransferConfig, bus: Bus, worker_id: str, engine: Engine, kv_bytes_per_token: int,
                 outbox: Outbox, worker_metrics: metrics.WorkerMetrics, tracer: trace.Tracer, tracing: bool) -> None:
        self.cfg = cfg
        self.bus = bus
        self.worker_id = worker_id
        self.engine = engine
        self.kv_bytes_per_token = kv_bytes_per_token
        self.outbox = outbox
        self.metrics = worker_metrics
        self.tracer = tracer
        self.tracing = tracing
        self.bytes_sent = 0
        self._zeros = b""

    async def ship(self, item: WorkItem, out: EngineOutput) -> None:
        """Never raises: a failed transfer tells the decode worker at once (it then prefills locally)."""
        req = item.request
        rid = req.request_id
        dst = item.placement.decode_worker
        # A real engine (vLLM) hands over its KV cache's bytes; the sim engine's are only a size.
        data = self.engine.take_kv(rid) if self.engine.real_kv else None
        if self.engine.real_kv and data is None and out.kv_transfer_params:
            await self._hand_over(item, out)
            return
        nbytes = len(data) if data is not None else kv.wire_bytes(
            self.kv_bytes_per_token, len(req.prompt_tokens), self.cfg.max_wire_bytes)
        chunk = kv.chunk_size(self.cfg.chunk_bytes, self.bus.nc.max_payload)
        endpoint = kv.direct_endpoint(item.placement, self.cfg.data_plane)
        treq = kv.transfer_request(item, out, self.worker_id, kv.transfer_id(rid, uuid.uuid4().hex[:8]), nbytes,
                                   chunk, endpoint)
        t0 = time.perf_counter()
        span = trace.INVALID_SPAN
        if self.tracing:  # the kv-transfer service's span becomes this one's child (the bus injects it)
            span = self.tracer.start_span("kv_send", attributes={
                "hetmesh.transfer_id": treq.transfer_id, "hetmesh.dst": dst, "hetmesh.nbytes": nbytes,
                "hetmesh.chunk_bytes": chunk})
        try:
            with trace.use_span(span, end_on_exit=True):
                if self.engine.real_kv and data is None:  # before kv-transfer opens a record that never closes
                    raise EngineError(f"engine left no KV for {rid}")
                if endpoint:
                    # Not waited for: kv-transfer only opens its record, which our KvTransferDone closes.
                    await self.bus.publish(subjects.KV_TRANSFER, treq, rid)
                else:
                    accept = await self.bus.request(subjects.KV_TRANSFER, treq, KvTransferAccept,
                                                    KV_ACCEPT_TIMEOUT_S, rid)
                    endpoint = accept.endpoint
                if endpoint:
                    chunks = 1
                    span.set_attribute("hetmesh.endpoint", endpoint)
                    await self._stream(endpoint, treq, data, t0)
                else:
                    chunks = await self._publish_chunks(accept.data_subject, nbytes, chunk, data)
                span.set_attribute("hetmesh.chunks", chunks)
        except Exception as exc:
            # Tell the decode worker right away instead of letting it wait for its timeout.
            msg = f"KV transfer {self.worker_id} -> {dst} failed: {exc!r}"
            log.warning("%s", msg)
            await self.bus.publish(subjects.kv_landed(dst), KvLanded.of(
                treq, duration_s=time.perf_counter() - t0, ok=False, error=msg), rid)
            self.outbox.event(rid, "kv_failed", phase="prefill", dst=dst, message=msg)
            return
        self.bytes_sent += nbytes
        self.metrics.kv_transfer_seconds.observe(time.perf_counter() - t0)
        self.outbox.event(rid, "kv_sent", phase="prefill", transfer_id=treq.transfer_id, dst=dst, nbytes=nbytes,
                          chunks=chunks, chunk_bytes=chunk, duration_s=time.perf_counter() - t0,
                          direct=bool(endpoint))

    async def _hand_over(self, item: WorkItem, out: EngineOutput) -> None:
        """The engine's connector moves the KV itself (NIXL: the decode engine reads the blocks the params name):
        only vLLM's hand-over goes to the decode worker, as a KvLanded of no bytes."""
        rid = item.request.request_id
        dst = item.placement.decode_worker
        treq = kv.transfer_request(item, out, self.worker_id, kv.transfer_id(rid, uuid.uuid4().hex[:8]), 0, 0)
        await self.bus.publish(subjects.kv_landed(dst), KvLanded.of(treq), rid)
        self.outbox.event(rid, "kv_handed_over", phase="prefill", transfer_id=treq.transfer_id, dst=dst)

    async def _stream(self, endpoint: str, treq: KvTransferRequest, data: bytes | memoryview | None,
                      t0: float) -> None:
        """The direct data plane: the bytes go to the decode worker's KV port; kv-transfer hears how it went."""
        try:
            await kvstream.send(endpoint, treq, data, self.cfg.stream_idle_timeout_s, self.cfg.secret.encode())
        except asyncio.CancelledError:  # the request was cancelled: the socket is closed, the receiver drops it
            await self._done(treq, t0, "cancelled")
            raise
        except Exception as exc:
            await self._done(treq, t0, repr(exc))
            raise
        await self._done(treq, t0, None)

    async def _done(self, treq: KvTransferRequest, t0: float, error: str | None) -> None:
        await self.bus.publish(subjects.KV_DONE, KvTransferDone(
            transfer_id=treq.transfer_id, request_id=treq.request_id, nbytes=0 if error else treq.nbytes,
            duration_s=time.perf_counter() - t0, ok=error is None, error=error), treq.request_id)

    async def _publish_chunks(self, subject: str, nbytes: int, chunk: int, data: bytes | memoryview | None) -> int:
        """The relay: nbytes of KV on NATS in chunks, the engine's own bytes or (sim) zeros of the real size."""
        if data is None and len(self._zeros) < chunk:
            self._zeros = bytes(chunk)
        view = memoryview(data) if data is not None else None
        nc = self.bus.nc
        seq = sent = since_flush = 0
        while True:
            n = min(chunk, nbytes - sent)
            last = sent + n >= nbytes
            if view is not None:
                piece = view[sent:sent + n]
            else:
                piece = self._zeros if n == len(self._zeros) else self._zeros[:n]
            await nc.publish(subject, piece, headers={"Kv-Seq": str(seq), "Kv-Last": "1" if last else "0"})
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
