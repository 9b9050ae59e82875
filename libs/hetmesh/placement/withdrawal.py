"""A placement withdrawn with its booking: what a scheduler replica does when it hears, late, another
replica's earlier placement on a worker it has placed on since without knowing of it.

Two placements are ordered by their key, (placed_at, scheduler) on the bus: every replica reads the same
fields, so all agree which came first. The later one's replica un-books its own (`reconsider`), places it
again knowing of the earlier one, and where its policy now picks the same workers it stays (booked again);
where it picks others or refuses it, the placement is taken back: the worker drops it if its engine has not
started it (the engine is the arbiter) and the request is placed anew, once per request, so withdrawals never
chase each other. The live scheduler (hetmesh.scheduler.withdraw) and the simulator (hetmesh.sim.replicas)
use these same pieces.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from hetmesh.placement.admission import REFUSED
from hetmesh.placement.state import Decision, RequestInfo, WorkerView

T = TypeVar("T")
Key = tuple[float, str]  # (placed_at, scheduler): the order all replicas agree on


class Withdrawing(Protocol):
    """A policy that can take back what it booked (CostPolicy)."""

    def place(self, req: RequestInfo, workers: Sequence[WorkerView]) -> Decision | None: ...

    def withdrawn(self, decision: Decision, now: float) -> None: ...


@dataclass(slots=True, eq=False)
class Placed(Generic[T]):
    """One of this replica's placements that may still be withdrawn (itself, by identity: `Recent.drop`)."""

    key: Key
    at: float  # the caller's clock when placed
    info: RequestInfo
    decision: Decision
    tag: T  # the caller's: what it needs to take the placement back


class Recent(Generic[T]):
    """A replica's own placements of the last `horizon_s`, by worker: a booking heard later than that comes after
    the workers' next heartbeats, which count both placements anyway."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._by_worker: dict[str, deque[Placed[T]]] = {}

    def add(self, p: Placed[T]) -> None:
        for w in p.decision.workers:
            q = self._by_worker.setdefault(w, deque())
            self._prune(q, p.at)
            q.append(p)

    def _prune(self, q: deque[Placed[T]], now: float) -> None:
        while q and q[0].at < now - self.horizon_s:
            q.popleft()

    def drop(self, p: Placed[T]) -> None:
        """Withdrawn: it cannot be withdrawn again."""
        for w in p.decision.workers:
            q = self._by_worker.get(w)
            if q is not None and p in q:
                q.remove(p)

    def behind(self, key: Key, workers: Iterable[str], now: float) -> list[Placed[T]]:
        """Own placements after `key` on one of `workers`, in placement order (those past the horizon
        forgotten)."""
        out: dict[int, Placed[T]] = {}
        for w in workers:
            q = self._by_worker.get(w)
            if not q:
                continue
            self._prune(q, now)
            for p in q:
                if p.key > key:
                    out[id(p)] = p
        return sorted(out.values(), key=lambda p: p.key) if len(out) > 1 else list(out.values())


def reconsider(policy: Withdrawing, info: RequestInfo, q: Decision, views: Callable[[], Sequence[WorkerView]],
               now: float) -> Decision | None:
    """Un-book `q` (the placement of `info`, which must carry its arrival and wait as of `now`) and place it
    again on `views()` (the caller's view without q). The placement booked again when the policy picks q's
    workers again (it stays); None when it picks others or refuses it: then nothing of it stays booked, and
    the caller takes q back and has the request placed anew."""
    policy.withdrawn(q, now)
    again = policy.place(info, views())
    if again is not None and again.mode != REFUSED:
        if again.workers == q.workers:
            return again
        policy.withdrawn(again, now)  # placed anew by the caller's own path
    return None
