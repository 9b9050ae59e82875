"""uvicorn's HTTP protocol with limits on a request's head (request line and headers) and on slow clients.

httptools buffers a header whole before uvicorn sees it, so a client could send megabytes of headers
(say a huge Authorization value) past the body-size limit. The protocol below counts the bytes of each
request head as they arrive and answers 431 in OpenAI's error shape, closing the connection, once the
head passes the limit.

uvicorn times out only a keep-alive connection idle after a response; a connection that never sends a
byte, or stops halfway through its head or body, would stay open for good. The protocol below gives a
head `header_timeout_s` from its first byte (a new connection's from its accept) and a body
`body_timeout_s` between two reads: a stalled head or body gets 408 and the connection is closed; a
new connection that sent nothing is closed without a word, as an idle keep-alive one is.

Without httptools, uvicorn's h11 protocol gets the head-size limit (h11 answers 400) and the keep-alive
timeout only.
"""

from __future__ import annotations

import json
from asyncio import TimerHandle
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetmesh.config import GatewayConfig

MAX_HEADER_BYTES = 64 << 10


def _error(status: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


def error_431(limit: int) -> bytes:
    return _error("431 Request Header Fields Too Large",
                  f"Request header fields too large: the request line and headers exceed {limit} bytes.",
                  "request_header_fields_too_large")


def error_408(what: str, timeout_s: float) -> bytes:
    return _error("408 Request Timeout", f"Request timeout: the {what} did not arrive within {timeout_s:g} s.",
                  "request_timeout")


def uvicorn_http(gw: GatewayConfig | None = None) -> dict[str, Any]:
    """uvicorn.run()/Config keyword arguments: the HTTP protocol with the gateway's limits on request heads
    and slow clients, and its keep-alive timeout (defaults: GatewayConfig's)."""
    if gw is None:
        from hetmesh.config import GatewayConfig

        gw = GatewayConfig()
    limit, head_s, body_s = gw.max_header_bytes, gw.header_timeout_s, gw.body_timeout_s
    common: dict[str, Any] = {"timeout_keep_alive": gw.keep_alive_timeout_s}
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: h11, which bounds an incomplete head itself
        return {"http": "h11", "h11_max_incomplete_event_size": limit, **common}

    class BoundedHttpTools(HttpToolsProtocol):
        _head: int | None = 0  # bytes of the current request's head so far; None: its body is coming
        _head_timer: TimerHandle | None = None  # a head (or a new connection's first byte) is awaited
        _body_timer: TimerHandle | None = None  # a body is coming; _body_at: when its last bytes came
        _body_at = 0.0

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(head_s, self._head_timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timers()
            super().connection_lost(exc)

        def on_headers_complete(self) -> None:
            self._head = None
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            self._body_at = self.loop.time()
            super().on_body(body)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._head = 0  # the next request on this connection
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def data_received(self, data: bytes) -> None:
            while data and not self.transport.is_closing():
                if self._head is None:
                    super().data_received(data)
                    break
                room = limit - self._head
                if room <= 0:
                    self._too_large()
                    return
                part, data = data[:room], data[room:]
                self._head += len(part)
                super().data_received(part)
            # Timers only for what is left incomplete: a request that came whole costs none.
            if self.transport.is_closing():
                return
            if self._head is None:
                if self._body_timer is None:
                    self._body_at = self.loop.time()
                    self._body_timer = self.loop.call_later(body_s, self._body_timeout)
            elif self._head and self._head_timer is None:
                self._head_timer = self.loop.call_later(head_s, self._head_timeout)

        def _stop_timers(self) -> None:
            for t in (self._head_timer, self._body_timer):
                if t is not None:
                    t.cancel()
            self._head_timer = self._body_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self._head is None:
                return
            if self.cycle is not None and not self.cycle.response_complete:
                # a pipelined head behind a response still being written (a stream): its turn has not come
                self._head_timer = self.loop.call_later(head_s, self._head_timeout)
                return
            if self._head:
                self.transport.write(error_408("request line and headers", head_s))
            # no byte yet: closed without a word, as an idle keep-alive connection is
            self._close()

        def _body_timeout(self) -> None:
            self._body_timer = None
            if self.transport.is_closing() or self._head is not None:
                return
            late = self.loop.time() - self._body_at
            if late < body_s or self.flow.read_paused:  # bytes came meanwhile, or we are the ones not reading
                self._body_timer = self.loop.call_later(max(body_s - late, 0.0) or body_s, self._body_timeout)
                return
            if self.cycle is not None and not self.cycle.response_started:
                self.transport.write(error_408("request body", body_s))
            self._close()

        def _close(self) -> None:
            if self.cycle is not None and not self.cycle.response_complete:
                # the app waiting for the rest of the body reads a disconnect and answers no more
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            self._stop_timers()
            self.transport.close()

        def _too_large(self) -> None:
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(error_431(limit))
            # else a pipelined response is still being written: closing is all that is left to do
            self._close()

    return {"http": BoundedHttpTools, **common}
