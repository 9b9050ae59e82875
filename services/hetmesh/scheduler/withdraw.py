"""Taking back a placement that another scheduler's earlier booking, heard late, would have changed.

hetmesh.placement.withdrawal decides (the order of two placements, the placement made again); this keeps the
scheduler's recent placements and says what to send. The placement goes back only through its worker: a
`Cancel(reason="withdrawn")` for its FULL or PREFILL item, and the worker drops the item only if its engine
has not started it (then it cancels the DECODE half itself and answers the gateway with a retryable
`RequestError(code="withdrawn")`, which the gateway places anew as the next attempt, marked `moved`); one
the engine has started goes on. The other schedulers un-book it on a `Booked(withdrawn=True)`.

Only with a policy that can take a booking back (the cost policy) and without flow control (whose fair
queue books what it places in its own order); a request placed again after a withdrawal (`moved`) stays
where it lands, as does a migration (tokens already out: taking it back would use up one of its migrations).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from msgspec.structs import replace

from hetmesh.placement import ClusterState, Decision, RequestInfo, WorkerView
from hetmesh.placement.withdrawal import Key, Placed, Recent, Withdrawing, reconsider
from hetmesh.protocol import Booked, Cancel, InferenceRequest, Phase


@dataclass(frozen=True, slots=True)
class Own:
    request_id: str
    attempt: int


@dataclass(frozen=True, slots=True)
class Taken:
    """A placement to take back: the Cancel for its worker, the booking's withdrawal for the others."""

    request_id: str
    cancel: Cancel
    booked: Booked


class Withdrawals:
    def __init__(self, policy: object, state: ClusterState, instance: str, horizon_s: float,
                 time_scale: float, enabled: bool) -> None:
        self._book = getattr(policy, "booked", None)
        self._unbook = getattr(policy, "withdrawn", None)
        self.policy: Withdrawing | None = policy if enabled and hasattr(policy, "withdrawn") else None  # type: ignore[assignment]
        self.state = state
        self.instance = instance
        self.time_scale = time_scale  # the policy's clock is the engines' (virtual) time
        self.recent: Recent[Own] = Recent(horizon_s)

    def placed(self, req: InferenceRequest, info: RequestInfo, d: Decision, placed_at: float) -> None:
        """One of its own placements, `placed_at` on the wall clock (Booked.placed_at)."""
        if self.policy is not None and not req.moved and not req.continued:  # a migration stays too
            self.recent.add(Placed((placed_at, self.instance), placed_at, info, d, Own(req.request_id, req.attempt)))

    def count(self, booked: Sequence[tuple[Key, Decision]], withdrawn: Sequence[Decision],
              now: float) -> tuple[int, list[Taken]]:
        """Other schedulers' bookings heard at `now` (wall clock; bookings.sift says which count): each counted
        on its workers and booked in the policy, each withdrawal un-booked, and this scheduler's own placements
        the bookings move (`heard`). How many of its own stayed, and those to take back."""
        for d in withdrawn:
            self.state.withdrawn(d)
            if self._unbook is not None:
                self._unbook(d, now * self.time_scale)
        kept, taken = 0, []
        for key, d in booked:
            self.state.assigned(d)
            if self._book is not None:
                self._book(d)
            k, t = self.heard(key, d, now)
            kept += k
            taken += t
        return kept, taken

    def heard(self, key: Key, d: Decision, now: float) -> tuple[int, list[Taken]]:
        """Another scheduler's booking `d` (its key), heard at `now` (wall clock) and counted: each of this one's
        placements after it on one of its workers is placed again knowing of it. How many stayed, and those
        that move, to take back (already un-booked here)."""
        if self.policy is None:
            return 0, []
        kept, out = 0, []
        for p in self.recent.behind(key, d.workers, now):
            q = p.decision

            def views(q: Decision = q) -> Sequence[WorkerView]:
                self.state.withdrawn(q)
                return self.state.views()

            t = now * self.time_scale
            info = replace(p.info, arrival=t, waited_s=p.info.waited_s + max(t - p.info.arrival, 0.0))
            again = reconsider(self.policy, info, q, views, t)
            if again is not None:  # it stays, booked again behind d
                self.state.assigned(again)
                p.decision = again
                kept += 1
                continue
            self.recent.drop(p)
            out.append(self._take(p))
        return kept, out

    def _take(self, p: Placed[Own]) -> Taken:
        q = p.decision
        worker, phase = (q.decode_worker, Phase.FULL) if q.prefill_worker is None else (q.prefill_worker, Phase.PREFILL)
        rid = p.tag.request_id
        return Taken(rid, Cancel(request_id=rid, reason="withdrawn", worker_id=worker, phase=phase,
                                 attempt=p.tag.attempt),
                     Booked(scheduler=self.instance, request_id=rid, decode_worker=q.decode_worker,
                            prefill_worker=q.prefill_worker, booking=q.booking, placed_at=p.key[0], withdrawn=True))
