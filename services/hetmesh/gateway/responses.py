"""The HTTP answers the per-request layers (service, call, choices) build: OpenAI-shaped error
responses and the SSE body's ASGI frame. They import this module; it imports none of them."""

from __future__ import annotations

from starlette.responses import Response
from starlette.types import Send

from hetmesh.protocol import ErrorInfo

from .auth import retry_after_headers
from .schemas import error_body

JSON = "application/json"


def error_response(info: ErrorInfo, headers: dict[str, str] | None = None) -> Response:
    if info.retry_after_s is not None:
        headers = {**(headers or {}), **retry_after_headers(info.retry_after_s)}
    return Response(error_body(info), status_code=info.status, media_type=JSON, headers=headers)


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
