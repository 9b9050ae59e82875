"""Which gateways are alive, from their beats (`hetmesh.gateway.alive.<instance>`): a request whose gateway
died has nobody to stream to, so the worker cancels it rather than decode for nobody.

A gateway counts as dead once heard and then silent for a heartbeat timeout. One never heard is left alone
(a test driving a worker directly, a gateway of an older release): silence proves nothing about it. The
worker's own bus outage hides every beat, so after one the clock starts again.
"""

from __future__ import annotations

from collections.abc import Iterable

from hetmesh import subjects

FORGET_S = 600.0  # a dead gateway's name is kept this long, for WorkItems of it still queued (work_queue.max_age_s)


class GatewayWatch:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._seen: dict[str, float] = {}
        self._quiet_until = 0.0  # no verdicts before this: this worker's own bus was away

    def heard(self, subject: str, now: float) -> None:
        self._seen[subject.rsplit(".", 1)[-1]] = now

    def bus_gap(self, now: float) -> None:
        """This worker's bus is away (or just came back): silence until a timeout from now says nothing."""
        self._quiet_until = now + self.timeout_s
        for g in self._seen:
            self._seen[g] = max(self._seen[g], now)

    def gone(self, now: float) -> set[str]:
        """Gateways heard once and silent for the timeout since."""
        if now < self._quiet_until:
            return set()
        for g in [g for g, t in self._seen.items() if now - t > FORGET_S]:
            del self._seen[g]
        return {g for g, t in self._seen.items() if now - t > self.timeout_s}

    def orphans(self, reply_subjects: Iterable[tuple[str, str]], now: float) -> list[str]:
        """Of (request id, reply subject) pairs, the requests whose gateway is gone."""
        gone = self.gone(now)
        if not gone:
            return []
        return [rid for rid, subject in reply_subjects if subjects.reply_gateway(subject) in gone]
