"""The gateway's imperative shell: FastAPI routes, the NATS side, one `Call` per request.

Replies: one wildcard subscription `hetmesh.resp.<instance>.*` routes every worker message to
its request's `Inbox` by the subject's last token (`<request_id>-<attempt>`), so a request
costs no subscribe/unsubscribe round trips and a stale attempt's messages fall on the floor.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import msgspec
import nats.errors
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from nats.aio.msg import Msg
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from hetmesh import config, metrics, subjects, telemetry, tokenizer
from hetmesh.bus import REQUEST_ID, Bus, EventBatcher, decode, encode
from hetmesh.kvindex.blocks import block_hashes
from hetmesh.protocol import (
    Cancel,
    ErrorInfo,
    Heartbeat,
    InferenceRequest,
    Placement,
    RequestError,
    ResponseEvent,
    Resume,
    SchedulerStatus,
    ServiceEvent,
    SubmitReply,
    TokenChunk,
    WorkerLost,
)

from . import core
from .auth import Authenticator, Verdict, decide, retry_after_headers
from .core import ApiError, Formatter, Prepared, Reassembler
from .limits import SharedBuckets
from .schemas import ChatCompletionRequest, CompletionRequest, error_body, from_validation

log = logging.getLogger("hetmesh.gateway")

JSON = "application/json"


def error_response(info: ErrorInfo, headers: dict[str, str] | None = None) -> Response:
    if info.retry_after_s is not None:
        headers = {**(headers or {}), **retry_after_headers(info.retry_after_s)}
    return Response(error_body(info), status_code=info.status, media_type=JSON, headers=headers)


class BodyTooLarge(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (BodyTooLarge) as soon as it passes `limit` bytes: never held whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    parts: list[bytes] = []
    n = 0
    async for part in request.stream():
        n += len(part)
        if n > limit:
            raise BodyTooLarge
        parts.append(part)
    return b"".join(parts)


# How often a waiting request asks the server whether its client is still there. A poll, not a
# watcher task per request: requests shorter than this never pay for the check at all.
DISCONNECT_POLL_S = 0.2
# A stream that already sent tokens cannot start over; a hole in it is filled by asking the workers
# to publish its chunks again (protocol.Resume): at once after a bus reconnect, after RESUME_HOLE_S
# with a chunk waiting for a missing one, after RESUME_IDLE_S of silence; then again after RESUME_EVERY_S,
# doubling up to RESUME_MAX_S while nothing new comes (a long wait for KV is silence too).
RESUME_HOLE_S = 0.5
RESUME_IDLE_S = 2.0
RESUME_EVERY_S = 1.0
RESUME_MAX_S = 8.0


class ClientGone(Exception):
    pass


BUS_GAP = object()  # put in every inbox when NATS reconnects: messages of the outage may be lost


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


class Gateway:
    def __init__(self, cfg: config.ClusterConfig, instance: str) -> None:
        self.cfg = cfg
        self.instance = subjects.token_safe(instance)
        self.models = {m.name: m for m in cfg.models}
        self.tokenizers = {m.name: tokenizer.load(m.tokenizer) for m in cfg.models}
        self.inboxes: dict[str, Inbox] = {}
        self.live: dict[str, dict[str, float]] = {m.name: {} for m in cfg.models}  # model -> worker -> seen
        self.tracer = telemetry.setup("gateway", self.instance)
        # Spans cost tens of microseconds each; without an exporter nobody sees them.
        self.tracing = telemetry.enabled()
        self.metrics = metrics.GatewayMetrics()
        self.metrics.in_flight.set_function(lambda: self.active)
        self.events: EventBatcher | None = None
        self.bus: Bus | None = None
        self._ids = itertools.count(1)
        self._bg: set[asyncio.Task[None]] = set()
        self.created = int(time.time())
        self.closing = False
        self.reply_prefix = subjects.reply_to(self.instance, "")
        self.auth = Authenticator(cfg.auth)
        # one key, one limit across every gateway replica (Redis), unless configured per process
        self.limits = SharedBuckets.from_mesh(cfg.mesh) if self.auth.limited and cfg.auth.shared_limits else None
        self.active = 0  # Calls in flight (admission control)
        self.refused = {"overloaded": 0, "rate_limited": 0, "unauthorized": 0, "too_large": 0}

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self.bus = await Bus.for_mesh(self.cfg.mesh, f"gateway-{self.instance}")
        self.bus.on_reconnect.append(self._on_reconnect)
        await self.bus.subscribe(subjects.reply_inbox(self.instance), ResponseEvent, self._on_reply)
        await self.bus.subscribe(subjects.HEARTBEAT_ALL, Heartbeat, self._on_heartbeat)
        await self.bus.nc.flush()
        self.events = EventBatcher(self.bus, "gateway")
        log.info("gateway %s connected to %s", self.instance, self.cfg.mesh.nats_url)

    async def stop(self) -> None:
        self.closing = True
        for t in list(self._bg):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 1.0)
        if self.events is not None:
            await self.events.close()
        if self.bus is not None:
            await self.bus.close()
        if self.limits is not None:
            await self.limits.close()

    async def admit(self, v: Verdict, prompt_tokens: int) -> Verdict:
        """The key's rate limits: shared through Redis where the cluster has it, else this process's."""
        if self.limits is None or v.key is None:
            return self.auth.admit(v, prompt_tokens, time.monotonic())
        return decide(v, await self.limits.take(v.key, prompt_tokens, time.monotonic()))

    def charge_completion(self, v: Verdict, completion_tokens: int) -> None:
        if v.key is None:
            return
        if self.limits is not None:
            self.spawn(self.limits.charge(v.key, completion_tokens, time.monotonic()))
        else:
            self.auth.charge_completion(v, completion_tokens, time.monotonic())

    def spawn(self, coro: Any) -> None:
        """Fire-and-forget publishes (events, cancels) that must outlive a cancelled request task."""
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    @property
    def connected(self) -> bool:
        return self.bus is not None and self.bus.nc.is_connected

    # --- NATS side ------------------------------------------------------------------------
    async def _on_reply(self, ev: ResponseEvent, m: Msg) -> None:
        box = self.inboxes.get(m.subject[m.subject.rfind(".") + 1:])
        if box is not None:
            box.put(ev)

    async def _on_reconnect(self) -> None:
        for box in list(self.inboxes.values()):
            box.put(BUS_GAP)

    async def _on_heartbeat(self, hb: Heartbeat, _m: Msg) -> None:
        workers = self.live.get(hb.model)
        if workers is not None:
            workers[hb.worker_id] = time.monotonic()

    async def scheduler_status(self) -> SchedulerStatus | None:
        """The scheduler's own view, or None when no scheduler answers (not subscribed yet, or down)."""
        try:
            resp = await self.bus.nc.request(subjects.SCHED_STATUS, b"", timeout=0.5)
            return decode(resp.data, SchedulerStatus)
        except (nats.errors.Error, TimeoutError, msgspec.DecodeError):
            return None

    async def wait_connected(self, timeout_s: float) -> bool:
        """NATS is reconnecting (e.g. the server restarted): hold the request a bounded time rather than
        refuse it; nats-py resubscribes and flushes what was published meanwhile once it is back."""
        deadline = time.monotonic() + timeout_s
        while not self.connected:
            if self.closing or self.bus is None or self.bus.nc.is_closed or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def wait_workers(self, model: str) -> bool:
        """No heartbeat seen lately (workers restarting, or the bus just came back): wait one heartbeat
        timeout for one before refusing."""
        deadline = time.monotonic() + self.cfg.mesh.heartbeat_timeout_s
        while self.live_workers(model) == 0:
            if self.closing or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def live_workers(self, model: str) -> int:
        workers = self.live.get(model)
        if not workers:
            return 0
        cutoff = time.monotonic() - self.cfg.mesh.heartbeat_timeout_s
        for wid in [w for w, seen in workers.items() if seen < cutoff]:
            del workers[wid]
        return len(workers)

    def event(self, rid: str, kind: str, **detail: str | int | float | bool | None) -> None:
        """Queue a ServiceEvent; the batcher publishes them, so the request path pays no task or await."""
        if self.events is not None:
            self.events.add(ServiceEvent(service="gateway", instance=self.instance, request_id=rid, kind=kind,
                                         ts=time.time(), detail=detail))

    def cancel(self, rid: str, reason: str) -> None:
        if self.bus is not None:
            self.spawn(self.bus.publish(subjects.CANCEL, Cancel(request_id=rid, reason=reason), rid))

    def resume(self, reply_subject: str, from_index: int) -> None:
        if self.bus is not None and self.bus.nc.is_connected:
            self.spawn(self.bus.publish(subjects.RESUME, Resume(reply_subject=reply_subject, from_index=from_index)))

    # --- HTTP side ------------------------------------------------------------------------
    def authenticate(self, request: Request) -> Verdict:
        v = self.auth.authenticate(request.headers.get("authorization"))
        if v.error is not None:
            self.refused["unauthorized"] += 1
        return v

    def overloaded(self) -> ErrorInfo:
        self.refused["overloaded"] += 1
        return ErrorInfo(message=f"The gateway is overloaded ({self.active} requests in flight); please retry.",
                         type="server_error", code="overloaded", status=503,
                         retry_after_s=self.cfg.gateway.retry_after_s)

    def reject(self, model: str, info: ErrorInfo, span: trace.Span = trace.INVALID_SPAN,
               headers: dict[str, str] | None = None) -> Response:
        """A request turned away before it reached the mesh (unknown models count under model "")."""
        self.metrics.requests.labels(model, str(info.status)).inc()
        if span.is_recording():
            span.set_status(trace.Status(trace.StatusCode.ERROR, info.message))
            span.set_attribute("http.response.status_code", info.status)
            span.end()
        return error_response(info, headers)

    async def handle(self, request: Request, chat: bool) -> Response:
        verdict = self.authenticate(request)
        if verdict.error is not None:
            return self.reject("", verdict.error)
        gc = self.cfg.gateway
        if self.active >= gc.max_inflight:  # before reading the body: a flood costs as little as possible
            return self.reject("", self.overloaded())
        try:
            raw = await read_body(request, gc.max_body_bytes)
        except BodyTooLarge:
            self.refused["too_large"] += 1
            return self.reject("", ErrorInfo(message=f"The request body is larger than {gc.max_body_bytes} bytes.",
                                             type="invalid_request_error", code="request_too_large", status=413))
        try:
            body: ChatCompletionRequest | CompletionRequest = (
                ChatCompletionRequest if chat else CompletionRequest).model_validate_json(raw)
        except ValidationError as exc:
            return self.reject("", from_validation(exc))
        model = self.models.get(body.model)
        if model is None:
            return self.reject("", core.model_not_found(body.model))
        span = trace.INVALID_SPAN
        if self.tracing:
            # A client's traceparent (if any) makes this span its child.
            span = self.tracer.start_span("gateway.request", context=telemetry.extract(dict(request.headers)),
                                          attributes={"hetmesh.model": model.name, "hetmesh.stream": bool(body.stream),
                                                      "http.route": request.url.path})
        try:
            tok = self.tokenizers[model.name]
            if self.tracing:
                with self.tracer.start_as_current_span("tokenize", context=trace.set_span_in_context(span),
                                                       attributes={"hetmesh.tokenizer": model.tokenizer}) as ts:
                    prep = self._prepare(chat, body, model, tok)
                    ts.set_attribute("hetmesh.prompt_tokens", len(prep.prompt_tokens))
            else:
                prep = self._prepare(chat, body, model, tok)
        except ApiError as exc:
            return self.reject(model.name, exc.info, span)
        if not self.connected and not await self.wait_connected(gc.scheduler_wait_s):
            return self.reject(model.name, ErrorInfo(message="the gateway is not connected to the mesh",
                                                     type="server_error", code="service_unavailable", status=503,
                                                     retry_after_s=gc.retry_after_s), span)
        if self.live_workers(model.name) == 0 and not await self.wait_workers(model.name):
            return self.reject(model.name, ErrorInfo(message=f"no live worker serves model {model.name!r} right now",
                                                     type="server_error", code="no_workers", status=503,
                                                     retry_after_s=gc.retry_after_s), span)
        if self.active >= gc.max_inflight:
            return self.reject(model.name, self.overloaded(), span)
        verdict = await self.admit(verdict, len(prep.prompt_tokens))
        if verdict.error is not None:
            self.refused["rate_limited"] += 1
            return self.reject(model.name, verdict.error, span, verdict.headers)
        rid = f"{self.instance}-{next(self._ids)}"
        call = Call(self, rid, model, prep, request, verdict, span)
        fmt = Formatter(chat, f"{'chatcmpl' if chat else 'cmpl'}-{rid}", model.name, int(time.time()),
                        prep.include_usage)
        return await call.run(fmt)

    @staticmethod
    def _prepare(chat: bool, body: ChatCompletionRequest | CompletionRequest, model: config.ModelConfig,
                 tok: tokenizer.Tokenizer) -> Prepared:
        return (core.prepare_chat(body, model, tok) if chat  # type: ignore[arg-type]
                else core.prepare_completion(body, model, tok))  # type: ignore[arg-type]


