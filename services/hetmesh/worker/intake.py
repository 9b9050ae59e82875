"""A worker's work subscriptions, and how it lets go of them without stranding an item.

An item published to a worker's direct subject waits in that subject's durable consumer until the
worker takes it; one delivered to a subscription that is then dropped (`unsubscribe` discards what
nats-py had buffered) waits `work_queue.ack_wait_s` for its redelivery. A worker that stops taking
work (SIGTERM's drain, a role or model switch) therefore never just unsubscribes:

1. it leaves the pool at once (the pool's other workers take its next items), processing what was
   already delivered here;
2. it keeps the direct subscription while it drains, and the worker answers every item that still
   arrives (placed before the scheduler heard of the drain) at once with the retryable
   `worker_draining` hand-over, so the gateway places it again without waiting;
3. it lets go of the direct subscription only once the consumer has nothing undelivered, and no
   sooner than `not_before` (placements already under way when the draining heartbeat went out have
   reached the stream by then); `Subscription.drain` then unsubscribes and still processes whatever
   the server had sent before the unsubscribe.

What reaches the direct subject after that (a scheduler that missed every draining heartbeat) is the
scheduler's case: the worker's heartbeats stop (WorkerLost) or its next incarnation takes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.subscription import Subscription

from hetmesh import subjects
from hetmesh.workqueue import API_TIMEOUT_S, WorkQueue

log = logging.getLogger("hetmesh.worker")

EMPTY_POLL_S = 0.02  # how often a worker letting go asks JetStream whether its consumer is empty


async def leave_when_empty(queue: WorkQueue, sub: Subscription | None, subject: str, not_before: float,
                           limit_s: float) -> int:
    """Let go of the direct subscription `sub` to `subject` once its consumer holds nothing undelivered: not
    before `not_before` (time.monotonic()), waiting at most `limit_s` past it for the consumer to empty.
    Returns how many items were still undelivered when it let go (0 unless the limit ran out)."""
    if sub is None:
        return 0
    left = -1
    try:
        await asyncio.sleep(max(0.0, not_before - time.monotonic()))
        deadline = time.monotonic() + limit_s
        left = await _undelivered(queue, subject)
        while left and time.monotonic() < deadline:
            await asyncio.sleep(EMPTY_POLL_S)
            left = await _undelivered(queue, subject)
    finally:  # also when cancelled (SIGTERM's drain takes over from a switch's): never left subscribed
        await leave(queue, sub, subject)
    return left


async def leave(queue: WorkQueue, sub: Subscription | None, subject: str) -> None:
    """Unsubscribe, processing what the server sent before it; the reconnect hook forgets the consumer."""
    queue.consumers = [c for c in queue.consumers if c[0] != subject]
    if sub is None:
        return
    try:
        await sub.drain()
    except Exception:  # the connection is closed or draining: nothing more arrives either way
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def _undelivered(queue: WorkQueue, subject: str) -> int:
    name = subjects.work_consumer(subject)
    try:
        info = await queue.js.consumer_info(subjects.WORK_STREAM, name, timeout=API_TIMEOUT_S)
    except Exception as exc:  # the bus is away: nothing to learn, nothing to wait for
        log.warning("could not read work consumer %s: %r", name, exc)
        return 0
    return info.num_pending or 0
