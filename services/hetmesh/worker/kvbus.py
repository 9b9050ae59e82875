"""A worker's KV traffic on the bus: KV landing for its decodes (relayed chunks, direct streams, the
sender's KvLanded), and its prefix cache's events going out to the schedulers' prefix index (batched,
or all at once when the index was lost). The rules stay in the pure state it calls (`requests.RequestBook`,
`kv.KvInbox`, `kv.CacheMirror`); this is the shell around them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nats.aio.msg import Msg

from hetmesh import kvstream, subjects
from hetmesh.bus import Bus
from hetmesh.engines.base import Engine
from hetmesh.protocol import KvEvent, KvLanded, KvResync, KvTransferRequest

from .kv import CacheMirror, KvInbox
from .outbox import Outbox
from .phases import Run
from .requests import RequestBook

log = logging.getLogger("hetmesh.worker")

KV_EVENT_PERIOD_S = 0.05  # coalescing window for KvEvent batches


class KvBus:
    """`engine` and `model`: the worker's current ones (a model switch replaces them)."""

    def __init__(self, bus: Bus, worker_id: str, book: RequestBook[Run], inbox: KvInbox[kvstream.KvSink],
                 out: Outbox, engine: Callable[[], Engine], model: Callable[[], str]) -> None:
        self.bus, self.worker_id, self.book, self.inbox, self.out = bus, worker_id, book, inbox, out
        self.engine, self.model = engine, model
        self.cache = CacheMirror()  # what the engine's prefix cache holds, mirrored from its KV events

    # ------------------------------------------------------------------ KV arriving for decodes
    async def on_kv_landed(self, landed: KvLanded, _m: Msg) -> None:
        self.landed(landed)

    def landed(self, landed: KvLanded) -> None:
        r = self.book.landed(landed, time.time())
        if r is not None and r.handle.kv is not None and not r.handle.kv.done():
            r.handle.kv.set_result(landed)

    async def on_kv_recv(self, m: Msg) -> None:
        """A relayed chunk (kv-transfer publishes one transfer's chunks in order)."""
        h = m.headers or {}
        self.inbox.chunk(h.get("Kv-Transfer", ""), m.data, int(h.get("Kv-Seq", "-1")), time.time())

    def open_sink(self, header: KvTransferRequest) -> kvstream.KvSink:
        if self.book.was_cancelled(header.request_id):
            raise ValueError("request cancelled")
        return self.engine().kv_sink(header.request_id, header.nbytes)

    async def stream_landed(self, header: KvTransferRequest, sink: kvstream.KvSink, seconds: float) -> None:
        if self.book.was_cancelled(header.request_id):  # cancelled while it streamed in
            sink.discard()
            return
        self.inbox.streamed(header.transfer_id, header.nbytes, sink, time.time())
        self.landed(KvLanded.of(header, nbytes=header.nbytes, chunks=1, duration_s=seconds, direct=True))

    async def stream_failed(self, header: KvTransferRequest, why: str) -> None:
        self.landed(KvLanded.of(header, ok=False, error=why))

    # ------------------------------------------------------------------ the prefix cache's events
    async def publish_events(self, force_cleared: bool = False) -> None:
        b = self.engine().kv_events()
        self.cache.apply(b.stored, b.removed, b.cleared)
        if b or force_cleared:
            await self.bus.publish(subjects.kv_events(self.worker_id), KvEvent(
                worker_id=self.worker_id, model=self.model(), stored=b.stored, removed=b.removed,
                cleared=b.cleared or force_cleared, ts=time.time()))

    async def on_kv_resync(self, r: KvResync, _m: Msg) -> None:
        """The prefix index was lost (e.g. Redis restarted): publish everything the cache holds."""
        await self.publish_events()  # bring the mirror up to date first
        for i, part in enumerate(self.cache.batches()):
            await self.bus.publish(subjects.kv_events(self.worker_id), KvEvent(
                worker_id=self.worker_id, model=self.model(), stored=part, cleared=i == 0, ts=time.time()))
        self.out.event("", "kv_resynced", blocks=len(self.cache.held), reason=r.reason)

    async def event_loop(self) -> None:
        while True:
            await asyncio.sleep(KV_EVENT_PERIOD_S)
            try:
                await self.publish_events()
            except Exception:
                log.exception("publishing KV events failed")
