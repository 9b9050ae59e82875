"""Serving one WorkItem once the worker took it: FULL and PREFILL stream from the engine (PREFILL ends
by shipping the KV), DECODE waits for its KV to land, then continues the same completion."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from hetmesh import kvstream, metrics, subjects, telemetry
from hetmesh.engines.base import Engine, EngineError, EngineOutput, EngineRequest
from hetmesh.protocol import Cancel, KvLanded, Phase, WorkItem

from .kv import KvInbox
from .outbox import Outbox
from .requests import Request, RequestBook
from .transfer import KvShipper

log = logging.getLogger("hetmesh.worker")

GAPS = 64  # first-token gaps a heartbeat carries at most
RELAY_GRACE_S = 2.0  # relayed chunks may still sit in their subscription's queue when KvLanded arrives


@dataclass(slots=True)
class Run:
    """The asyncio side of a request the worker holds (its RequestBook handle)."""

    task: asyncio.Task[None] | None = None
    kv: asyncio.Future[KvLanded] | None = None  # DECODE: resolved when the KV landed (or failed to)


class Phases:
    def __init__(self, worker_id: str, engine: Engine, book: RequestBook[Run], inbox: KvInbox[kvstream.KvSink],
                 outbox: Outbox, shipper: KvShipper, worker_metrics: metrics.WorkerMetrics, tracer: trace.Tracer,
                 tracing: bool, time_scale: float, kv_landed_timeout_s: float) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.book = book
        self.inbox = inbox
        self.out = outbox
        self.shipper = shipper
        self.metrics = worker_metrics
        self.tracer = tracer
        self.tracing = tracing
        self.time_scale = time_scale
        self.kv_landed_timeout_s = kv_landed_timeout_s
        self.gaps: list[float] = []  # first-token gaps (engine seconds) since the last heartbeat, the newest GAPS

    # ------------------------------------------------------------------ engine calls
    @staticmethod
    def engine_request(item: WorkItem, first: list[int] | None = None,
                       kv_transfer_params: dict[str, Any] | None = None) -> EngineRequest:
        r = item.request
        return EngineRequest(request_id=r.request_id, prompt_tokens=r.prompt_tokens, block_hashes=r.block_hashes,
                             sampling=r.sampling, phase=item.phase, first_token_ids=first or [],
                             continued=r.continued, kv_transfer_params=kv_transfer_params, priority=r.priority)

    async def submit(self, item: WorkItem, er: EngineRequest) -> bool:
        try:
            await self.engine.submit(er)
            return True
        except EngineError as exc:
            await self.out.error(item, str(exc), retryable=False, status=400, etype="invalid_request_error")
            self.out.finished(er.request_id, "error", 0)
            return False

    async def on_abort(self, r: Request[Run], out: EngineOutput, streamed: int) -> None:
        item = r.item
        rid = r.request_id
        if r.superseded:
            self.out.event(rid, "superseded", phase=item.phase.value, attempt=r.attempt)
            return
        if r.withdrawn and item.phase != Phase.DECODE:
            await self.withdrawn(item)
            return
        # Retryable even with tokens out: the gateway goes on from its last token on another worker (migration).
        if out.finish_reason == "error":
            await self.out.error(item, f"engine on {self.worker_id} failed", retryable=True)
            self.out.finished(rid, "error", out.completion_tokens)
            return
        if r.cancelled:
            self._aborted(r, completion_tokens=out.completion_tokens)
            return
        # aborted by shutdown (a drain that ran out of time), not by the client
        await self.out.error(item, f"worker {self.worker_id} shut down", retryable=True, status=503,
                             code="worker_draining")
        self.out.event(rid, "handed_over", phase=item.phase.value, completion_tokens=out.completion_tokens,
                       streamed=streamed)
        self.out.finished(rid, "abort", out.completion_tokens)

    def _aborted(self, r: Request[Run], **detail: int | bool) -> None:
        """Cancelled: the client went away, or (a DECODE half) its placement was withdrawn, which the scheduler
        un-counted already (Finished "withdrawn")."""
        kind, reason = ("withdrawn", "withdrawn") if r.withdrawn else ("aborted", "abort")
        self.out.event(r.request_id, kind, phase=r.item.phase.value, **detail)
        self.out.finished(r.request_id, reason, int(detail.get("completion_tokens", 0)), r.attempt)

    async def withdrawn(self, item: WorkItem) -> None:
        """Its scheduler took the placement back before the engine started it (hetmesh.placement.withdrawal):
        the DECODE half of a P/D placement is cancelled on its worker, and the gateway places the request anew
        (a retryable error that uses up none of its attempts)."""
        req, p = item.request, item.placement
        rid = req.request_id
        if item.phase == Phase.DECODE:  # the DECODE half, whose Cancel came first: its prefill worker told the gateway
            self.out.event(rid, "withdrawn", phase=item.phase.value, attempt=req.attempt, before_start=True)
            self.out.finished(rid, "withdrawn", 0, req.attempt)
            return
        if item.phase == Phase.PREFILL:
            await self.out.bus.publish(subjects.CANCEL, Cancel(request_id=rid, reason="withdrawn",
                                                               worker_id=p.decode_worker, phase=Phase.DECODE,
                                                               attempt=req.attempt), rid)
        await self.out.error(item, f"its placement on {self.worker_id} was withdrawn by its scheduler", retryable=True,
                             status=503, code="withdrawn")
        self.out.event(rid, "withdrawn", phase=item.phase.value, attempt=req.attempt)
        self.out.finished(rid, "withdrawn", 0, req.attempt)

    # ------------------------------------------------------------------ FULL and PREFILL
    async def serve_compute(self, r: Request[Run]) -> None:
        item = r.item
        req = item.request
        rid = req.request_id
        streamed = 0
        last: EngineOutput | None = None
        start = r.received  # the engine took it in on_work
        first = 0.0
        busy = self.engine.stats().busy_s
        async for out in self.engine.stream(rid):  # submitted by on_work
            last = out
            if out.finish_reason in ("abort", "error"):
                await self.on_abort(r, out, streamed)
                return
            if not first:
                first = time.time()
                self._observe_first(item, start, first, out.queued_s)
                busy_now = self.engine.stats().busy_s
                if busy or busy_now:  # an engine that counts its step time
                    self._gap(first - start - (busy_now - busy))
            if out.finished and item.phase == Phase.PREFILL:
                break
            await self.out.send(req.reply_subject, self.out.chunk(rid, out, out.cached_tokens))
            streamed += len(out.token_ids)
        assert last is not None and last.finished
        self.metrics.requests.labels(item.phase.value, last.finish_reason or "prefill_done").inc()
        if item.phase == Phase.FULL:
            end, tokens = time.time(), last.completion_tokens - req.continued - 1
            self._observe_decode(item, first, end, tokens)
            self.out.event(rid, "decode_done", phase="full", completion_tokens=last.completion_tokens,
                           finish_reason=last.finish_reason, cached_tokens=last.cached_tokens,
                           **self._versus(item, ttft_s=first - start, tpot_s=(end - first) / tokens if tokens > 0 else None))
            self.out.finished(rid, last.finish_reason or "stop", last.completion_tokens)
            return
        r.shipping = True  # from here a Cancel stops the task (and so the KV stream), not the engine
        await self._prefill_handoff(item, last, first - start)

    async def _prefill_handoff(self, item: WorkItem, out: EngineOutput, ttft_s: float) -> None:
        req = item.request
        rid = req.request_id
        await self.out.send(req.reply_subject, self.out.first_chunk(rid, out))
        self.out.event(rid, "prefill_done", phase="prefill", prompt_tokens=out.prompt_tokens,
                       cached_tokens=out.cached_tokens, first_tokens=len(out.token_ids),
                       finish_reason=out.finish_reason, decode_worker=item.placement.decode_worker,
                       **self._versus(item, ttft_s=ttft_s))
        # nats-py only buffers the chunk; its flusher task writes it once this one yields. Yield now: a direct
        # KV stream may connect and write without ever yielding, and the first token would wait behind the KV.
        await asyncio.sleep(0)
        # Ship the KV even when prefill already finished the request, so the decode side ends cleanly.
        try:
            await self.shipper.ship(item, out)
        finally:  # also when a Cancel or the drain stopped the stream: the scheduler's record of it ends
            self.out.finished(rid, out.finish_reason or "prefill_done", out.completion_tokens)

    # ------------------------------------------------------------------ DECODE
    async def serve_decode(self, r: Request[Run]) -> None:
        item = r.item
        req = item.request
        rid = req.request_id
        assert r.handle.kv is not None
        try:
            landed = await asyncio.wait_for(r.handle.kv, self.kv_landed_timeout_s)
        except TimeoutError:
            landed = KvLanded(transfer_id="", request_id=rid, src_worker="", nbytes=0, chunks=0, duration_s=0.0,
                              first_token_ids=[], ok=False,
                              error=f"KV did not land within {self.kv_landed_timeout_s:g}s")
        except asyncio.CancelledError:
            if r.superseded:
                return
            if not r.cancelled:
                raise
            self._aborted(r, completion_tokens=0, waiting_for_kv=True)
            return
        except EngineError as exc:  # shutdown while waiting: another worker takes it over
            await self.out.error(item, str(exc), retryable=True, status=503, code="worker_draining")
            self.out.finished(rid, "error", 0)
            return
        finally:
            self.book.kv_wait_over(r)
        if not landed.ok:
            local = await self._prefill_locally(r, landed.error or "KV transfer failed")
            if local is None:
                return
            landed = local
        if landed.transfer_id and not landed.direct:
            await self._relay_settled(landed)
        claim = self.inbox.claim(landed)
        if r.cancelled:  # cancelled as the KV landed: the sink (vLLM: its spool file) goes, not into the engine
            if claim.sink is not None:
                claim.sink.discard()
            self._aborted(r, completion_tokens=0)
            return
        if claim.sink is not None:
            claim.sink.commit()  # the engine takes the streamed KV as it lies
        elif claim.problem is not None:
            local = await self._prefill_locally(r, claim.problem)
            if local is None:
                return
            landed = local
        elif claim.data is not None:
            self.engine.put_kv(rid, claim.data)
        if r.cancelled:  # cancelled between landing and submit
            self._aborted(r, completion_tokens=0)
            return
        self.out.event(rid, "kv_landed", phase="decode", transfer_id=landed.transfer_id, src=landed.src_worker,
                       nbytes=landed.nbytes, bytes_received=claim.received, chunks=landed.chunks,
                       duration_s=landed.duration_s)
        landed_at = time.time()
        waited = landed_at - r.received
        self.metrics.phase.labels("kv_wait").observe(waited)
        if self.tracing:
            self._span("kv_wait", landed_at - waited, landed_at, **{
                "hetmesh.transfer_id": landed.transfer_id, "hetmesh.src": landed.src_worker,
                "hetmesh.nbytes": landed.nbytes, "hetmesh.kv_transfer_s": landed.duration_s})
        first = list(landed.first_token_ids)
        if not await self.submit(item, self.engine_request(item, first, landed.kv_transfer_params)):
            return
        streamed = 0
        last: EngineOutput | None = None
        async for out in self.engine.stream(rid):
            last = out
            if out.finish_reason in ("abort", "error"):
                await self.on_abort(r, out, streamed)
                return
            if out.finished and not out.token_ids and out.completion_tokens == req.continued + len(first):
                break  # the first tokens already ended it and the prefill worker told the client
            # The prefix hit happened on the prefill side; the decode engine saw the KV land instead.
            await self.out.send(req.reply_subject, self.out.chunk(rid, out, landed.cached_tokens))
            streamed += len(out.token_ids)
        assert last is not None and last.finished
        self.metrics.requests.labels("decode", last.finish_reason or "stop").inc()
        end, tokens = time.time(), last.completion_tokens - req.continued - len(first)
        self._observe_decode(item, landed_at, end, tokens)
        self.out.event(rid, "decode_done", phase="decode", completion_tokens=last.completion_tokens,
                       finish_reason=last.finish_reason, cached_tokens=landed.cached_tokens,
                       **self._versus(item, tpot_s=(end - landed_at) / tokens if tokens > 0 else None))
        self.out.finished(rid, last.finish_reason or "stop", last.completion_tokens)

    async def _relay_settled(self, landed: KvLanded) -> None:
        """KvLanded from the relay may overtake its last chunks (they sit in another subscription's queue)."""
        deadline = time.monotonic() + RELAY_GRACE_S
        while True:
            if self.inbox.bytes_seen(landed.transfer_id) >= landed.nbytes or time.monotonic() > deadline:
                return
            await asyncio.sleep(0.002)

    async def _prefill_locally(self, r: Request[Run], why: str) -> KvLanded | None:
        """The KV never arrived (kv-transfer died, the transfer failed or timed out): compute the prefill
        here instead and continue as if it had landed. The first token is the same one the prefill worker
        sent (deterministic for the request); sending it again is harmless, the gateway drops duplicates.
        None when the request is over (finished here, failed, or cancelled)."""
        item = r.item
        req = item.request
        rid = req.request_id
        self.out.event(rid, "kv_fallback", phase="decode", reason=why)
        log.warning("request %s: %s; prefilling locally on %s", rid, why, self.worker_id)
        pre = WorkItem(request=req, phase=Phase.PREFILL, placement=item.placement)
        if r.cancelled or not await self.submit(pre, self.engine_request(pre)):
            return None
        last: EngineOutput | None = None
        async for out in self.engine.stream(rid):
            last = out
            if out.finish_reason in ("abort", "error"):
                await self.on_abort(r, out, 0)
                return None
            if out.finished:
                break
        assert last is not None
        await self.out.send(req.reply_subject, self.out.first_chunk(rid, last))
        if last.finish_reason is not None:
            self.out.event(rid, "decode_done", phase="decode", completion_tokens=last.completion_tokens,
                           finish_reason=last.finish_reason, cached_tokens=last.cached_tokens, local_prefill=True)
            self.out.finished(rid, last.finish_reason, last.completion_tokens)
            return None
        handover = None
        if self.engine.real_kv:  # the local prefill's KV: the decode below loads it like a landed one
            kv = self.engine.take_kv(rid)
            if kv is not None:
                self.engine.put_kv(rid, kv)
                handover = last.kv_transfer_params
        return KvLanded(transfer_id="", request_id=rid, src_worker=self.worker_id, nbytes=0, chunks=0, duration_s=0.0,
                        first_token_ids=last.token_ids, first_text=last.text, cached_tokens=last.cached_tokens,
                        kv_transfer_params=handover)

    # ------------------------------------------------------------------ metrics and spans
    def _observe_first(self, item: WorkItem, start: float, first: float, queued_s: float) -> None:
        """Queue wait and prefill of a FULL or PREFILL item (start: its arrival; first: its first token)."""
        m = self.metrics
        queued_s = min(queued_s, first - start)
        m.phase.labels("queue").observe(queued_s)
        m.phase.labels("prefill").observe(first - start - queued_s)
        m.ttft.labels("observed").observe(first - start)
        p = item.placement.predicted_ttft_s
        if p is not None:
            m.ttft.labels("predicted").observe(p / self.time_scale)
        if self.tracing:
            self._span("queue_wait", start, start + queued_s)
            self._span("prefill", start + queued_s, first, **{"hetmesh.phase": item.phase.value})

    def _gap(self, wall_s: float) -> None:
        """A request's time to first token outside the engine's steps (the heartbeat carries it)."""
        self.gaps.append(max(wall_s, 0.0) * self.time_scale)
        del self.gaps[:-GAPS]

    def _versus(self, item: WorkItem, ttft_s: float | None = None, tpot_s: float | None = None) -> dict[str, float | None]:
        """What the cost model predicted for this work item beside what happened (wall seconds), for the per-request
        record on the bus."""
        pl, out = item.placement, {}
        if ttft_s is not None:
            out["ttft_s"] = round(ttft_s, 6)
            out["predicted_ttft_s"] = round(pl.predicted_ttft_s / self.time_scale, 6) if pl.predicted_ttft_s else None
        if tpot_s is not None:
            out["tpot_s"] = round(tpot_s, 6)
            out["predicted_tpot_s"] = round(pl.predicted_tpot_s / self.time_scale, 6) if pl.predicted_tpot_s else None
        return out

    def _observe_decode(self, item: WorkItem, first: float, end: float, tokens: int) -> None:
        """Decode of a FULL or DECODE item: `tokens` generated between `first` and `end`."""
        m = self.metrics
        m.phase.labels("decode").observe(end - first)
        if tokens > 0:
            m.tpot.labels("observed").observe((end - first) / tokens)
        p = item.placement.predicted_tpot_s
        if p:
            m.tpot.labels("predicted").observe(p / self.time_scale)
        if self.tracing:
            self._span("decode", first, end, **{"hetmesh.decode_tokens": tokens})

    def _span(self, name: str, start: float, end: float, **attrs: str | int | float) -> None:
        """A finished child of the current span (the work item's), from time.time() stamps."""
        span = self.tracer.start_span(name, start_time=telemetry.s_to_ns(start),
                                      attributes={"hetmesh.worker_id": self.worker_id, **attrs})
        span.end(end_time=telemetry.s_to_ns(end))
