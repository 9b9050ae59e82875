"""Which schedulers are alive, and a submit that survives the death of the one it went to.

Every scheduler beats on `hetmesh.sched.alive.<instance>` and also takes submits on its own subject
(`hetmesh.sched.submit.<instance>`). The gateway sends each request to one live scheduler, chosen at random
(the load spreads like the queue group's), and watches it: if its beats stop for a heartbeat timeout before
it answered (killed mid-placement), the request goes to another live one with the same attempt. A WorkItem
the dead one had already stored carries the same dedup id (`hetmesh.workqueue.msg_id`), so the stream
keeps it once and the request is served once. A scheduler gone from the bus answers at once with "no
responders": the next one is tried without waiting. With none known (just started) the shared queue-group
subject is used, as before.

A submit and its answer are core NATS: a bus gap on either side can eat them (a node of a NATS cluster
dying under the gateway or the scheduler). So a submit still waiting is sent again, to the same scheduler,
when this gateway reconnects or when its scheduler's beat says that it did (the beat carries a count of its
reconnects).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors

from hetmesh import subjects
from hetmesh.beats import Beats

T = TypeVar("T")


class Schedulers:
    def __init__(self, timeout_s: float, check_s: float) -> None:
        self.check_s = check_s  # how often a waiting submit looks at its scheduler
        self._beats = Beats(timeout_s)
        self._epoch: dict[str, bytes] = {}  # scheduler -> its count of reconnects, as its beat says
        self._gaps = 0  # this gateway's own reconnects
        self._rng = random.Random()
        self.lost = 0  # submits sent again because their scheduler went away before answering
        self.resent = 0  # submits sent again after a bus gap

    def heard(self, instance: str, now: float, epoch: bytes = b"") -> None:
        self._beats.heard(instance, now)
        self._epoch[instance] = epoch

    def bus_gap(self, now: float) -> None:
        """This gateway reconnected: what it sent or was sent meanwhile may be lost, and the beats it missed
        say nothing about the schedulers."""
        self._gaps += 1
        self._beats.bus_gap(now)

    def _mark(self, target: str | None) -> tuple[int, bytes]:
        return self._gaps, self._epoch.get(target, b"") if target is not None else b""

    def paused(self, seconds: float, now: float) -> None:
        """This gateway's process did not run for `seconds` (`hetmesh.beats.overslept`): no scheduler's silence."""
        self._beats.paused(seconds, now)

    def alive(self, instance: str, now: float) -> bool:
        return self._beats.alive(instance, now)

    def pick(self, now: float, exclude: set[str]) -> str | None:
        live = [k for k in self._beats.live(now) if k not in exclude]
        return self._rng.choice(live) if live else None

    def drop(self, instance: str) -> None:
        self._beats.forget(instance)

    async def submit(self, send: Callable[[str], Awaitable[T]], connected: Callable[[], bool],
                     on_lost: Callable[[str], None]) -> T:
        """`send(subject)` the request and return its answer; sent again to another live scheduler while the
        one it went to is gone. `connected`: this gateway's bus is up (while it is down, silence proves
        nothing). Raises what `send` raises (its own timeout, no responders on the shared subject)."""
        loop = asyncio.get_running_loop()
        tried: set[str] = set()
        while True:
            target = self.pick(loop.time(), tried)
            mark = self._mark(target)
            task = asyncio.ensure_future(send(subjects.SUBMIT if target is None else subjects.sched_submit(target)))
            why = ""  # gone: its scheduler died; gap: a bus gap may have eaten the submit or its answer
            try:
                while not why:
                    done, _ = await asyncio.wait({task}, timeout=self.check_s)
                    if done:
                        break
                    if self._mark(target) != mark:
                        why = "gap"
                    elif target is not None and connected() and not self.alive(target, loop.time()):
                        why = "gone"
            finally:
                if not task.done():
                    task.cancel()
            if why == "gap":
                self.resent += 1
                continue
            if why == "gone":
                assert target is not None
                tried.add(target)
                self.lost += 1
                on_lost(target)
                continue
            try:
                return task.result()
            except nats.errors.NoRespondersError:  # its subscription is gone: it died or is stopping
                if target is None:
                    raise
                tried.add(target)
                self.drop(target)