class Call:
    """One request's life in the gateway: submit, consume the reply stream, retry, cancel."""

    def __init__(self, gw: Gateway, rid: str, model: config.ModelConfig, prep: Prepared, request: Request,
                 verdict: Verdict | None = None, span: trace.Span = trace.INVALID_SPAN) -> None:
        gw.active += 1  # until close()
        self.verdict = verdict or Verdict()
        self.gw = gw
        self.rid = rid
        self.prep = prep
        self.request = request
        self.t0 = time.perf_counter()
        self.req = InferenceRequest(
            request_id=rid, model=model.name, prompt_tokens=prep.prompt_tokens,
            block_hashes=block_hashes(model.name, prep.prompt_tokens, model.block_size),
            sampling=prep.sampling, reply_subject="", arrival_ts=time.time())
        self.box = Inbox()
        self.key = ""
        self.reasm = Reassembler()
        self.placement: Placement | None = None
        self.delivered = False  # some token reached the client: no more retries
        self.gap_retries = 0  # attempts started because the bus reconnected (they do not use up max_attempts)
        self.resume_at = float("inf")  # when to ask the workers to publish this stream again (once delivered)
        self.resumes = 0
        self.resume_every = RESUME_EVERY_S
        self.cancelled = False
        self.closed = False
        self.first_token_at: float | None = None
        self.status = 200  # what the client got; counted in close()
        self.span = span
        self.stream_span: trace.Span = trace.INVALID_SPAN
        if span.is_recording():
            span.set_attribute("hetmesh.request_id", rid)
            span.set_attribute("hetmesh.prompt_tokens", len(prep.prompt_tokens))
        self.next_disconnect_check = 0.0

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
        timeout_s = gw.cfg.gateway.submit_timeout_s
        if gw.tracing:
            with trace.use_span(self.span, end_on_exit=False):  # bus.request injects this span's context
                return await gw.bus.request(subjects.SUBMIT, self.req, SubmitReply, timeout_s=timeout_s,
                                            request_id=self.rid)
        # No trace to carry: skip the propagators' work.
        resp = await gw.bus.nc.request(subjects.SUBMIT, encode(self.req), timeout=timeout_s,
                                       headers={REQUEST_ID: self.rid})
        return decode(resp.data, SubmitReply)

    def can_retry(self) -> bool:
        return not self.delivered and self.req.attempt - self.gap_retries + 1 < self.gw.cfg.mesh.max_attempts

    async def retry(self, lost_worker: str | None) -> ErrorInfo | None:
        self.gw.inboxes.pop(self.key, None)
        self.box.items.clear()  # the old attempt's leftovers
        self.reasm = Reassembler()
        self.req.attempt += 1
        if lost_worker and lost_worker not in self.req.exclude_workers:
            self.req.exclude_workers.append(lost_worker)
        self.gw.event(self.rid, "retried", attempt=self.req.attempt, lost_worker=lost_worker)
        return await self.submit()

    async def pull(self) -> list[TokenChunk] | ErrorInfo:
        """The next chunks in completion order (never empty), or the error that ends the request.

        Raises ClientGone when the client disconnected. Retries happen in here, invisibly.
        """
        stall = self.gw.cfg.mesh.stall_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + stall
        ready: list[TokenChunk] = []
        while True:
            items = self.box.items
            while items:
                ev = items.popleft()
                if type(ev) is TokenChunk:
                    if ev.finish_reason == "abort" and not self.cancelled:
                        return ErrorInfo(message=f"worker {ev.worker_id} aborted the request", type="server_error",
                                         code="aborted", status=502)
                    ready.extend(self.reasm.add(ev))
                elif type(ev) is RequestError and not ev.retryable:
                    return ev.error
                elif ev is BUS_GAP and self.delivered:
                    self.resume_at = loop.time()  # tokens went out: it cannot start over, so fill the hole
                    continue
                else:  # WorkerLost, a retryable RequestError, or BUS_GAP
                    if ev is BUS_GAP:
                        # Chunks or the reply may have been published while this gateway was disconnected
                        # and be gone: nothing reached the client yet, so start the attempt over.
                        self.gap_retries += 1
                    elif not self.can_retry():
                        return self._lost_info(ev)
                    err = await self.retry(ev.worker_id if type(ev) is WorkerLost else None)
                    if err is not None:
                        return err
                    ready.clear()
                    deadline = loop.time() + stall
                    break
            if self.delivered:
                if ready:
                    self.resume_at = loop.time() + (RESUME_HOLE_S if self.reasm.pending else RESUME_IDLE_S)
                    self.resume_every = RESUME_EVERY_S
                elif self.reasm.pending:
                    self.resume_at = min(self.resume_at, loop.time() + RESUME_HOLE_S)
            if ready and not items:
                return ready
            if items:
                continue
            now = loop.time()
            if now >= self.resume_at:
                self.resumes += 1
                self.gw.resume(self.req.reply_subject, self.reasm.next_index)
                self.resume_at = now + self.resume_every
                self.resume_every = min(2 * self.resume_every, RESUME_MAX_S)
            if now >= self.next_disconnect_check:
                if await self.request.is_disconnected():
                    raise ClientGone
                now = loop.time()
                self.next_disconnect_check = now + DISCONNECT_POLL_S
            if now >= deadline:
                self.gw.cancel(self.rid, "stalled")
                self.cancelled = True
                return ErrorInfo(message=f"no response from the mesh for {stall:g}s", type="server_error",
                                 code="timeout", status=504)
            await self.box.wait(min(deadline, self.next_disconnect_check, self.resume_at) - now)
            if self.box.items:
                deadline = loop.time() + stall

    def _lost_info(self, ev: WorkerLost | RequestError) -> ErrorInfo:
        if type(ev) is RequestError:
            return ev.error
        what = "after part of the response was sent" if self.delivered else f"after {self.req.attempt + 1} attempts"
        return ErrorInfo(message=f"worker {ev.worker_id} was lost {what}", type="server_error",
                         code="worker_lost", status=502)

    # --- the client side --------------------------------------------------------------------
    async def run(self, fmt: Formatter) -> Response:
        gw = self.gw
        gw.event(self.rid, "received", model=self.req.model, prompt_tokens=len(self.req.prompt_tokens),
                 max_tokens=self.req.sampling.max_tokens, stream=self.prep.stream)
        self.next_disconnect_check = asyncio.get_running_loop().time() + DISCONNECT_POLL_S
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
            self._cancel("client_disconnected")
            self.status = 499
            return Response(status_code=499)
        except BaseException:
            self._cancel("gateway_error")
            raise
        finally:
            if not handed_off:
                self.close()

    async def _collect(self, fmt: Formatter) -> Response:
        self.start_stream_span()
        texts: list[str] = []
        attempt = self.req.attempt
        while not self.reasm.done:
            got = await self.pull()
            if isinstance(got, ErrorInfo):
                return self._error(got)
            if self.req.attempt != attempt:  # a retry started over: what came before is void
                texts.clear()
                attempt = self.req.attempt
            if self.first_token_at is None:
                self._first_token()
            texts.extend(c.text for c in got)
        self._finished()
        return Response(fmt.full("".join(texts), self.reasm.finish_reason, self.usage()), media_type=JSON)

    def usage(self) -> core.Usage:
        return core.usage_of(self.reasm, len(self.req.prompt_tokens))

    def start_stream_span(self) -> None:
        """Tokens from the mesh to the client: from the placement to the last token."""
        if self.span.is_recording():
            self.stream_span = self.gw.tracer.start_span("stream", context=trace.set_span_in_context(self.span),
                                                         attributes={"hetmesh.sse": self.prep.stream})

    def _first_token(self) -> None:
        self.first_token_at = time.perf_counter()
        self.gw.event(self.rid, "first_token", ttft_ms=round((self.first_token_at - self.t0) * 1e3, 3))

    def _finished(self) -> None:
        u = self.usage()
        self.gw.charge_completion(self.verdict, u.completion_tokens)
        self.gw.event(self.rid, "finished", finish_reason=self.reasm.finish_reason,
                      completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens,
                      attempts=self.req.attempt + 1, resumes=self.resumes,
                      duration_ms=round((time.perf_counter() - self.t0) * 1e3, 3))

    def _error(self, info: ErrorInfo) -> Response:
        self._error_event(info)
        return error_response(info)

    def _error_event(self, info: ErrorInfo) -> None:
        self.status = info.status
        if self.span.is_recording():
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, info.message))
        self.gw.event(self.rid, "error", status=info.status, code=info.code, message=info.message)

    def _cancel(self, reason: str) -> None:
        if not self.cancelled and self.placement is not None:
            self.cancelled = True
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
        completion = self.reasm.next_index if self.status == 200 else 0
        m.finished(self.req.model, self.status, time.perf_counter() - self.t0, ttft, completion)
        if self.span.is_recording():
            self.span.set_attribute("http.response.status_code", self.status)
            self.span.set_attribute("hetmesh.completion_tokens", completion)
            if self.placement is not None:
                self.span.set_attribute("hetmesh.mode", self.placement.mode)
                self.span.set_attribute("hetmesh.decode_worker", self.placement.decode_worker)
            self.stream_span.end()
        self.span.end()


