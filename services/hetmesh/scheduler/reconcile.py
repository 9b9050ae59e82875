"""Reconciling the scheduler's in-flight requests with what the workers say they hold.

A request leaves the scheduler's books when its workers' Finished messages arrive. A Finished published
while the bus was restarting can be lost, and the request would then count as in flight for good (the
gauge, `hetmesh status`, WorkerLost for a request long over). Each heartbeat says how much its worker
holds (running + queued, a decode waiting for its KV included); a worker whose heartbeats said it held
nothing for `grace_s` after a request was sent to it does not hold that request any more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping


class IdleWatch:
    """Per worker, the span over which every heartbeat received said it held nothing."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._idle: dict[str, tuple[float, float]] = {}  # worker -> (first, last) idle heartbeat received

    def observe(self, worker_id: str, holds: int, now: float) -> None:
        if holds:
            self._idle.pop(worker_id, None)
        else:
            self._idle[worker_id] = (self._idle.get(worker_id, (now, now))[0], now)

    def reset(self) -> None:
        """After a bus outage: idleness counts again only from heartbeats received from now on."""
        self._idle.clear()

    def stale(self, by_worker: Mapping[str, Iterable[str]],
              sent_at: Callable[[str], float | None]) -> list[tuple[str, str]]:
        """(request, worker) pairs the worker no longer holds: idle, as heard, for `grace_s` since the request
        was sent to it (or since its idle span began, if later)."""
        out = []
        for worker_id, (first, last) in self._idle.items():
            if last - first < self.grace_s:
                continue
            for rid in by_worker.get(worker_id, ()):
                t = sent_at(rid)
                if t is not None and last - max(first, t) >= self.grace_s:
                    out.append((rid, worker_id))
        return out
