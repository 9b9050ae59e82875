"""The work queue: every WorkItem goes through one JetStream work-queue stream (`HETMESH_WORK`,
subjects `hetmesh.work.>`), so that no accepted request is lost while a worker or the bus is away.

- The scheduler publishes an item with `js.publish`, which returns once the stream has stored it
  (the PubAck); across a bus gap it publishes again with the same `Nats-Msg-Id` (`msg_id`), which the
  stream stores once (within `duplicate_window_s`). The item that streams an attempt (its FULL or its DECODE)
  has one id whatever the mode, so two placements of one attempt in different modes store one of them; a
  P/D placement whose DECODE was the duplicate withdraws its PREFILL (`withdrawals`).
- Each work subject has one durable push consumer: a worker's direct subject its own, a pool subject
  one shared by every worker of the pool (a deliver group). An item waits in the stream until a worker
  is there to take it, and a stream on file storage keeps it across a nats-server restart.
- A worker acks an item once its engine has taken it (or it answered the item with an error): from
  then on the request is the worker's, and should the worker die the scheduler's WorkerLost makes the
  gateway re-place it. So redelivery covers the gap between delivery and that point: a worker that
  died or hung before it (after `ack_wait_s`, at most `max_deliver` deliveries), or an ack lost to a bus gap.
- Side effects at most once per item: the worker remembers the ids it took (`RecentIds`) and acks and
  drops a redelivered or re-published copy.

Pure parts (ids, configs, `RecentIds`, the Cancels of a withdrawal) first; `WorkQueue` is the shell that
talks to the server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    PubAck,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from hetmesh import subjects
from hetmesh.bus import Bus
from hetmesh.config import WorkQueueConfig
from hetmesh.protocol import Cancel, Phase, WorkItem

log = logging.getLogger(__name__)

MSG_ID = "Nats-Msg-Id"  # JetStream's dedup header
STREAM_IN_USE = 10058  # JetStream error: the stream exists with another configuration
# JetStream errors: replicas > 1 on a single server; more replicas than JetStream nodes to place them on
NOT_CLUSTERED, NO_PEERS = 10074, 10005
SEQUENCE_NOT_FOUND = 10043  # JetStream error: no message at that sequence (taken and acked, or deleted)
API_TIMEOUT_S = 2.0  # one JetStream API call or PubAck; retried up to the caller's bound
ENSURE_WAIT_S = 30.0  # a restarted server may take a moment before JetStream answers
RECENT_IDS = 65_536  # per worker; redeliveries come within ack_wait_s * max_deliver, far fewer items than this
# What a bus gap or a restarting JetStream looks like to a publisher: worth another try.
TRANSIENT = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionReconnectingError,
             nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError, asyncio.TimeoutError)


STREAM_HALF = "stream"  # the id's last part for FULL and DECODE: the item that streams the tokens


def msg_id(item: WorkItem) -> str:
    """One item's identity: what the stream dedups on and what a worker remembers having taken.
    `<request_id>-<attempt>-stream` for the item that streams (FULL or DECODE: one per attempt, whatever
    mode placed it), `<request_id>-<attempt>-prefill` for a PREFILL."""
    r = item.request
    half = item.phase.value if item.phase == Phase.PREFILL else STREAM_HALF
    return f"{r.request_id}-{r.attempt}-{half}"


@dataclass(frozen=True, slots=True)
class Stored:
    """What one `WorkQueue.publish` got: the stream's PubAck, and whether it published more than once."""

    ack: PubAck
    retried: bool

    @property
    def held_before(self) -> bool:
        """The stream held this id before this call: another placement's item (of another scheduler, or an
        earlier one of this). A duplicate after a retry may be this call's own first copy, so it is not."""
        return bool(self.ack.duplicate) and not self.retried


def withdrawals(prefill: WorkItem, reason: str = "placed_twice") -> list[Cancel]:
    """A P/D placement's PREFILL stored while its DECODE was held before (another placement of the attempt
    streams it): Cancels for that prefill item, on its worker, and for the KV it may have shipped to the
    decode worker meanwhile, there. Each names its phase and attempt: the same worker may hold the other
    placement's FULL of the request, which goes on."""
    r, p = prefill.request, prefill.placement
    assert p.prefill_worker is not None, "only a P/D placement has a prefill to withdraw"
    return [Cancel(request_id=r.request_id, reason=reason, worker_id=w, phase=phase, attempt=r.attempt)
            for w, phase in ((p.prefill_worker, Phase.PREFILL), (p.decode_worker, Phase.DECODE))]


def stream_config(wq: WorkQueueConfig) -> StreamConfig:
    return StreamConfig(
        name=subjects.WORK_STREAM, subjects=[subjects.WORK_ALL], retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType(wq.storage), num_replicas=wq.replicas, max_msgs=wq.max_msgs, max_bytes=wq.max_bytes,
        max_age=wq.max_age_s, duplicate_window=wq.duplicate_window_s,
        discard=DiscardPolicy.NEW)  # full: refuse the new item (the submit gets 503), never drop a queued one


def consumer_config(work_subject: str, wq: WorkQueueConfig, pool: bool) -> ConsumerConfig:
    """The durable push consumer of one work subject; a pool's is shared through its deliver group."""
    name = subjects.work_consumer(work_subject)
    return ConsumerConfig(
        durable_name=name, filter_subject=work_subject, deliver_subject=subjects.work_deliver(work_subject),
        deliver_group=name if pool else None, deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.EXPLICIT,
        ack_wait=wq.ack_wait_s, max_deliver=wq.max_deliver)


