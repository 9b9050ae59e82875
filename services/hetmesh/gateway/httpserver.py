"""uvicorn's HTTP protocol with a limit on the size of a request's head (request line and headers).

httptools buffers a header whole before uvicorn sees it, so a client could send megabytes of headers
(say a huge Authorization value) past the body-size limit. The protocol below counts the bytes of each
request head as they arrive and answers 431 in OpenAI's error shape, closing the connection, once the
head passes the limit. Without httptools, uvicorn's h11 protocol gets the same limit (h11 answers 400).
"""

from __future__ import annotations

import json
from typing import Any

MAX_HEADER_BYTES = 64 << 10


def error_431(limit: int) -> bytes:
    body = json.dumps({"error": {
        "message": f"Request header fields too large: the request line and headers exceed {limit} bytes.",
        "type": "invalid_request_error", "param": None, "code": "request_header_fields_too_large"}}).encode()
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


def uvicorn_http(limit: int = MAX_HEADER_BYTES) -> dict[str, Any]:
    """uvicorn.run()/Config keyword arguments: the HTTP protocol, with request heads limited to `limit` bytes."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: h11, which bounds an incomplete head itself
        return {"http": "h11", "h11_max_incomplete_event_size": limit}

    class BoundedHttpTools(HttpToolsProtocol):
        _head: int | None = 0  # bytes of the current request's head so far; None: its body is coming

        def on_headers_complete(self) -> None:
            self._head = None
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._head = 0  # the next request on this connection

        def data_received(self, data: bytes) -> None:
            while data and not self.transport.is_closing():
                if self._head is None:
                    super().data_received(data)
                    return
                room = limit - self._head
                if room <= 0:
                    self._too_large()
                    return
                part, data = data[:room], data[room:]
                self._head += len(part)
                super().data_received(part)

        def _too_large(self) -> None:
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(error_431(limit))
            # else a pipelined response is still being written: closing is all that is left to do
            self.transport.close()

    return {"http": BoundedHttpTools}
