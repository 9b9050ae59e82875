"""NATS plumbing shared by every service: connect with retries, typed publish/subscribe.

Bodies are msgspec JSON; the request id and W3C trace context ride in NATS headers so a
message body never has to carry transport concerns.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_exponential

from hetmesh import subjects, telemetry
from hetmesh.config import MeshConfig, nats_options, nats_servers
from hetmesh.protocol import EventBatch, ServiceEvent

log = logging.getLogger(__name__)

T = TypeVar("T")
REQUEST_ID = "Hetmesh-Request-Id"

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decoder(kind: Any) -> msgspec.json.Decoder[Any]:
    dec = _decoders.get(kind)
    if dec is None:
        dec = _decoders[kind] = msgspec.json.Decoder(kind)
    return dec


def decode(data: bytes, kind: type[T]) -> T:
    return decoder(kind).decode(data)



def decode_events(data: bytes) -> list[ServiceEvent]:
    """The ServiceEvents in one `hetmesh.event.<service>` message."""
    return decoder(EventBatch).decode(data)


def headers_for(request_id: str | None) -> dict[str, str] | None:
    """The request id and trace context; None when there is neither (an empty header block still costs
    the sender and every receiver a header parse)."""
    headers: dict[str, str] = {}
    if request_id:
        headers[REQUEST_ID] = request_id
    telemetry.inject(headers)
    return headers or None


class Bus:
    """A connected NATS client plus typed helpers. One per service process."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.on_reconnect: list[Callable[[], Awaitable[None]]] = []  # awaited after each reconnect

    @classmethod
    async def for_mesh(cls, mesh: MeshConfig, name: str) -> Bus:
        """Connect with the cluster file's URL, credentials and TLS."""
        return await cls.connect(mesh.nats_url, name, **nats_options(mesh))

    @classmethod
    async def connect(cls, url: str, name: str, connect_timeout_s: float = 30.0, **options: Any) -> Bus:
        """`url`: one server, or a cluster's nodes comma-separated (nats-py moves to another node when its own goes
        away). `options`: more nats.connect() arguments (credentials, TLS)."""
        last_error: list[BaseException] = []
        refusal: list[BaseException] = []  # the server's own refusal (auth) outranks the resets that follow it
        on_reconnect: list[Callable[[], Awaitable[None]]] = []
        client: list[Client] = []

        async def _error(e: Exception) -> None:
            if not last_error or type(last_error[-1]) is not type(e):
                log.warning("NATS %s (%s): %r", url, name, e)
            last_error[:] = [e]
            if "authoriz" in str(e).lower() or "authentication" in str(e).lower():
                refusal[:] = [e]

        async def _disconnected() -> None:
            if client and client[0].is_closed:  # our own close (a stop), not a lost server
                return
            log.warning("NATS disconnected (%s); reconnecting", name)

        async def _reconnected() -> None:
            log.info("NATS reconnected (%s)", name)
            for hook in on_reconnect:
                try:
                    await hook()
                except Exception:
                    log.exception("reconnect hook failed")

        @retry(
            wait=wait_exponential(multiplier=0.1, max=2.0),
            stop=stop_after_delay(connect_timeout_s),
            retry=retry_if_exception_type((OSError, nats.errors.NoServersError, TimeoutError)),
            reraise=True,
        )
        async def _connect() -> Client:
            return await nats.connect(
                nats_servers(url),
                name=name,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                connect_timeout=2,
                pending_size=256 * 1024 * 1024,
                flusher_queue_size=8192,
                error_cb=_error,
                disconnected_cb=_disconnected,
                reconnected_cb=_reconnected,
                **options,
            )

        # nats-py retries a refused first connect (e.g. bad credentials) forever on its own: bound it.
        try:
            client.append(await asyncio.wait_for(_connect(), connect_timeout_s))
            bus = cls(client[0])
            bus.on_reconnect = on_reconnect
            return bus
        except TimeoutError:
            seen = refusal or last_error
            why = repr(seen[-1]) if seen else "no answer"
            raise ConnectionError(f"could not connect to NATS at {url} within {connect_timeout_s:g}s: {why}") from None

    async def publish(self, subject: str, msg: msgspec.Struct, request_id: str | None = None) -> None:
        await self.nc.publish(subject, encode(msg), headers=headers_for(request_id))

    async def publish_raw(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        await self.nc.publish(subject, data, headers=headers)

    async def request(
        self, subject: str, msg: msgspec.Struct, reply_type: type[T], timeout_s: float, request_id: str | None = None
    ) -> T:
        resp = await self.nc.request(subject, encode(msg), timeout=timeout_s, headers=headers_for(request_id))
        return decode(resp.data, reply_type)

    async def subscribe(
        self,
        subject: str,
        kind: Any,
        handler: Callable[[Any, Msg], Awaitable[None]],
        queue: str = "",
    ) -> Subscription:
        """Decode each message as `kind` and await handler(decoded, raw). Bad bodies are logged, not fatal."""
        dec = decoder(kind)

        async def _cb(m: Msg) -> None:
            try:
                obj = dec.decode(m.data)
            except msgspec.DecodeError as exc:
                log.warning("dropping undecodable message on %s: %s", m.subject, exc)
                if m.reply:
                    await m.respond(encode_error(f"undecodable message: {exc}"))
                return
            try:
                await handler(obj, m)
            except Exception:
                log.exception("handler for %s failed", m.subject)

        return await self.nc.subscribe(subject, queue=queue, cb=_cb, pending_msgs_limit=1_000_000,
                                       pending_bytes_limit=1024 * 1024 * 1024)

    async def respond(self, m: Msg, msg: msgspec.Struct) -> None:
        await m.respond(encode(msg))

    async def close(self) -> None:
        if not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception:
                await self.nc.close()


def encode_error(message: str) -> bytes:
    return _encoder.encode({"error": {"message": message, "type": "invalid_request_error"}})


EVENT_BATCH_S = 0.02  # how long a batched message may wait for company before it is published
EVENT_BATCH_MAX = 512  # items per message: ~150 KiB of events, far below NATS' 1 MiB max_payload


class Batcher:
    """Structs for one subject, published as one JSON array per `window_s`.

    For per-request records nobody waits on (ServiceEvents, Finished): one message per request
    phase from every service was over half of the mesh's NATS messages; batched, they are a few
    messages per window for the whole load, and `add` costs the request path no await and no task.
    """

    def __init__(self, bus: Bus, subject: str, window_s: float = EVENT_BATCH_S) -> None:
        self.bus = bus
        self.subject = subject
        self.window_s = window_s
        self._batch: list[msgspec.Struct] = []
        self._timer: asyncio.TimerHandle | None = None
        self._flushes: set[asyncio.Task[None]] = set()

    def add(self, item: msgspec.Struct) -> None:
        self._batch.append(item)
        if len(self._batch) >= EVENT_BATCH_MAX:
            self._spawn_flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.window_s, self._spawn_flush)

    def _spawn_flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        t = asyncio.get_running_loop().create_task(self.flush())
        self._flushes.add(t)
        t.add_done_callback(self._flushes.discard)

    async def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._batch = self._batch, []
        if not batch:
            return
        try:
            await self.bus.nc.publish(self.subject, _encoder.encode(batch))
        except Exception:
            log.warning("dropping %d messages for %s: NATS publish failed", len(batch), self.subject, exc_info=True)

    async def close(self) -> None:
        """Publish what is left (call before the bus closes)."""
        await self.flush()
        if self._flushes:
            await asyncio.wait(list(self._flushes), timeout=1.0)


class EventBatcher(Batcher):
    """One service's ServiceEvents on `hetmesh.event.<service>`."""

    def __init__(self, bus: Bus, service: str, window_s: float = EVENT_BATCH_S) -> None:
        super().__init__(bus, subjects.event(service), window_s)
