"""One request's life in the gateway (`Call`): submit, wait on the reply inbox, retry, cancel, close.

What to do with each message and each clock reading is decided by the pure `stream.ReplyStream`;
`Call` only awaits the inbox and carries its actions out (publish a Resume or a Cancel, submit a
retry, poll the client, hand chunks or the error to the response). The process-wide parts (the bus,
the inbox routing, admission, telemetry) are its `Host`'s: `service.Gateway`, which this module does
not import.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, Protocol

import msgspec
import nats.errors
from fastapi import Request
from opentelemetry import trace
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from hetmesh import config, metrics
from hetmesh.bus import REQUEST_ID, Bus, decode, encode
from hetmesh.kvindex.blocks import block_hashes
from hetmesh.protocol import ErrorInfo, InferenceRequest, Placement, SubmitReply, TokenChunk, Usage

from . import core
from .auth import Verdict
from .core import Formatter, Prepared
from .responses import JSON, ClientGone, SseBody, error_response
from .stream import POLL_CLIENT, Fail, ReplyStream, Retry, SendResume, Wait


class Host(Protocol):
    """What a Call uses of its gateway (service.Gateway)."""

    cfg: config.ClusterConfig
    bus: Bus | None
    inboxes: dict[str, Inbox]  # reply-subject key -> the inbox its messages go to
    reply_prefix: str
    active: int  # Calls in flight: each counts itself from construction to close()
    tracing: bool
    tracer: trace.Tracer
    metrics: metrics.GatewayMetrics

    def event(self, rid: str, kind: str, **detail: str | int | float | bool | None) -> None: ...

    def cancel(self, rid: str, reason: str) -> None: ...

    def resume(self, reply_subject: str, from_index: int) -> None: ...

    def charge_completion(self, v: Verdict, completion_tokens: int) -> None: ...


class Inbox:
    """A per-request mailbox: a deque plus at most one waiter. Cheaper than asyncio.Queue + wait_for."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: object) -> None:
        self.items.append(item)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, timeout_s: float) -> None:
        """Return when something is in the box or `timeout_s` passed."""
        if self.items:
            return
        loop = asyncio.get_running_loop()
        fut = self.waiter = loop.create_future()
        timer = loop.call_later(timeout_s, _wake, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self.waiter = None


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Call:
    """One request's life in the gateway: submit, consume the reply stream, retry, cancel."""

    def __init__(self, gw: Host, rid: str, model: config.ModelConfig, prep: Prepared, request: Request,
                 verdict: Verdict | None = None, span: trace.Span = trace.INVALID_SPAN) -> None:
        gw.active += 1  # until close()
        self.verdict = verdict or Verdict()
        self.gw = gw
        self.rid = rid
        self.prep = prep
        self.request = request
        self.t0 = time.perf_counter()
        self.model = model
        self.req = InferenceRequest(
            request_id=rid, model=model.name, prompt_tokens=prep.prompt_tokens,
            block_hashes=block_hashes(model.name, prep.prompt_tokens, model.block_size),
            sampling=prep.sampling, reply_subject="", arrival_ts=time.time(), priority=prep.priority,
            tenant=self.verdict.tenant)
        self.box = Inbox()
        self.key = ""
        mesh = gw.cfg.mesh
        # The reply stream's bookkeeping (order, retries, resumes, stalls); this class only carries it out.
        self.stream = ReplyStream(mesh.max_attempts, mesh.stall_timeout_s, asyncio.get_running_loop().time(),
                                  mesh.migration_limit)
        self.migrated_at: float | None = None  # a migration waits for its first new token since then
        self.last_token_at = self.t0
        self.placement: Placement | None = None
        self.closed = False
        self.first_token_at: float | None = None
        self.status = 200  # what the client got; counted in close()
        self.span = span
        self.stream_span: trace.Span = trace.INVALID_SPAN
        if span.is_recording():
            span.set_attribute("hetmesh.request_id", rid)
            span.set_attribute("hetmesh.prompt_tokens", len(prep.prompt_tokens))

    # --- the mesh side ----------------------------------------------------------------------
    async def submit(self) -> ErrorInfo | None:
        gw = self.gw
        assert gw.bus is not None
        self.key = f"{self.rid}-{self.req.attempt}"
        self.req.reply_subject = gw.reply_prefix + self.key  # == subjects.reply_to(instance, key); key is token-safe
        gw.inboxes[self.key] = self.box  # before submitting: the first token may beat the reply
        try:
            try:
                reply = await self._request_placement()
            except nats.errors.NoRespondersError:
                # No scheduler subscribed (e.g. restarting): wait for one, with backoff, for a bounded time.
                gw.event(self.rid, "waiting_for_scheduler")
                async for attempt in AsyncRetrying(
                        retry=retry_if_exception_type(nats.errors.NoRespondersError), reraise=True,
                        wait=wait_exponential(multiplier=0.05, max=1.0),
                        stop=stop_after_delay(gw.cfg.gateway.scheduler_wait_s)):
                    with attempt:
                        reply = await self._request_placement()
        except (nats.errors.TimeoutError, TimeoutError):
            # A slow scheduler may still place it: make sure no worker keeps generating for nobody.
            gw.cancel(self.rid, "submit_timeout")
            return ErrorInfo(message="the scheduler did not answer", type="server_error",
                             code="scheduler_unavailable", status=503)
        except nats.errors.NoRespondersError:
            return ErrorInfo(message="no scheduler is running", type="server_error",
                             code="scheduler_unavailable", status=503, retry_after_s=gw.cfg.gateway.retry_after_s)
        except msgspec.DecodeError as exc:
            return ErrorInfo(message=f"the scheduler sent an unreadable reply: {exc}", type="server_error",
                             code="bad_scheduler_reply", status=502)
        except nats.errors.Error as exc:
            return ErrorInfo(message=f"the mesh is unreachable: {exc}", type="server_error",
                             code="service_unavailable", status=503)
        if reply.error is not None:
            return reply.error
        self.placement = reply.placement
        if reply.placement is not None:
            p = reply.placement
            gw.event(self.rid, "placed", mode=p.mode, decode_worker=p.decode_worker, prefill_worker=p.prefill_worker,
                     attempt=self.req.attempt)
        return None

    async def _request_placement(self) -> SubmitReply:
        gw = self.gw
        assert gw.bus is not None
        nc = gw.bus.nc

        def lost(scheduler: str) -> None:  # it died holding this request: another one places it
            gw.event(self.rid, "scheduler_lost", scheduler=scheduler, attempt=self.req.attempt)

        return await gw.schedulers.submit(self._request_on, lambda: nc.is_connected, lost)

    async def _request_on(self, subject: str) -> SubmitReply:
        gw = self.gw
        assert gw.bus is not None
        timeout_s = gw.cfg.gateway.submit_timeout_s
        if gw.tracing:
            with trace.use_span(self.span, end_on_exit=False):  # bus.request injects this span's context
                return await gw.bus.request(subject, self.req, SubmitReply, timeout_s=timeout_s, request_id=self.rid)
        # No trace to carry: skip the propagators' work.
        resp = await gw.bus.nc.request(subject, encode(self.req), timeout=timeout_s, headers={REQUEST_ID: self.rid})
        return decode(resp.data, SubmitReply)

    async def retry(self, act: Retry) -> ErrorInfo | None:
        self.gw.inboxes.pop(self.key, None)
        self.box.items.clear()  # the old attempt's leftovers
        req = self.req
        req.attempt = act.attempt
        req.moved = req.moved or act.reason == "withdrawn"
        lost = act.lost_worker
        gone = [lost]
        if act.exclude_placed and self.placement is not None:
            gone += [self.placement.decode_worker, self.placement.prefill_worker]
        for w in gone:
            if w and w not in req.exclude_workers:
                req.exclude_workers.append(w)
        gen = act.generated
        if gen:
            # Migration: the prompt plus the tokens so far (the new worker's prefix cache and the index find the
            # prompt's blocks), max_tokens less what came, the sampler's stream advanced past them (the engine's).
            prompt = self.prep.prompt_tokens
            req.prompt_tokens = [*prompt, *gen]
            req.continued = len(gen)
            req.block_hashes = block_hashes(self.model.name, req.prompt_tokens, self.model.block_size)
            req.sampling = msgspec.structs.replace(self.prep.sampling,
                                                   max_tokens=self.prep.sampling.max_tokens - len(gen))
            self.migrated_at = time.perf_counter()
            self.gw.metrics.migrations.labels(req.model, act.reason).inc()
            self.gw.event(self.rid, "migrated", attempt=act.attempt, lost_worker=lost, reason=act.reason,
                          from_index=len(gen), migrations=self.stream.migrations)
        else:
            self.gw.event(self.rid, "retried", attempt=act.attempt, lost_worker=lost, reason=act.reason)
        err = await self.submit()
        if err is None:  # placed: the stall clock starts again
            self.stream.progress(asyncio.get_running_loop().time())
        return err

    async def pull(self) -> list[TokenChunk] | ErrorInfo:
        """The next chunks in completion order (never empty), or the error that ends the request.

        Raises ClientGone when the client disconnected. Retries happen in here, invisibly.
        The decisions are `self.stream`'s; this loop only waits and carries them out.
        """
        s = self.stream
        if s.failure is not None:  # the chunks before it went out with the last pull
            return s.failure
        loop = asyncio.get_running_loop()
        items = self.box.items
        s.progress(loop.time())
        while True:
            while items:
                act = s.receive(items.popleft())
                if act is None:
                    continue
                if type(act) is Fail:  # from a message: the mesh ended it, nothing to cancel
                    if not s.ready:
                        return act.error
                    break  # the tokens read before it go out first; the next pull returns s.failure
                assert type(act) is Retry
                err = await self.retry(act)
                if err is not None:
                    return err
            ready = s.drained(loop.time())
            if ready:
                if s.poll_due(loop.time()) and await self.request.is_disconnected():
                    raise ClientGone
                if self.migrated_at is not None:
                    self._migration_resumed()
                self.last_token_at = time.perf_counter()
                return ready
            while True:  # the clocks (resume, poll the client, stall), then wait for a message
                now = loop.time()
                tick = s.tick(now)
                if type(tick) is Wait:
                    await self.box.wait(tick.until - now)
                    if items:
                        s.progress(loop.time())
                    break
                if type(tick) is SendResume:
                    self.gw.resume(self.req.reply_subject, tick.from_index)
                elif tick is POLL_CLIENT:
                    if await self.request.is_disconnected():
                        raise ClientGone
                elif type(tick) is Retry:
                    err = await self.retry(tick)
                    if err is not None:
                        return err
                    break
                else:
                    assert type(tick) is Fail
                    if tick.cancel is not None:
                        self.gw.cancel(self.rid, tick.cancel)
                    return tick.error

    # --- the client side --------------------------------------------------------------------
    async def run(self, fmt: Formatter) -> Response:
        gw = self.gw
        gw.event(self.rid, "received", model=self.req.model, prompt_tokens=len(self.req.prompt_tokens),
                 max_tokens=self.req.sampling.max_tokens, stream=self.prep.stream)
        handed_off = False
        try:
            err = await self.submit()
            if err is not None:
                return self._error(err)
            if self.prep.stream:
                first = await self.pull()  # before the 200: an early failure still gets its real status
                if isinstance(first, ErrorInfo):
                    return self._error(first)
                handed_off = True
                return SseResponse(self, fmt, first)
            return await self._collect(fmt)
        except ClientGone:
            self.cancel("client_disconnected")
            self.status = 499
            return Response(status_code=499)
        except BaseException:
            self.cancel("gateway_error")
            raise
        finally:
            if not handed_off:
                self.close()

    async def _collect(self, fmt: Formatter) -> Response:
        got = await self.collect()
        if isinstance(got, ErrorInfo):
            return self._error(got)
        return Response(fmt.full_chunks(got, self.stream.finish_reason, self.usage()), media_type=JSON)

    async def collect(self) -> list[TokenChunk] | ErrorInfo:
        """Every chunk of the reply, in order (a non-streamed response), or the error that ended it."""
        self.start_stream_span()
        chunks: list[TokenChunk] = []
        while not self.stream.done:  # a retry goes on after the tokens so far: nothing here is void
            got = await self.pull()
            if isinstance(got, ErrorInfo):
                return got
            if self.first_token_at is None:
                self.record_first_token()
            chunks.extend(got)  # the chunks, not only their text: logprobs ride on them
        self.record_finished()
        return chunks

    def _migration_resumed(self) -> None:
        """The first new tokens after a migration: the pause the client saw (last token before the loss
        to this one) and the part of it from the migration decision on."""
        now = time.perf_counter()
        assert self.migrated_at is not None
        gap = now - self.last_token_at
        self.gw.metrics.migration_gap.labels(self.req.model).observe(gap)
        self.gw.event(self.rid, "migration_resumed", gap_ms=round(gap * 1e3, 3),
                      replaced_ms=round((now - self.migrated_at) * 1e3, 3), from_index=self.req.continued,
                      worker_id=self.placement.decode_worker if self.placement is not None else None)
        self.migrated_at = None

    def usage(self) -> Usage:
        return self.stream.usage(len(self.prep.prompt_tokens))  # not req's: a migration lengthens that

    def start_stream_span(self) -> None:
        """Tokens from the mesh to the client: from the placement to the last token."""
        if self.span.is_recording():
            self.stream_span = self.gw.tracer.start_span("stream", context=trace.set_span_in_context(self.span),
                                                         attributes={"hetmesh.sse": self.prep.stream})

    def record_first_token(self) -> None:
        self.first_token_at = time.perf_counter()
        self.gw.event(self.rid, "first_token", ttft_ms=round((self.first_token_at - self.t0) * 1e3, 3))

    def record_finished(self) -> None:
        u = self.usage()
        self.gw.charge_completion(self.verdict, u.completion_tokens)
        self.gw.event(self.rid, "finished", finish_reason=self.stream.finish_reason,
                      completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens,
                      attempts=self.req.attempt + 1, resumes=self.stream.resumes,
                      migrations=self.stream.migrations,
                      duration_ms=round((time.perf_counter() - self.t0) * 1e3, 3))

    def _error(self, info: ErrorInfo) -> Response:
        self.record_error(info)
        return error_response(info)

    def record_error(self, info: ErrorInfo) -> None:
        self.status = info.status
        if self.span.is_recording():
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, info.message))
        self.gw.event(self.rid, "error", status=info.status, code=info.code, message=info.message)

    def cancel(self, reason: str) -> None:
        if not self.stream.cancelled and self.placement is not None:
            self.stream.cancelled = True
            self.gw.cancel(self.rid, reason)
            self.gw.event(self.rid, "cancelled", reason=reason)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.gw.active -= 1
        self.gw.inboxes.pop(self.key, None)
        m = self.gw.metrics
        ttft = None if self.first_token_at is None else self.first_token_at - self.t0
        completion = self.stream.next_index if self.status == 200 else 0
        m.finished(self.req.model, self.status, time.perf_counter() - self.t0, ttft, completion)
        if self.span.is_recording():
            self.span.set_attribute("http.response.status_code", self.status)
            self.span.set_attribute("hetmesh.completion_tokens", completion)
            if self.placement is not None:
                self.span.set_attribute("hetmesh.mode", self.placement.mode)
                self.span.set_attribute("hetmesh.decode_worker", self.placement.decode_worker)
            self.stream_span.end()
        self.span.end()


