"""What a worker tells the mesh about its requests: token chunks and errors to the gateway, Finished
records to the scheduler, ServiceEvents to whoever listens."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import msgspec

from hetmesh import subjects
from hetmesh.bus import Batcher, Bus, EventBatcher
from hetmesh.engines.base import EngineOutput, EngineStats
from hetmesh.placement.state import progress
from hetmesh.protocol import (
    ErrorInfo,
    Finished,
    RequestError,
    Resume,
    ServiceEvent,
    TokenChunk,
    Usage,
    Working,
    WorkItem,
)

from .replay import ReplayLog
from .requests import Request

_enc = msgspec.json.Encoder()

Detail = str | int | float | bool | None


class Outbox:
    def __init__(self, bus: Bus, worker_id: str, replay: ReplayLog) -> None:
        self.bus = bus
        self.worker_id = worker_id
        self.replay = replay
        self.events = EventBatcher(bus, "worker")
        # Batched: only the scheduler's bookkeeping reads them.
        self.finished_out = Batcher(bus, subjects.FINISHED)

    async def close(self) -> None:
        await self.events.close()
        await self.finished_out.close()

    def event(self, request_id: str, kind: str, **detail: Detail) -> None:
        detail["worker_id"] = self.worker_id
        self.events.add(ServiceEvent(service="worker", instance=self.worker_id, request_id=request_id, kind=kind,
                                     ts=time.time(), detail=detail))

    def finished(self, request_id: str, reason: str, completion_tokens: int, attempt: int = 0) -> None:
        self.finished_out.add(Finished(request_id=request_id, worker_id=self.worker_id, finish_reason=reason,
                                       ts=time.time(), completion_tokens=completion_tokens, attempt=attempt))

    def chunk(self, request_id: str, out: EngineOutput, cached_tokens: int) -> TokenChunk:
        """An engine output as a TokenChunk; the last one carries the request's usage."""
        return self._chunk(request_id, out, cached_tokens, out.finished)

    def first_chunk(self, request_id: str, out: EngineOutput) -> TokenChunk:
        """A finished prefill's first token(s): with usage only when they already end the request
        (e.g. max_tokens == 1); otherwise the decode side continues and has the last word."""
        return self._chunk(request_id, out, out.cached_tokens, out.finish_reason is not None)

    def _chunk(self, request_id: str, out: EngineOutput, cached_tokens: int, last: bool) -> TokenChunk:
        usage = None
        if last:
            usage = Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                          cached_tokens=cached_tokens)
        return TokenChunk(request_id=request_id, worker_id=self.worker_id, index=out.index, token_ids=out.token_ids,
                          text=out.text, finish_reason=out.finish_reason, usage=usage, logprobs=out.logprobs)

    async def send(self, subject: str, msg: msgspec.Struct) -> None:
        # Per-request traffic goes without headers: the request id is in every body, and header
        # encoding plus trace-context injection would cost more CPU than the message itself.
        data = _enc.encode(msg)
        if type(msg) is TokenChunk:  # kept, to be sent again if the stream gets a hole (resend)
            self.replay.add(subject, msg.index, len(msg.token_ids), data, time.monotonic())
        await self.bus.nc.publish(subject, data)

    async def resend(self, r: Resume) -> None:
        """A gateway lost part of a stream (a bus gap): publish what this worker sent on it again."""
        for data in self.replay.since(r.reply_subject, r.from_index):
            await self.bus.nc.publish(r.reply_subject, data)

    async def resend_recent(self, since: float) -> None:
        """This worker's connection went down: publish again the streams it published on since `since` (monotonic),
        whose last chunks may have gone down with it; each gateway's reassembler drops what it already has."""
        for subject, data in self.replay.recent(since):
            await self.bus.nc.publish(subject, data)

    async def error(self, item: WorkItem, message: str, *, retryable: bool, status: int = 500,
                    code: str | None = None, etype: str = "server_error") -> None:
        rid = item.request.request_id
        await self.send(item.request.reply_subject, RequestError(
            request_id=rid, error=ErrorInfo(message=message, type=etype, code=code, status=status),
            retryable=retryable))
        self.event(rid, "error", phase=item.phase.value, message=message, retryable=retryable)

    async def working(self, held: Iterable[Request[Any]], s: EngineStats,
                      last: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
        """Tell the gateway of each request `held` with no token from this worker yet that it is not stalled,
        if the engine moved since the last time (or runs nothing: the request waits for its KV or a slot). A
        wedged engine sends none, and the gateway's stall timeout ends its requests. `s`: the stats the
        heartbeat just sent; `last`: the counters at the last round. Returns the counters now."""
        counters = progress(s)
        if counters != last or s.running == 0:
            for r in held:
                subject = r.item.request.reply_subject
                if not (r.cancelled or r.superseded) and subject not in self.replay:
                    await self.send(subject, Working(request_id=r.request_id, worker_id=self.worker_id))
        return counters
