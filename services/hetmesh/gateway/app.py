"""The gateway's HTTP side: the ASGI app uvicorn runs (`HotPath`) and the FastAPI app behind it.

Requests flow one way: this module -> `Gateway` (service.py) -> `Call` (call.py) -> the reply stream
(stream.py) and fan-out (choices.py); the HTTP answers those layers build are in responses.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from hetmesh import config
from hetmesh.protocol import ErrorInfo

from . import core
from .responses import JSON, error_response
from .schemas import body_model, error_body, from_validation
from .service import Gateway

log = logging.getLogger("hetmesh.gateway")

# The completion routes, path -> chat. HotPath serves them; create_app declares them for /openapi.json only.
COMPLETION_ROUTES: dict[str, bool] = {"/v1/chat/completions": True, "/v1/completions": False}


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

    errors = {str(c): {"description": d} for c, d in ((400, "invalid request"), (401, "no or wrong API key"),
                                                        (404, "unknown model"), (413, "body too large"),
                                                        (429, "rate limited (Retry-After)"),
                                                        (503, "overloaded or no capacity (Retry-After)"))}
    for path, chat in COMPLETION_ROUTES.items():
        app.add_api_route(path, _documented(path, chat), methods=["POST"], responses=errors,
                          name=path.removeprefix("/v1/").replace("/", "_"))

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


def _documented(path: str, chat: bool) -> Callable[..., Any]:
    """A route's declaration for /openapi.json, its body schema included: HotPath serves the route
    (validating the body itself, straight from bytes), so FastAPI never calls this endpoint."""

    async def endpoint(body: Any) -> Response:
        raise RuntimeError(f"POST {path} is served by HotPath, not FastAPI")

    endpoint.__annotations__ = {"body": body_model(chat), "return": Response}
    return endpoint


class HotPath:
    """The ASGI app uvicorn runs: POSTs to the completion routes go straight to the gateway, everything
    else (models, health, errors, docs) to the FastAPI app, whose middleware stack and routing would
    cost the path every token request takes a large share of the HTTP layer's time."""

    def __init__(self, gw: Gateway, app: FastAPI) -> None:
        self.gw = gw
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            chat = COMPLETION_ROUTES.get(scope["path"])
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