class SseResponse(Response):
    """The streaming body. Its own ASGI loop (not StreamingResponse) so that a disconnect is a
    message in the inbox, not a cancellation: the Cancel publish then runs in a live task."""

    media_type = "text/event-stream"

    def __init__(self, call: Call, fmt: Formatter, first: list[TokenChunk]) -> None:
        # No content-length: uvicorn sends the body chunked as it comes.
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.call = call
        self.fmt = fmt
        self.first = first

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call, fmt = self.call, self.fmt
        finished = False
        call.start_stream_span()
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            body = fmt.sse_chunks(self.first, first=True)
            call.delivered = True
            call._first_token()
            if call.reasm.done:
                body += self._tail()
                finished = True
            await send({"type": "http.response.body", "body": body, "more_body": not finished})
            while not finished:
                got = await call.pull()
                if isinstance(got, ErrorInfo):
                    call._error_event(got)
                    await send({"type": "http.response.body", "body": core.sse_error(got), "more_body": False})
                    finished = True  # the mesh ended it; nothing to cancel
                    call.cancelled = True
                    return
                body = fmt.sse_chunks(got, first=False)
                if call.reasm.done:
                    body += self._tail()
                    finished = True
                await send({"type": "http.response.body", "body": body, "more_body": not finished})
        except ClientGone:
            pass
        except OSError:
            pass
        finally:
            if not finished:
                call._cancel("client_disconnected")
            call.close()

    def _tail(self) -> bytes:
        call = self.call
        call._finished()
        tail = core.DONE
        if self.fmt.include_usage:
            tail = self.fmt.sse_usage(call.usage()) + tail
        return tail


