"""Which schedulers are alive, and a submit that survives the death of the one it went to.

Every scheduler beats on `hetmesh.sched.alive.<instance>` and also takes submits on its own subject
(`hetmesh.sched.submit.<instance>`). The gateway sends each request to one live scheduler, chosen at random
(the load spreads like the queue group's), and watches it: if its beats stop for a heartbeat timeout before
it answered (killed mid-placement), the request goes to another live one with the same attempt. A WorkItem
the dead one had already stored carries the same dedup id (`<request_id>-<attempt>-<phase>`), so the stream
keeps it once and the request is served once. A scheduler gone from the bus answers at once with "no
responders": the next one is tried without waiting. With none known (just started) the shared queue-group
subject is used, as before.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors

from hetmesh import subjects

T = TypeVar("T")


class Schedulers:
    def __init__(self, timeout_s: float, check_s: float) -> None:
        self.timeout_s = timeout_s  # silent this long: gone
        self.check_s = check_s  # how often a waiting submit looks at its scheduler
        self._seen: dict[str, float] = {}
        self._rng = random.Random()
        self.lost = 0  # submits sent again because their scheduler went away before answering

    def heard(self, instance: str, now: float) -> None:
        self._seen[instance] = now

    def touch_all(self, now: float) -> None:
        """After this gateway's own bus outage: the beats it missed say nothing about the schedulers."""
        for k in self._seen:
            self._seen[k] = max(self._seen[k], now)

    def alive(self, instance: str, now: float) -> bool:
        seen = self._seen.get(instance)
        return seen is not None and now - seen <= self.timeout_s

    def pick(self, now: float, exclude: set[str]) -> str | None:
        live = [k for k in self._seen if k not in exclude and self.alive(k, now)]
        return self._rng.choice(live) if live else None

    def drop(self, instance: str) -> None:
        self._seen.pop(instance, None)

    async def submit(self, send: Callable[[str], Awaitable[T]], connected: Callable[[], bool],
                     on_lost: Callable[[str], None]) -> T:
        """`send(subject)` the request and return its answer; sent again to another live scheduler while the
        one it went to is gone. `connected`: this gateway's bus is up (while it is down, silence proves
        nothing). Raises what `send` raises (its own timeout, no responders on the shared subject)."""
        loop = asyncio.get_running_loop()
        tried: set[str] = set()
        while True:
            target = self.pick(loop.time(), tried)
            if target is None:
                return await send(subjects.SUBMIT)
            tried.add(target)
            task = asyncio.ensure_future(send(subjects.sched_submit(target)))
            gone = False
            try:
                while not gone:
                    done, _ = await asyncio.wait({task}, timeout=self.check_s)
                    if done:
                        break
                    gone = connected() and not self.alive(target, loop.time())
            finally:
                if not task.done():
                    task.cancel()
            if gone:
                self.lost += 1
                on_lost(target)
                continue
            try:
                return task.result()
            except nats.errors.NoRespondersError:  # its subscription is gone: it died or is stopping
                self.drop(target)
