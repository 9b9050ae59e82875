"""Reconciling the scheduler's in-flight requests with what the workers say they hold.

A request leaves the scheduler's books when its workers' Finished messages arrive. A Finished published
while the bus was restarting can be lost, and the request would then count as in flight for good (the
gauge, `hetmesh status`, WorkerLost for a request long over). Each heartbeat says how much its worker
holds (running + queued, a decode waiting for its KV included); a worker whose heartbeats said it held
nothing for `grace_s` after a request was sent to it does not hold that request any more.
"""

from __future__ import annotations

from collections import defaultdict
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


class _Held:
    __slots__ = ("attempt", "reply_subject", "sent", "workers")

    def __init__(self, reply_subject: str, workers: set[str], sent: float, attempt: int) -> None:
        self.reply_subject = reply_subject
        self.workers = workers
        self.sent = sent
        self.attempt = attempt


class InFlight:
    """The requests this scheduler placed that have not finished, by request and by worker: whom a lost
    worker's WorkerLost goes to, and what `hetmesh status` counts in flight."""

    def __init__(self, idle_grace_s: float) -> None:
        self.requests: dict[str, _Held] = {}
        self.by_worker: dict[str, set[str]] = defaultdict(set)
        self.idle = IdleWatch(idle_grace_s)  # drops entries whose Finished was lost
        # per worker counted lost (silent), the requests it held then, all failed over: should it come back with
        # the same run (a partition healed), it still runs them, for reply subjects nobody reads any more
        self.left_behind: dict[str, list[str]] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def record(self, rid: str, reply_subject: str, workers: set[str], now: float, attempt: int = 0) -> None:
        """A new attempt replaces the last one: its workers no longer hold the request (were one of them lost
        or back as a new run, it must not send this attempt a WorkerLost)."""
        self.forget(rid)
        self.requests[rid] = _Held(reply_subject, workers, now, attempt)
        for w in workers:
            self.by_worker[w].add(rid)

    def forget(self, rid: str) -> None:
        held = self.requests.pop(rid, None)
        if held is not None:
            for w in held.workers:
                self.by_worker.get(w, set()).discard(rid)

    def lost(self, worker_id: str, silent: bool = False) -> list[tuple[str, str | None]]:
        """Every request `worker_id` held leaves the books: (request, the reply subject to tell, or None where
        the request is no longer in flight). `silent`: the worker may come back (`left_behind`)."""
        out: list[tuple[str, str | None]] = []
        for rid in self.by_worker.pop(worker_id, set()):
            held = self.requests.get(rid)
            self.forget(rid)
            out.append((rid, held.reply_subject if held is not None else None))
        if silent and out:
            self.left_behind[worker_id] = [rid for rid, _ in out]
        return out

    def back(self, worker_id: str, seen: str) -> list[str]:
        """A heartbeat of `worker_id` said `seen` (ClusterState.observe): what it was left holding when counted
        lost, now to drop there, if it rejoined with that run; nothing for a new run (it holds nothing)."""
        left = self.left_behind.pop(worker_id, []) if seen else []
        return left if seen == "rejoined" else []

    def finished(self, worker_id: str, rid: str) -> bool | None:
        """`worker_id` is done with `rid`: True when that was its last worker (the request is over), False when
        another still holds it (P/D), None when it was not in flight here."""
        held = self.requests.get(rid)
        if held is None:
            return None
        held.workers.discard(worker_id)
        self.by_worker.get(worker_id, set()).discard(rid)
        if held.workers:
            return False
        del self.requests[rid]
        return True

    def withdrawn(self, worker_id: str, rid: str, attempt: int) -> None:
        """`worker_id` dropped its item of `attempt` (a withdrawn placement): out of the books if that attempt is
        still the one held (a newer attempt placed meanwhile, here, keeps its own workers)."""
        held = self.requests.get(rid)
        if held is not None and held.attempt == attempt:
            self.finished(worker_id, rid)

    def reconcile(self) -> tuple[int, list[str]]:
        """Forget what the workers' heartbeats say they no longer hold (their Finished lost on the bus):
        (how many (request, worker) pairs went, the requests that left the books wholly)."""
        stale = self.idle.stale(self.by_worker, lambda rid: h.sent if (h := self.requests.get(rid)) else None)
        gone = []
        for rid, worker_id in stale:
            if self.finished(worker_id, rid):
                gone.append(rid)
            self.by_worker[worker_id].discard(rid)
        return len(stale), gone
