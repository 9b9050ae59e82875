"""Other schedulers' placements heard on `hetmesh.sched.booked`, sifted before they count in this one's view.

A booking counts only when it comes from a scheduler heard beating (`hetmesh.sched.alive.<instance>`)
within the heartbeat timeout and names workers in this view. A booking from any other instance (a scheduler
of another mesh on the same bus, one left over from a partition, a malformed sender) is set aside: counting
it would price the fleet as busier than it is until the workers' next heartbeats, and those heartbeats count
whatever the placement really put on the workers anyway. Nothing is lost by setting one aside: a booking
only estimates load between heartbeats; the work itself travels on the work queue.

The same beats say which scheduler writes workers' KV events into the Redis prefix index (`Peers.writer`);
`beat` sends this scheduler's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from hetmesh import subjects
from hetmesh.beats import Beats
from hetmesh.bus import Bus
from hetmesh.placement import Decision
from hetmesh.placement.withdrawal import Key
from hetmesh.protocol import Booked


class Peers(Beats):
    """The scheduler instances heard beating, and when last."""

    async def on_alive(self, m: Msg) -> None:  # hetmesh.sched.alive.<instance>
        self.heard(m.subject.rsplit(".", 1)[-1], time.monotonic())

    def writer(self, me: str, now: float) -> bool:
        """Whether `me` writes the KV index: the smallest instance id among itself and the schedulers heard
        beating within the timeout (one writer at a time; the next one takes over once the writer's beats stop)."""
        return all(me <= i for i in self.live(now))


async def beat(bus: Bus, instance: str, interval_s: float, reconnects: Callable[[], int],
               then: Callable[[], Awaitable[None]]) -> None:
    """Beat on `hetmesh.sched.alive.<instance>` every `interval_s` while connected, with `reconnects()` (a gateway
    sends again what it still waits on when that grows), and `then()` after each beat."""
    subject = subjects.sched_alive(instance)
    while True:
        if bus.nc.is_connected:
            await bus.nc.publish(subject, str(reconnects()).encode())
            await then()
        await asyncio.sleep(interval_s)


@dataclass
class Sifted:
    booked: list[tuple[Key, Decision]] = field(default_factory=list)  # to count on their workers and book in the
    # policy, each with its order (hetmesh.placement.withdrawal)
    withdrawn: list[Decision] = field(default_factory=list)  # taken back by their scheduler: to un-book
    lags: list[float] = field(default_factory=list)  # each known scheduler's booking: seconds since its placement
    unknown_scheduler: int = 0  # from a scheduler not heard beating
    unknown_worker: int = 0  # naming a worker this view has lost (or not heard yet)


def sift(batch: Iterable[Booked], me: str, known_scheduler: Callable[[str], bool],
         known_worker: Callable[[str], bool], now: float) -> Sifted:
    """What of `batch` counts here: not this scheduler's own echoes (`me`), nor bookings from schedulers or of
    workers it does not know. `now`: the wall clock, for each booking's lag."""
    out = Sifted()
    for b in batch:
        if b.scheduler == me:
            continue
        if not known_scheduler(b.scheduler):
            out.unknown_scheduler += 1
            continue
        out.lags.append(max(now - b.placed_at, 0.0))
        d = Decision(mode="aggregated" if b.prefill_worker is None else "disaggregated",
                     decode_worker=b.decode_worker, prefill_worker=b.prefill_worker, booking=b.booking)
        if not all(known_worker(w) for w in d.workers):
            out.unknown_worker += 1
            continue
        if b.withdrawn:
            out.withdrawn.append(d)
        else:
            out.booked.append(((b.placed_at, b.scheduler), d))
    return out
