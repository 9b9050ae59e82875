"""A worker's per-request bookkeeping as pure state: events in, decisions out.

No asyncio, NATS or clock reads here (`now` comes in, seconds on one clock of the caller's choice),
so every rule of intake, cancel, supersede and the KV wait is unit-testable without a mesh. The
service keeps the wiring: it owns the tasks and futures (a request's opaque `handle`) and acts on
what this says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

from hetmesh.protocol import KvLanded, Phase, WorkItem

EARLY_MAX = 10_000  # KvLanded / Cancel messages kept for a WorkItem still on its way
STALE_S = 120.0  # ... and for this long

H = TypeVar("H")
K = TypeVar("K")


class Verdict(StrEnum):
    """What to do with an incoming WorkItem."""

    ACCEPT = "accept"
    DRAINING = "draining"  # shutting down: a retryable 503
    DUPLICATE = "duplicate"  # this attempt (or a newer one) is being served: ignore it
    SUPERSEDE = "supersede"  # an older attempt is being served: drop that one first, then ask again
    MISROUTED = "misrouted"  # for a model this worker does not serve
    CANCELLED = "cancelled"  # its Cancel came first
    WITHDRAWN = "withdrawn"  # its scheduler's withdrawal came first: the gateway places it anew


class Stop(StrEnum):
    """How to stop a request this worker holds."""

    NONE = "none"  # not held here (a Cancel for a WorkItem still on its way is remembered)
    KV_WAIT = "kv_wait"  # a decode still waiting for its KV, nothing in the engine yet: cancel its task
    SHIPPING = "shipping"  # a prefill done in the engine, its KV on the way out: cancel its task (aborts the stream)
    ENGINE = "engine"  # abort it in the engine; its stream ends with finish_reason "abort"


@dataclass(slots=True)
class Request(Generic[H]):
    """One request being served here (one attempt of it)."""

    item: WorkItem
    received: float  # when its WorkItem arrived
    handle: H  # the service's own: its task, its KV future
    waiting_for_kv: bool = False  # a DECODE item whose KV has not landed yet
    shipping: bool = False  # a PREFILL item whose engine part is over, shipping its KV
    cancelled: bool = False  # the client went away: end quietly (event "aborted")
    withdrawn: bool = False  # taken back by its scheduler before the engine started it: placed anew
    superseded: bool = False  # a newer attempt takes the id over: end without a word

    @property
    def request_id(self) -> str:
        return self.item.request.request_id

    @property
    def attempt(self) -> int:
        return self.item.request.attempt


class RequestBook(Generic[H]):
    """Every request a worker holds, plus KvLanded and Cancel messages that beat their WorkItem."""

    def __init__(self, model: str, early_max: int = EARLY_MAX, stale_s: float = STALE_S) -> None:
        self.model = model
        self.early_max = early_max
        self.stale_s = stale_s
        self.draining = False
        self._live: dict[str, Request[H]] = {}
        self._early_landed: dict[str, tuple[KvLanded, float]] = {}
        self._early_cancels: dict[str, float] = {}
        self._early_withdrawn: dict[tuple[str, int, Phase], float] = {}  # one item's Cancel (Cancel.phase)
        self._early_taken: dict[tuple[str, int, Phase], float] = {}  # one item's withdrawal (`withdraw`)
        self._cancelled: dict[str, float] = {}  # every cancelled id, for a while: KV for them is refused/dropped
        # Kept as a count: the metrics thread reads it while the event loop changes the requests.
        self.kv_waiting = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def get(self, request_id: str) -> Request[H] | None:
        return self._live.get(request_id)

    def live(self) -> list[Request[H]]:
        return list(self._live.values())

    # ------------------------------------------------------------------ intake
    def verdict(self, item: WorkItem) -> Verdict:
        """Checked in this order; CANCELLED uses up the remembered Cancel."""
        rid = item.request.request_id
        if self.draining:
            return Verdict.DRAINING
        held = self._live.get(rid)
        if held is not None:
            return Verdict.SUPERSEDE if item.request.attempt > held.attempt else Verdict.DUPLICATE
        if item.request.model != self.model:
            return Verdict.MISROUTED
        key = (rid, item.request.attempt, item.phase)
        if self._early_cancels.pop(rid, None) is not None or self._early_withdrawn.pop(key, None) is not None:
            return Verdict.CANCELLED
        if self._early_taken.pop(key, None) is not None:
            return Verdict.WITHDRAWN
        return Verdict.ACCEPT

    def accept(self, item: WorkItem, now: float, handle: H) -> tuple[Request[H], KvLanded | None]:
        """Hold `item` from now on; for a DECODE item also the KvLanded that already arrived, if any."""
        rid = item.request.request_id
        r = Request(item, now, handle)
        self._live[rid] = r
        if item.phase != Phase.DECODE:
            return r, None
        early = self._early_landed.pop(rid, None)
        if early is not None:
            return r, early[0]
        self._set_waiting(r, True)
        return r, None

    def finish(self, request_id: str, handle: H) -> bool:
        """The task behind `handle` ended; False when a newer attempt already holds the id."""
        r = self._live.get(request_id)
        if r is None or r.handle is not handle:
            return False
        self._set_waiting(r, False)
        del self._live[request_id]
        return True

    def supersede(self, request_id: str) -> Stop:
        """A newer attempt came for a request held here: the old one is to end quietly."""
        r = self._live.get(request_id)
        if r is None:
            return Stop.NONE
        r.superseded = True
        return _how(r)

    def cancel(self, request_id: str, now: float, phase: Phase | None = None, attempt: int = 0,
               withdrawn: bool = False) -> Stop:
        """Cancel what is held of the request; with `phase`, only its item of that phase and attempt (another
        item of the request held here goes on, and the Cancel is remembered for that item alone). `withdrawn`:
        the DECODE half of a placement its scheduler withdrew (its prefill worker told the gateway): it ends as
        withdrawn, here or when it comes (`Verdict.WITHDRAWN`)."""
        if phase is not None and not self._holds(request_id, phase, attempt):
            return self._withdraw_unheld(request_id, phase, attempt, now, withdrawn)
        _put(self._cancelled, request_id, now, self.early_max)
        self._early_landed.pop(request_id, None)
        r = self._live.get(request_id)
        if r is None:
            # Every worker sees every Cancel; remember a few in case this one's WorkItem is still in flight.
            _put(self._early_cancels, request_id, now, self.early_max)
            return Stop.NONE
        r.cancelled = True
        r.withdrawn = withdrawn
        return _how(r)

    def withdraw(self, request_id: str, phase: Phase, attempt: int, now: float, started: Callable[[str], bool]) -> Stop:
        """Its scheduler takes back the FULL or PREFILL item of this attempt (hetmesh.placement.withdrawal):
        held here and not `started` by the engine, it is to be aborted there and end as withdrawn (ENGINE);
        started (or shipping), it goes on (NONE). Not held yet, the withdrawal waits for it (`Verdict.WITHDRAWN`)."""
        if not self._holds(request_id, phase, attempt):
            _put(self._early_taken, (request_id, attempt, phase), now, self.early_max)
            return Stop.NONE
        r = self._live[request_id]
        if r.shipping or r.cancelled or r.superseded or started(request_id):
            return Stop.NONE
        r.withdrawn = r.cancelled = True
        return Stop.ENGINE

    def _holds(self, request_id: str, phase: Phase, attempt: int) -> bool:
        r = self._live.get(request_id)
        return r is not None and r.item.phase == phase and r.attempt == attempt

    def _withdraw_unheld(self, request_id: str, phase: Phase, attempt: int, now: float, withdrawn: bool) -> Stop:
        """An item's Cancel that beat it here (or whose item never comes: a duplicate the stream dropped). For
        a DECODE, KV for the request that lands or streams in meanwhile is dropped (refused), unless a DECODE
        of the request held here waits for its own."""
        _put(self._early_taken if withdrawn else self._early_withdrawn, (request_id, attempt, phase), now,
             self.early_max)
        held = self._live.get(request_id)
        if phase == Phase.DECODE and (held is None or held.item.phase != Phase.DECODE):
            _put(self._cancelled, request_id, now, self.early_max)
            self._early_landed.pop(request_id, None)
        return Stop.NONE

    def hand_over(self) -> list[tuple[Request[H], Stop]]:
        """The drain ran out of time: every request still held, and how to stop it here so that it ends
        with a retryable error (the gateway migrates it): fail a decode's KV wait, cancel a prefill's
        KV shipping (the decode side prefills locally), abort the rest in the engine."""
        return [(r, _how(r)) for r in self._live.values()]

    def was_cancelled(self, request_id: str) -> bool:
        """Cancelled lately: KV streaming in for it is refused, or dropped when it lands."""
        return request_id in self._cancelled

    # ------------------------------------------------------------------ the KV wait of a DECODE item
    def landed(self, landed: KvLanded, now: float) -> Request[H] | None:
        """KV landed (or failed to). The decode waiting for it, to be woken with `landed`; None: nobody
        waits yet, so it is kept for the WorkItem to find."""
        r = self._live.get(landed.request_id)
        if r is not None and r.waiting_for_kv:
            self._set_waiting(r, False)
            return r
        _put(self._early_landed, landed.request_id, (landed, now), self.early_max)
        return None

    def kv_wait_over(self, r: Request[H]) -> None:
        """The decode stopped waiting on its own (timed out, cancelled, shutdown)."""
        self._set_waiting(r, False)

    def waiting(self) -> list[Request[H]]:
        return [r for r in self._live.values() if r.waiting_for_kv]

    def sweep(self, now: float) -> None:
        """Forget early messages whose WorkItem never came."""
        for rid in [r for r, (_, ts) in self._early_landed.items() if now - ts > self.stale_s]:
            del self._early_landed[rid]
        for rid in [r for r, ts in self._early_cancels.items() if now - ts > self.stale_s]:
            del self._early_cancels[rid]
        for key in [k for k, ts in self._early_withdrawn.items() if now - ts > self.stale_s]:
            del self._early_withdrawn[key]
        for key in [k for k, ts in self._early_taken.items() if now - ts > self.stale_s]:
            del self._early_taken[key]
        for rid in [r for r, ts in self._cancelled.items() if now - ts > self.stale_s]:
            del self._cancelled[rid]

    def _set_waiting(self, r: Request[H], waiting: bool) -> None:
        if r.waiting_for_kv != waiting:
            r.waiting_for_kv = waiting
            self.kv_waiting += 1 if waiting else -1


def _how(r: Request[H]) -> Stop:
    if r.waiting_for_kv:
        return Stop.KV_WAIT
    return Stop.SHIPPING if r.shipping else Stop.ENGINE


V = TypeVar("V")


def _put(d: dict[K, V], key: K, value: V, cap: int) -> None:
    """Insert, dropping the oldest entry when full (dicts keep insertion order)."""
    if key not in d and len(d) >= cap:
        d.pop(next(iter(d)))
    d[key] = value