class RecentIds:
    """The last `limit` ids added; the oldest is forgotten first."""

    def __init__(self, limit: int = RECENT_IDS) -> None:
        self.limit = limit
        self._ids: dict[str, None] = {}  # insertion-ordered

    def add(self, key: str) -> bool:
        """False when `key` is already there (a duplicate)."""
        if key in self._ids:
            return False
        if len(self._ids) >= self.limit:
            del self._ids[next(iter(self._ids))]
        self._ids[key] = None
        return True

    def __len__(self) -> int:
        return len(self._ids)


class WorkQueue:
    """One process's handle on the stream: creates or updates it and this process's consumers (idempotent,
    whoever starts first), again whenever the bus comes back (a memory stream does not survive a
    nats-server restart), and publishes items."""

    def __init__(self, bus: Bus, wq: WorkQueueConfig) -> None:
        self.bus = bus
        self.wq = wq
        self.js = bus.nc.jetstream(timeout=API_TIMEOUT_S)
        self.consumers: list[tuple[str, bool]] = []  # (work subject, pool) this process reads
        self._again: asyncio.Task[None] | None = None
        bus.on_reconnect.append(self._on_reconnect)

    async def ensure(self) -> None:
        """The stream and this process's consumers are in place, retried while JetStream is not answering."""
        async for attempt in AsyncRetrying(retry=retry_if_exception_type(TRANSIENT), reraise=True,
                                           wait=wait_exponential(multiplier=0.05, max=1.0),
                                           stop=stop_after_delay(ENSURE_WAIT_S)):
            with attempt:
                await self._ensure_stream()
                for subject, pool in self.consumers:
                    await self._ensure_consumer(subject, pool)

    async def consume(self, work_subject: str, pool: bool, cb: Callable[[Msg], Awaitable[None]]) -> Subscription:
        """Subscribe `cb` to the consumer of `work_subject` (created if need be). `cb` acks."""
        deliver = subjects.work_deliver(work_subject)
        sub = await self.bus.nc.subscribe(deliver, queue=subjects.work_consumer(work_subject) if pool else "", cb=cb,
                                          pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30)
        self.consumers.append((work_subject, pool))
        await self._ensure_consumer(work_subject, pool)
        return sub

    async def publish(self, subject: str, data: bytes, headers: dict[str, str], item_id: str) -> Stored:
        """Store one item; returns once the stream has it. Re-published with the same id (stored once) while
        the bus or the stream is away, up to `publish_timeout_s`; then the last error is raised."""
        headers = {**headers, MSG_ID: item_id}
        tries = 0
        async for attempt in AsyncRetrying(retry=retry_if_exception_type(TRANSIENT), reraise=True,
                                           wait=wait_exponential(multiplier=0.05, max=1.0),
                                           stop=stop_after_delay(self.wq.publish_timeout_s)):
            with attempt:
                tries += 1
                try:
                    ack = await self.js.publish(subject, data, timeout=API_TIMEOUT_S, headers=headers)
                    return Stored(ack, retried=tries > 1)
                except nats.js.errors.NoStreamResponseError:
                    # No stream (a memory one lost to a restart, before the reconnect hook made it again).
                    await self._ensure_stream()
                    raise
        raise AssertionError("unreachable: AsyncRetrying reraises")

    async def withdraw(self, stored: Stored) -> bool:
        """Take a stored item out of the stream (a withdrawn placement's): True when it was still there. A Cancel
        stops it on a worker that has it; one down when the Cancel went out would take it once back, were it
        left in the stream."""
        try:
            return bool(await self.js.delete_msg(subjects.WORK_STREAM, stored.ack.seq))
        except nats.js.errors.APIError as exc:
            if isinstance(exc, nats.js.errors.NotFoundError) or exc.err_code == SEQUENCE_NOT_FOUND:
                return False  # taken and acked already: the Cancel's
            raise

    async def _ensure_stream(self) -> None:
        cfg = stream_config(self.wq)
        try:
            await self.js.add_stream(cfg)
        except nats.js.errors.APIError as exc:
            if exc.err_code in (NOT_CLUSTERED, NO_PEERS):
                raise ValueError(f"work_queue.replicas = {cfg.num_replicas}, but the NATS server(s) cannot keep that "
                                 f"many copies ({exc.description}): replicas must not exceed the JetStream nodes "
                                 "of the cluster (1 on a single nats-server)") from exc
            if exc.err_code != STREAM_IN_USE:
                raise
            try:  # another configuration (an edited cluster file): take the new limits where JetStream allows
                await self.js.update_stream(cfg)
            except nats.js.errors.APIError as exc2:
                log.warning("work-queue stream %s kept as it is: %s", cfg.name, exc2.description)

    async def _ensure_consumer(self, work_subject: str, pool: bool) -> None:
        cfg = consumer_config(work_subject, self.wq, pool)
        try:
            await self.js.add_consumer(subjects.WORK_STREAM, cfg)
        except nats.js.errors.NotFoundError:
            raise
        except nats.js.errors.APIError as exc:
            if isinstance(exc, nats.js.errors.ServiceUnavailableError):
                raise
            # Exists with another configuration (ack_wait, max_deliver edited): it still delivers to the
            # same subject; `nats consumer rm` it to take the new settings.
            log.warning("work-queue consumer %s kept as it is: %s", cfg.durable_name, exc.description)

    async def _on_reconnect(self) -> None:
        # Not inline: nats-py awaits this inside its reconnect; JetStream calls need its read loop running.
        if self._again is None or self._again.done():
            self._again = asyncio.create_task(self._ensure_logged())

    async def _ensure_logged(self) -> None:
        try:
            await self.ensure()
        except Exception:
            log.exception("could not re-create the work-queue stream or consumers after a reconnect")
