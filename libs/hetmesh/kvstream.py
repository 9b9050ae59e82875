"""The direct KV data plane: one TCP stream from the prefill worker straight into the decode worker.

kv-transfer coordinates; the bytes never cross NATS or a third process. A frame is a 4-byte big-endian
header length, the KvTransferRequest (msgspec JSON), a 32-byte HMAC-SHA256 tag of the header under the
cluster's KV secret, then `nbytes` raw bytes (not authenticated: that is TLS's job). The receiver reads
straight into the engine's sink and answers one byte, ACK_OK or ACK_REFUSED. Protocol: docs/workers.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec

from hetmesh.protocol import KvTransferRequest

log = logging.getLogger(__name__)

ACK_OK = b"\x01"
ACK_REFUSED = b"\x00"
MAX_HEADER = 1 << 20  # a KvTransferRequest is ~100 bytes plus the first tokens
SOCK_BUF = 4 << 20  # fewer wake-ups per MB on both ends
SEND_SLICE = 16 << 20
_ZEROS = memoryview(bytes(1 << 20))  # what a simulated engine's KV is made of
_header_dec = msgspec.json.Decoder(KvTransferRequest)
_header_enc = msgspec.json.Encoder()
TAG = 32


def frame_header(header: KvTransferRequest, secret: bytes = b"") -> bytes:
    """What precedes the KV bytes on the wire: length, header, tag."""
    head = _header_enc.encode(header)
    tag = hmac.digest(secret, head, "sha256") if secret else bytes(TAG)
    return struct.pack("!I", len(head)) + head + tag


class KvSink(Protocol):
    """Where a landing transfer's bytes go: `view` is exactly nbytes long, or None to drop them (a
    simulated engine, whose KV is only a size)."""

    view: memoryview | None

    def commit(self) -> None:
        """Every byte is in: hand them to the engine for the request."""

    def discard(self) -> None:
        """The transfer failed or its request went away: free the buffer."""


class DroppedKv:
    """The sink of engines without real KV: bytes are counted, not kept."""

    view: memoryview | None = None

    def commit(self) -> None:
        return None

    def discard(self) -> None:
        return None


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)


async def send(endpoint: str, header: KvTransferRequest, payload: bytes | memoryview | None,
               idle_timeout_s: float = 10.0, secret: bytes = b"") -> None:
    """Stream one transfer to a decode worker's receiver and wait for its ack. `payload` None: send
    header.nbytes zero bytes (a simulated engine's KV: the size is real, the content is not).
    Raises ConnectionError when the receiver refused or did not take every byte."""
    loop = asyncio.get_running_loop()
    host, port = split_endpoint(endpoint)
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        _tune(sock)
        async with asyncio.timeout(idle_timeout_s) as deadline:
            await loop.sock_connect(sock, addr)
            await loop.sock_sendall(sock, frame_header(header, secret))
            if payload is not None and len(payload) != header.nbytes:
                raise ValueError(f"payload is {len(payload)} bytes, header says {header.nbytes}")
            # In slices, so that the idle deadline moves with progress; memoryview slices copy nothing.
            view = memoryview(payload) if payload is not None else None
            off = 0
            while off < header.nbytes:
                if view is not None:
                    piece = view[off:off + SEND_SLICE]
                else:
                    piece = _ZEROS[:min(len(_ZEROS), header.nbytes - off)]
                await loop.sock_sendall(sock, piece)
                off += len(piece)
                deadline.reschedule(loop.time() + idle_timeout_s)
            ack = await loop.sock_recv(sock, 1)
    finally:
        sock.close()
    if ack != ACK_OK:
        raise ConnectionError(f"KV receiver {endpoint} refused transfer {header.transfer_id}"
                              if ack == ACK_REFUSED else f"KV receiver {endpoint} closed before its ack")


Landed = Callable[[KvTransferRequest, KvSink, float], Awaitable[None]]
Failed = Callable[[KvTransferRequest, str], Awaitable[None]]


class Receiver:
    """A decode worker's KV port. `open_sink(header)` returns the sink for a transfer or raises
    ValueError to refuse it; `landed(header, sink, seconds)` gets every complete transfer and
    `failed(header, why)` every one that broke off after its header (sender gone, idle timeout)."""

    def __init__(self, worker_id: str, open_sink: Callable[[KvTransferRequest], KvSink], landed: Landed,
                 failed: Failed, idle_timeout_s: float = 10.0, max_concurrent: int = 64,
                 secret: bytes = b"") -> None:
        self.worker_id = worker_id
        self.secret = secret
        self.open_sink = open_sink
        self.landed = landed
        self.failed = failed
        self.idle_timeout_s = idle_timeout_s
        self.max_concurrent = max_concurrent
        self.active = 0
        self.endpoint = ""
        self._lsock: socket.socket | None = None
        self._accept: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int, advertise_host: str = "") -> str:
        """Listen; returns the endpoint other workers dial (`advertise_host`, else the listen host, or
        this host's address when listening on every interface)."""
        self._lsock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                           backlog=128, reuse_port=False)
        self._lsock.setblocking(False)
        bound = self._lsock.getsockname()[1]
        adv = advertise_host or host
        if adv in ("0.0.0.0", "::", ""):
            adv = socket.gethostbyname(socket.gethostname())  # a container's or pod's own address
        self.endpoint = f"[{adv}]:{bound}" if ":" in adv else f"{adv}:{bound}"
        self._accept = asyncio.create_task(self._accept_loop())
        return self.endpoint

    async def close(self) -> None:
        if self._accept is not None:
            self._accept.cancel()
        for t in list(self._conns):
            t.cancel()
        if self._lsock is not None:
            self._lsock.close()

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._lsock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._lsock)
            except OSError as exc:
                log.warning("KV port accept failed: %r", exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        header: KvTransferRequest | None = None
        sink: KvSink | None = None
        try:
            _tune(conn)
            async with asyncio.timeout(self.idle_timeout_s) as deadline:
                raw = await self._exactly(loop, conn, 4)
                (size,) = struct.unpack("!I", raw)
                if size > MAX_HEADER:
                    raise ValueError(f"header of {size} bytes")
                head = await self._exactly(loop, conn, size)
                tag = await self._exactly(loop, conn, TAG)
                header = _header_dec.decode(head)
                try:
                    if self.secret and not hmac.compare_digest(tag, hmac.digest(self.secret, head, "sha256")):
                        raise ValueError("sender does not know the cluster's KV secret")
                    if header.dst_worker != self.worker_id:
                        raise ValueError(f"transfer for {header.dst_worker}, this is {self.worker_id}")
                    if header.nbytes < 0:
                        raise ValueError(f"negative size {header.nbytes}")
                    if self.active >= self.max_concurrent:
                        raise ValueError(f"{self.active} transfers already landing")
                    sink = self.open_sink(header)
                except ValueError as exc:
                    log.warning("KV transfer %s refused: %s", header.transfer_id, exc)
                    header = None  # refused before it started: nothing for the decode side to fail over
                    await loop.sock_sendall(conn, ACK_REFUSED)
                    return
                self.active += 1
                t0 = time.perf_counter()
                try:
                    got = 0
                    view = sink.view
                    scratch = memoryview(bytearray(min(header.nbytes, SOCK_BUF))) if view is None else None
                    while got < header.nbytes:
                        if view is not None:
                            buf = view[got:]
                        else:
                            assert scratch is not None
                            buf = scratch[:header.nbytes - got]
                        n = await loop.sock_recv_into(conn, buf)
                        if n == 0:
                            raise ConnectionError(f"sender closed after {got} of {header.nbytes} bytes")
                        got += n
                        deadline.reschedule(loop.time() + self.idle_timeout_s)
                finally:
                    self.active -= 1
                landed, sink = sink, None
                await self.landed(header, landed, time.perf_counter() - t0)
                header = None
                await loop.sock_sendall(conn, ACK_OK)
        except (OSError, TimeoutError, ValueError, msgspec.DecodeError, struct.error) as exc:
            if sink is not None:
                sink.discard()
            if header is not None:
                await self.failed(header, f"KV stream broke off: {exc!r}")
            else:
                log.warning("KV port: bad or broken connection: %r", exc)
        finally:
            conn.close()

    @staticmethod
    async def _exactly(loop: asyncio.AbstractEventLoop, conn: socket.socket, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = await loop.sock_recv_into(conn, view[got:])
            if k == 0:
                raise ConnectionError(f"closed after {got} of {n} header bytes")
            got += k
        return bytes(buf)
