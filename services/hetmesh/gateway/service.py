"""The gateway's imperative shell: the NATS side, admission, one `Call` per request.

Replies: one wildcard subscription `hetmesh.resp.<instance>.*` routes every worker message to
its request's `Inbox` by the subject's last token (`<request_id>-<attempt>`), so a request
costs no subscribe/unsubscribe round trips and a stale attempt's messages fall on the floor.
One request's life is a `Call` (call.py), whose decisions about its messages are the pure
`stream.ReplyStream`'s. The ASGI app (app.py) calls `Gateway.handle`; nothing here imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import time
from typing import Any

import msgspec
import nats.errors
from fastapi import Request
from nats.aio.msg import Msg
from opentelemetry import trace
from pydantic import ValidationError
from starlette.responses import Response

from hetmesh import config, metrics, subjects, telemetry, tokenizer
from hetmesh.beats import Beats, overslept
from hetmesh.bus import Bus, EventBatcher, decode
from hetmesh.protocol import (
    Cancel,
    ErrorInfo,
    Heartbeat,
    ResponseEvent,
    Resume,
    SchedulerStatus,
    ServiceEvent,
    TurnedAway,
)

from . import core
from .auth import Authenticator, Verdict, decide
from .call import Call, Inbox
from .choices import FanOut
from .core import ApiError, Formatter, Prepared
from .limits import SharedBuckets
from .params import Caps, caps_for, prepare_chat, prepare_completion
from .responses import error_response
from .retries import Refused, fingerprint, is_retry
from .schedulers import Schedulers
from .schemas import ChatCompletionRequest, CompletionRequest, body_model, from_validation
from .stream import BUS_GAP
from .tenants import Tenants

log = logging.getLogger("hetmesh.gateway")


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


class Gateway:
    def __init__(self, cfg: config.ClusterConfig, instance: str) -> None:
        self.cfg = cfg
        self.instance = subjects.token_safe(instance)
        self.models = {m.name: m for m in cfg.models}
        self.tokenizers = {m.name: tokenizer.load(m.tokenizer) for m in cfg.models}
        # What every engine serving a model can do: the parameters none of them honours are refused.
        self.caps = {m.name: caps_for({g.engine for g in cfg.workers if g.model == m.name}) for m in cfg.models}
        self.tool_parsers: dict[str, core.ToolParser] = {}
        for m in cfg.models:
            if m.tool_parser:  # tool_choice "auto": vLLM's parser for the model's family (imports vLLM)
                from .toolcalls import ToolParsing

                p = ToolParsing(m.tool_parser, m.path or os.path.dirname(m.tokenizer))
                self.tool_parsers[m.name] = p.parse
                self.caps[m.name] = dataclasses.replace(self.caps[m.name], tool_parser=True,
                                                        keeps_specials=p.keeps_specials)
        self.inboxes: dict[str, Inbox] = {}
        # model -> the workers heard serving it (a heartbeat timeout of silence: gone)
        self.live: dict[str, Beats] = {m.name: Beats(cfg.mesh.heartbeat_timeout_s) for m in cfg.models}
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
        self.tenants = Tenants(cfg)  # flow control's tenant of each request, and per-tenant limits
        # one key, one limit across every gateway replica (Redis), unless configured per process
        self.limits = (SharedBuckets.from_mesh(cfg.mesh)
                       if (self.auth.limited or self.tenants.limited) and cfg.auth.shared_limits else None)
        self.active = 0  # Calls in flight (admission control)
        mesh = cfg.mesh
        self.schedulers = Schedulers(mesh.heartbeat_timeout_s, max(mesh.heartbeat_interval_s / 2, 0.05))
        self._alive: asyncio.Task[None] | None = None
        self.refused = {"overloaded": 0, "rate_limited": 0, "unauthorized": 0, "too_large": 0}
        self.retried = Refused()  # when requests the mesh refused were first sent: their retries' wait

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self.bus = await Bus.for_mesh(self.cfg.mesh, f"gateway-{self.instance}")
        self.bus.on_reconnect.append(self._on_reconnect)
        await self.bus.subscribe(subjects.reply_inbox(self.instance), ResponseEvent, self._on_reply)
        await self.bus.subscribe(subjects.HEARTBEAT_ALL, Heartbeat, self._on_heartbeat)
        await self.bus.nc.subscribe(subjects.SCHED_ALIVE_ALL, cb=self._on_sched_alive)
        await self.bus.nc.flush()
        self.events = EventBatcher(self.bus, "gateway")
        self._alive = asyncio.create_task(self._alive_loop())
        log.info("gateway %s connected to %s", self.instance, self.cfg.mesh.nats_url)

    async def stop(self) -> None:
        self.closing = True
        if self._alive is not None:
            self._alive.cancel()
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
        """The tenant's rate limits, then the key's: shared through Redis where the cluster has it, else this
        process's."""
        if (ts := self.tenants.state(v.tenant)) is not None:
            tv = Verdict(key=ts)
            now = time.monotonic()
            tv = decide(tv, await self.limits.take(ts, prompt_tokens, now)) if self.limits is not None else \
                self.auth.admit(tv, prompt_tokens, now)
            if tv.error is not None:
                v.error, v.headers = tv.error, tv.headers
                return v
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
        else:  # e.g. a second stream of a re-placed attempt, from a worker that still ran the old one
            self.metrics.stray_replies.inc()

    async def _on_reconnect(self) -> None:
        self.schedulers.bus_gap(asyncio.get_running_loop().time())
        for box in list(self.inboxes.values()):
            box.put(BUS_GAP)

    async def _on_sched_alive(self, m: Msg) -> None:
        self.schedulers.heard(m.subject.rsplit(".", 1)[-1], asyncio.get_running_loop().time(), m.data)

    async def _alive_loop(self) -> None:
        """Beats for the workers: a gateway silent for a heartbeat timeout is dead, and its requests with it."""
        assert self.bus is not None
        subject = subjects.gateway_alive(self.instance)
        period, loop = self.cfg.mesh.heartbeat_interval_s, asyncio.get_running_loop()
        last = loop.time()
        while True:
            if self.bus.nc.is_connected:
                with contextlib.suppress(nats.errors.Error):
                    await self.bus.nc.publish(subject, b"")
            await asyncio.sleep(period)
            if away := overslept(last, period, now := loop.time()):  # this process did not run: beats wait unread
                self.schedulers.paused(away, now)
                for workers in self.live.values():  # nor are the workers' heartbeats silence
                    workers.paused(away, time.monotonic())
            last = now

    async def _on_heartbeat(self, hb: Heartbeat, _m: Msg) -> None:
        now = time.monotonic()
        # A worker moving to a model counts for it too (its requests reach the scheduler, whose 503 says so);
        # one that moved away counts for its old model no more.
        for model, workers in self.live.items():
            if model == hb.model or model == hb.moving_model:
                workers.heard(hb.worker_id, now)
            else:
                workers.forget(hb.worker_id)

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
        if workers is None:
            return 0
        workers.forget_silent(time.monotonic(), workers.timeout_s)  # what is left was heard within the timeout
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

    async def _turned_away(self, model: str, prep: Prepared, code: str) -> None:
        """Tell the schedulers' demand windows about a request no scheduler saw (the planner's input)."""
        with contextlib.suppress(Exception):  # best effort: the bus may be away, the 503 goes out anyway
            assert self.bus is not None
            await self.bus.publish(subjects.TURNED_AWAY, TurnedAway(
                model=model, prompt_tokens=len(prep.prompt_tokens), max_tokens=prep.sampling.max_tokens, code=code))

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
        t0 = time.monotonic()
        verdict = self.authenticate(request)
        if verdict.error is not None:
            return self.reject("", verdict.error)
        verdict.tenant, bad = self.tenants.resolve(verdict, request.headers)
        if bad is not None:
            return self.reject("", bad)
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
            body: ChatCompletionRequest | CompletionRequest = body_model(chat).model_validate_json(raw)
        except ValidationError as exc:
            return self.reject("", from_validation(exc))
        model = self.models.get(body.model)
        if model is None:
            return self.reject("", core.model_not_found(body.model))
        fp = fingerprint(request.headers.get("authorization", ""), raw) if is_retry(request.headers) else None
        waited = self.retried.waited_s(fp, t0) if fp is not None else 0.0
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
            await self._turned_away(model.name, prep, "no_workers")
            return self.reject(model.name, ErrorInfo(message=f"no live worker serves model {model.name!r} right now",
                                                     type="server_error", code="no_workers", status=503,
                                                     retry_after_s=gc.retry_after_s), span)
        preps = [prep, *prep.extra]
        if self.active + len(preps) > gc.max_inflight:
            return self.reject(model.name, self.overloaded(), span)
        verdict = await self.admit(verdict, sum(len(p.prompt_tokens) for p in preps if p.counts_prompt))
        if verdict.error is not None:
            self.refused["rate_limited"] += 1
            return self.reject(model.name, verdict.error, span, verdict.headers)
        rid = f"{self.instance}-{next(self._ids)}"
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{rid}"
        created = int(time.time())
        piece = None if prep.sampling.logprobs is None else tok.decode_one
        if len(preps) == 1:
            call = Call(self, rid, model, prep, request, verdict, span)
            call.req.waited_s = waited
            response = await call.run(Formatter(chat, cid, model.name, created, prep.include_usage, prep, piece,
                                                self.tool_parsers.get(model.name)))
            return self._answered(response, verdict, request, raw, fp, t0 - waited)
        # One mesh request per choice; the first keeps the response's id (and the trace span).
        calls = [Call(self, rid if i == 0 else f"{self.instance}-{next(self._ids)}", model, p, request,
                      verdict, span if i == 0 else trace.INVALID_SPAN)
                 for i, p in enumerate(preps)]
        for c in calls:
            c.req.waited_s = waited
        fmts = [Formatter(chat, cid, model.name, created, p.include_usage, p, piece, self.tool_parsers.get(model.name))
                for p in preps]
        return self._answered(await FanOut(calls, fmts, prep.stream).run(), verdict, request, raw, fp, t0 - waited)

    def _answered(self, response: Response, verdict: Verdict, request: Request, raw: bytes, fp: bytes | None,
                  first_sent: float) -> Response:
        """An admitted request's answer carries its key's x-ratelimit-* headers, as OpenAI's do; one the mesh
        refused is remembered, so that the client's retry is judged by its wait since its first send."""
        if verdict.headers:
            response.headers.update(verdict.headers)
        if response.status_code in (429, 503):
            fp = fp or fingerprint(request.headers.get("authorization", ""), raw)
            self.retried.remember(fp, first_sent, time.monotonic())
        return response

    def _prepare(self, chat: bool, body: ChatCompletionRequest | CompletionRequest, model: config.ModelConfig,
                 tok: tokenizer.Tokenizer) -> Prepared:
        caps = self.caps.get(model.name, Caps())
        base_seed = int.from_bytes(os.urandom(4), "little")  # seeds of choices 1.. when the client gave none
        return (prepare_chat(body, model, tok, caps, base_seed) if chat  # type: ignore[arg-type]
                else prepare_completion(body, model, tok, caps, base_seed))  # type: ignore[arg-type]


def default_instance() -> str:
    return f"gw{os.getpid():x}{os.urandom(2).hex()}"