class SseResponse(SseBody):
    """One request's stream."""

    def __init__(self, call: Call, fmt: Formatter, first: list[TokenChunk]) -> None:
        super().__init__()
        self.call = call
        self.fmt = fmt
        self.first = first

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call, fmt = self.call, self.fmt
        finished = False
        call.start_stream_span()
        try:
            await self.start(send)
            body = fmt.sse_chunks(self.first, first=True)
            call.stream.sent()
            call.record_first_token()
            if call.stream.done:
                body += self._tail()
                finished = True
            await send({"type": "http.response.body", "body": body, "more_body": not finished})
            while not finished:
                got = await call.pull()
                if isinstance(got, ErrorInfo):
                    call.record_error(got)
                    await send({"type": "http.response.body", "body": core.sse_error(got), "more_body": False})
                    finished = True  # the mesh ended it; nothing to cancel
                    call.stream.cancelled = True
                    return
                body = fmt.sse_chunks(got, first=False)
                if call.stream.done:
                    body += self._tail()
                    finished = True
                await send({"type": "http.response.body", "body": body, "more_body": not finished})
        except ClientGone:
            pass
        except OSError:
            pass
        finally:
            if not finished:
                call.cancel("client_disconnected")
            call.close()

    def _tail(self) -> bytes:
        self.call.record_finished()
        return self.fmt.sse_end(self.call.usage)