def create_app(gw: Gateway) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        prof_path = os.environ.get("HETMESH_GATEWAY_PROFILE")  # the benchmark's --profile
        prof = None
        if prof_path:
            import cProfile

            prof = cProfile.Profile(time.process_time)  # CPU time: wall time counts preemption on a busy box
            prof.enable()
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()
            if prof is not None:
                prof.disable()
                prof.dump_stats(prof_path)

    # FastAPI's own per-request telemetry (server spans, metrics, operation spans) costs more than the
    # rest of the gateway's request path; the gateway makes its own span (see Call) when tracing is on.
    app = FastAPI(title="Hetmesh gateway", version="0.1.0", lifespan=lifespan,
                  telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False})

    @app.exception_handler(RequestValidationError)
    async def _validation(_r: Request, exc: RequestValidationError) -> Response:
        return error_response(from_validation(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(r: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            msg = f"Invalid URL ({r.method} {r.url.path})"
        elif exc.status_code == 405:
            msg = f"Method {r.method} is not allowed for {r.url.path}"
        else:
            msg = str(exc.detail)
        info = ErrorInfo(message=msg, type="invalid_request_error", status=exc.status_code)
        return Response(error_body(info), status_code=exc.status_code, media_type=JSON,
                        headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(_r: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        return error_response(ErrorInfo(message="internal error in the gateway", type="server_error", status=500))

    # HotPath serves these two POSTs before FastAPI sees them (the body is validated by hand, straight from
    # bytes); the routes are declared here with their body models so that /openapi.json documents them.
    errors = {str(c): {"description": d} for c, d in ((400, "invalid request"), (401, "no or wrong API key"),
                                                        (404, "unknown model"), (413, "body too large"),
                                                        (429, "rate limited (Retry-After)"),
                                                        (503, "overloaded or no capacity (Retry-After)"))}

    @app.post("/v1/chat/completions", responses=errors)
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await gw.handle(request, chat=True)

    @app.post("/v1/completions", responses=errors)
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await gw.handle(request, chat=False)

    def model_card(m: config.ModelConfig) -> dict[str, object]:
        return {"id": m.name, "object": "model", "created": gw.created, "owned_by": "hetmesh",
                "max_model_len": m.max_context, "live_workers": gw.live_workers(m.name)}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if (err := gw.authenticate(request).error) is not None:
            return error_response(err)
        data = [model_card(m) for m in gw.models.values()]
        return Response(core._enc.encode({"object": "list", "data": data}), media_type=JSON)

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> Response:
        if (err := gw.authenticate(request).error) is not None:
            return error_response(err)
        m = gw.models.get(name)
        if m is None:
            return error_response(core.model_not_found(name))
        return Response(core._enc.encode(model_card(m)), media_type=JSON)

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> Response:
        ok = gw.connected
        return Response(core._enc.encode({"status": "ok" if ok else "nats_disconnected", "instance": gw.instance}),
                        status_code=200 if ok else 503, media_type=JSON)

    @app.get("/ready")
    async def ready() -> Response:
        # Ready means a request would be placed now: NATS up, a scheduler subscribed, and workers in
        # the scheduler's view (the gateway's own heartbeat view can be ahead of the scheduler's).
        per_model = {name: gw.live_workers(name) for name in gw.models}
        status = await gw.scheduler_status() if gw.connected else None
        total = len(status.workers) if status is not None else 0
        ok = gw.connected and total > 0 and sum(per_model.values()) > 0
        body = {"status": "ready" if ok else "not_ready", "nats": gw.connected, "workers": total,
                "scheduler": status.instance if status else None, "models": per_model}
        return Response(core._enc.encode(body), status_code=200 if ok else 503, media_type=JSON)

    return app


class HotPath:
    """The ASGI app uvicorn runs: POSTs to the two completion routes go straight to the gateway,
    everything else (models, health, errors, docs) to the FastAPI app.

    Measured on the 2-core box: FastAPI's middleware stack and routing cost ~120 us per request,
    a third of the HTTP layer's whole cost, on the path every token request takes.
    """

    ROUTES: ClassVar[dict[str, bool]] = {"/v1/chat/completions": True, "/v1/completions": False}

    def __init__(self, gw: Gateway, app: FastAPI) -> None:
        self.gw = gw
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            chat = self.ROUTES.get(scope["path"])
            if chat is not None:
                try:
                    response = await self.gw.handle(Request(scope, receive), chat)
                except Exception:
                    log.exception("unhandled error")
                    response = error_response(ErrorInfo(message="internal error in the gateway",
                                                        type="server_error", status=500))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def asgi_app(gw: Gateway) -> HotPath:
    return HotPath(gw, create_app(gw))


def default_instance() -> str:
    return f"gw{os.getpid():x}{os.urandom(2).hex()}"
