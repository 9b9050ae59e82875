"""Which gateways are alive, from their beats (`hetmesh.gateway.alive.<instance>`): a request whose gateway
died has nobody to stream to, so the worker cancels it rather than decode for nobody.

A gateway counts as dead once heard and then silent for a heartbeat timeout, and its reply subscription is
gone from the bus (a request there gets "no responders"): a gateway whose event loop only runs late still
holds its subscription, and its streams go on. One never heard is left alone (a test driving a worker
directly, a gateway of an older release): silence proves nothing about it. The worker's own bus outage
hides every beat, so after one the clock starts again.
"""

from __future__ import annotations

from collections.abc import Iterable

import nats.errors
from nats.aio.client import Client

from hetmesh import subjects
from hetmesh.beats import Beats

PROBE_TIMEOUT_S = 0.5

FORGET_S = 600.0  # a dead gateway's name is kept this long, for WorkItems of it still queued (work_queue.max_age_s)


class GatewayWatch:
    def __init__(self, timeout_s: float) -> None:
        self._beats = Beats(timeout_s)
        self._quiet_until = 0.0  # no verdicts before this: this worker's own bus was away
        self.dead: set[str] = set()  # silent, and their reply subscription gone

    async def sweep(self, nc: Client, now: float) -> set[str]:
        """The gateways now known dead: each newly silent one is probed on its reply subject; one that still
        answers (late) is counted as heard."""
        for g in self.gone(now) - self.dead:
            if await unreachable(nc, g):
                self.dead.add(g)
            else:
                self._beats.heard(g, now)
        return self.dead

    def heard(self, subject: str, now: float) -> None:
        g = subject.rsplit(".", 1)[-1]
        self._beats.heard(g, now)
        self.dead.discard(g)  # only cut off from the bus for a while: it is back

    def bus_gap(self, now: float) -> None:
        """This worker's bus is away (or just came back): silence until a timeout from now says nothing."""
        self._quiet_until = now + self._beats.timeout_s
        self._beats.bus_gap(now)

    def gone(self, now: float) -> set[str]:
        """Gateways heard once and silent for the timeout since."""
        if now < self._quiet_until:
            return set()
        self.dead.difference_update(self._beats.forget_silent(now, FORGET_S))
        return self._beats.silent(now)

    @staticmethod
    def orphans(reply_subjects: Iterable[tuple[str, str]], dead: set[str]) -> list[str]:
        """Of (request id, reply subject) pairs, the requests whose gateway is dead."""
        if not dead:
            return []
        return [rid for rid, subject in reply_subjects if subjects.reply_gateway(subject) in dead]


async def unreachable(nc: Client, gateway: str) -> bool:
    """Nothing subscribes to `gateway`'s reply subjects any more. A live gateway answers the probe (its
    reply subscription refuses the empty body) or lets it time out; only "no responders" says it is gone."""
    try:
        await nc.request(subjects.reply_to(gateway, "probe"), b"", timeout=PROBE_TIMEOUT_S)
    except nats.errors.NoRespondersError:
        return True
    except (nats.errors.Error, TimeoutError):
        return False
    return False
