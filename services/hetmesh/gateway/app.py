"""The gateway's HTTP side: the ASGI app uvicorn runs, the FastAPI routes, the SSE body, error responses.

Everything here reaches the mesh only through `Gateway` (service.py) and `Call` (call.py), which
import this module; it imports them back for type hints alone, so there is no import cycle.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from hetmesh import config
from hetmesh.protocol import ErrorInfo, TokenChunk

from . import core
from .auth import retry_after_headers
from .core import Formatter
from .schemas import ChatCompletionRequest, CompletionRequest, error_body, from_validation

if TYPE_CHECKING:
    from .service import Call, Gateway

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


class ClientGone(Exception):
    """The client disconnected while its request waited on the mesh."""


class SseBody(Response):
    """A streamed (SSE) body with its own ASGI loop (not StreamingResponse) so that a disconnect is a
    message in the inbox, not a cancellation: the Cancel publish then runs in a live task. Subclasses
    write the loop (`__call__`), opening it with `start`."""

    media_type = "text/event-stream"

    def __init__(self) -> None:
        # No content-length: uvicorn sends the body chunked as it comes.
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]

    async def start(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})


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
            call._first_token()
            if call.stream.done:
                body += self._tail()
                finished = True
            await send({"type": "http.response.body", "body": body, "more_body": not finished})
            while not finished:
                got = await call.pull()
                if isinstance(got, ErrorInfo):
                    call._error_event(got)
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
                call._cancel("client_disconnected")
            call.close()

    def _tail(self) -> bytes:
        self.call._finished()
        return self.fmt.sse_end(self.call.usage)


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
