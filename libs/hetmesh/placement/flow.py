"""Flow control: who goes next when the fleet is full. Tenants, priority bands, fair shares, deadlines.

When the policy cannot place a request now (SLO-aware admission refuses it, the fleet is full), the mesh holds
it here instead of letting every held request retry on its own, where whoever sends most gets most:

- strict priority between bands (band 0 first): a lower band is served only while no higher one waits;
- weighted fair sharing between the tenants of a band, of what the fleet holds: the next held request is the
  one of the tenant with the least cost in flight (placed, not finished) per weight, ties to the heavier. The
  fleet is non-preemptive, so what a tenant has in flight is its share of the fleet now: room that frees goes
  to whoever holds least of it per weight, and what was placed while nothing waited (the first fill of an
  empty fleet, placements on arrival) is evened out as it drains. A virtual clock (start-time fair queuing's)
  would forgive it: its virtual time moves with every placement, so a tenant whose requests went in out of
  their order keeps what they took. No history is kept: a tenant back from idle has nothing in flight and
  takes freed room until it holds its share, never more, and a band with one tenant waiting serves it alone:
  the queue is work-conserving;
- earliest deadline first within a tenant (deadline: the latest start that meets its TTFT SLO, `hold_deadline`).

A request's cost is in the cost model's units (`engine_seconds`: its predicted engine time; or tokens).
A new arrival goes straight to the policy while nothing of a higher band waits and no other tenant of its band
holding requests has less in flight per weight (its tenant is the one the queue serves next: it may take the
room its own held requests were refused, as a request of the tenant's placed past its head would); otherwise it
joins the queue and the shell places from the queue's head, so that room the fleet frees goes in fair order
(work-conserving: with nothing held, nothing waits). A pump walks the queue in that order and a refusal ends
only its tenant's turn (and every lower band's): another tenant's request may still be placed behind it, but
only with headroom left for the refused one (below), so that room freed goes to whoever is behind its share.
Before its turn ends, the refused tenant's next requests in EDF order are tried (one that fits goes in its
tenant's share), for as long as its head has been passed over for less than its own cost (`Turns`). A request
the fleet refused is not tried again until room may have freed (`epoch`: a finish, or `recheck` each admission
hold period as predictions move with time): the pumps between, on each held arrival, try only what is new, so a
tenant's whole queue can be looked through with the policy asked about each held request once per freed room.

Headroom (`headroom`): a request is placed only if its predicted TTFT and TPOT stay within `1 - reserve` of its
SLOs (`reserved`) while someone it would crowd out is active: a higher band (in flight or held); or, for a
tenant with more requests waiting, another tenant of its band whose request this pump could not place and that
it leads by more than that request's cost per weight (up to that lead it uses the room: fair sharing's own
bound), or one owed room (active, nothing waiting, sending less per weight than the waiting tenant is
placed). The fleet is non-preemptive and admission fills it to the edge of the SLOs: the room left is what those
tenants' next arrivals land in, prefill backlog and decode batch alike.

A tenant over its share (its in-flight cost above its weight's share of what the active tenants have in flight)
with a full queue, or a held request past its deadline, is refused with 429 and a Retry-After: how long until
its in-flight cost drains to its share at the rate it has been draining. `now` is passed in; no I/O: the
scheduler and the simulator drive the same object.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

import msgspec

from hetmesh.placement.state import RequestInfo

MAX_RETRY_AFTER_S = 60.0
LOOKAHEAD = 64  # requests of a tenant a pump tries past its refused head, in EDF order (each once per `epoch`)
RATE_WINDOW_S = 10.0  # a tenant's drain rate (cost finished per second) decays over this long


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    weight: float = 1.0
    band: int = 0  # priority band: 0 is served first

    def __post_init__(self) -> None:
        if not self.weight > 0 or not math.isfinite(self.weight):
            raise ValueError(f"tenant {self.name!r}: weight must be > 0, not {self.weight}")
        if self.band < 0:
            raise ValueError(f"tenant {self.name!r}: band must be >= 0, not {self.band}")


@dataclass(slots=True)
class Held:
    """A request the queue holds: what it costs, when it must start by, and the caller's own handle."""

    key: str
    tenant: str
    cost: float
    deadline: float
    arrival: float
    item: object = None
    seq: int = 0
    passed: float = 0.0  # cost its tenant placed past it while it did not fit (`Turns`)
    refused_in: int = -1  # the queue's `epoch` when the fleet last refused it at its full share (`Turns`)


_edf = attrgetter("deadline", "seq")  # EDF, then arrival order


@dataclass(slots=True)
class TenantStats:
    """What the metrics and `hetmesh status --tenants` show per tenant."""

    requests: int = 0  # arrivals
    placed: int = 0
    refused: int = 0  # 429 from flow control (queue full, deadline passed)
    held: int = 0  # requests that waited in the queue
    held_s: float = 0.0  # their waits, summed
    tokens: int = 0  # prompt + output tokens of placed requests
    finished: int = 0
    slo_met: int = 0  # finished within their SLOs (the shell judges)

    @property
    def slo_attainment(self) -> float:
        return self.slo_met / self.finished if self.finished else 1.0


@dataclass(slots=True)
class _State:
    tenant: Tenant
    band: int = 0  # the tenant's, read on every walk
    weight: float = 1.0
    inflight: float = 0.0  # cost placed and not finished
    held: list[Held] = field(default_factory=list)  # sorted, EDF (`_edf`): the head first
    rate: float = 0.0  # cost finished, decaying sum over RATE_WINDOW_S
    rate_t: float = 0.0
    sent: float = 0.0  # cost arrived (its demand), decaying sum over RATE_WINDOW_S
    sent_t: float = 0.0
    got: float = 0.0  # cost placed, decaying sum over RATE_WINDOW_S
    got_t: float = 0.0
    stats: TenantStats = field(default_factory=TenantStats)
    walked: int = -1  # the epoch in which a pump found nothing of it to try (`Turns`); any hold or take resets it


def engine_seconds(prefill_s: float, decode_token_s: float, uncached: int, output_tokens: int) -> float:
    """A request's cost in engine seconds: its uncached prefill, then its output tokens at a full batch's
    per-token share of a decode step."""
    return prefill_s * uncached + decode_token_s * max(output_tokens, 1)


def reserved(info: RequestInfo, headroom: float) -> RequestInfo:
    """The request as the policy should judge it to leave `headroom` of its SLOs free: its placement must fit
    within `1 - headroom` of its TTFT and TPOT SLOs (admission refuses or holds it otherwise)."""
    return info if headroom <= 0.0 else msgspec.structs.replace(info, slo_share=info.slo_share * (1.0 - headroom))


def hold_deadline(sent: float, ttft_slo_s: float, prefill_s: float, limit_s: float, headroom: float = 0.0) -> float:
    """When a held request must start by: the share of its TTFT SLO it may use (`1 - headroom`: the headroom its
    tenant leaves others when it is held) less its own prefill at an idle worker, the latest start that can
    still meet it (a shorter hold turns away requests that would still be served in time, a longer one keeps
    hopeless ones at its tenant's head), within `limit_s` of its first send (the client's patience)."""
    return sent + min((1.0 - headroom) * ttft_slo_s - prefill_s, limit_s)


def _decayed(total: float, t: float, now: float) -> float:
    return total * math.exp(-max(now - t, 0.0) / RATE_WINDOW_S)


def token_cost(uncached: int, output_tokens: int) -> float:
    """A request's cost without a cost model: uncached prompt + expected output tokens."""
    return float(max(uncached, 0) + max(output_tokens, 1))


class FlowQueue:
    def __init__(self, tenants: Sequence[Tenant], max_held: int = 1024, retry_floor_s: float = 1.0,
                 reserve: float = 0.0, lookahead: int = LOOKAHEAD) -> None:
        if not tenants:
            raise ValueError("flow control needs at least one tenant")
        self.tenants = {t.name: _State(t, t.band, t.weight) for t in tenants}
        self._states = list(self.tenants.values())
        if len(self.tenants) != len(tenants):
            raise ValueError("tenant names must be unique")
        bands = sorted({t.band for t in tenants})
        self.max_held = max_held  # per tenant
        self.retry_floor_s = retry_floor_s
        if not 0.0 <= reserve < 1.0:
            raise ValueError(f"flow reserve must be in [0, 1), not {reserve}")
        self.reserve = reserve  # share of its SLOs a request leaves free for those it would crowd out
        if lookahead < 0:
            raise ValueError(f"flow lookahead must be >= 0, not {lookahead}")
        self.lookahead = lookahead  # a pump's tries past a tenant's refused head (`Turns`)
        self._seq = 0
        self._n_held = 0
        self._held_in: dict[int, int] = dict.fromkeys(bands, 0)  # requests held per band
        self._due = math.inf  # no held request's deadline is earlier (a bound: `expired` skips the walk before it)
        self._top = bands[0]  # the highest band
        self._taken: Held | None = None  # the last request taken out (held again if still refused)
        self.epoch = 0  # moves when room may have freed (`finished`, `recheck`): a refusal stands until then

    # ---- reading ----
    def __len__(self) -> int:
        return self._n_held

    def stats(self, tenant: str) -> TenantStats:
        return self.tenants[tenant].stats

    def _active(self) -> list[_State]:
        return [s for s in self.tenants.values() if s.inflight > 1e-12 or s.held]

    def share(self, tenant: str) -> float:
        """Its weight's share of the cost the active tenants (itself included) have in flight."""
        me = self.tenants[tenant]
        active = self._active()
        if me not in active:
            active.append(me)
        total_w = sum(s.weight for s in active)
        return me.weight / total_w * sum(s.inflight for s in active)

    def over_share(self, tenant: str) -> bool:
        return self.tenants[tenant].inflight > self.share(tenant) + 1e-9

    def retry_after_s(self, tenant: str, now: float) -> float:
        """When its share frees: its in-flight cost above its share, at the rate its work has been finishing."""
        s = self.tenants[tenant]
        excess = max(s.inflight - self.share(tenant), 0.0)
        rate = self._rate(s, now)
        wait = excess / rate if rate > 0 else (MAX_RETRY_AFTER_S if excess > 0 else 0.0)
        return min(max(wait, self.retry_floor_s), MAX_RETRY_AFTER_S)

    def _rate(self, s: _State, now: float) -> float:
        return _decayed(s.rate, s.rate_t, now) / RATE_WINDOW_S

    def may_try(self, tenant: str) -> bool:
        """A new arrival goes to the policy now (True) or joins the queue: nothing of a higher band waits, and no
        other tenant of its band holding requests has less in flight per weight (its tenant is the one the band
        serves next; ties go to the newcomer). Its own held requests keep their places: what the fleet refused
        them, the newcomer may fit, and its placement counts in its tenant's share as any other."""
        me = self.tenants[tenant]
        band = me.band
        for b, n in self._held_in.items():
            if n and b < band:
                return False
        if not self._held_in[band]:
            return True
        mine = me.inflight / me.weight
        return not any(s.held and s.band == band and s is not me and s.inflight / s.weight < mine
                       for s in self._states)

    def headroom(self, tenant: str, now: float, refused: Container[str] = ()) -> float:
        """The share of its SLOs a request of `tenant` (taken out of the queue, if it was held) must leave free
        when placed: `reserve` while a tenant of a higher band has work in flight or held; or while `tenant` has
        more requests waiting and another tenant of its band is owed room: in `refused` (this pump could not
        place its request: `Turns.done`) while `tenant` has been placed more cost per weight than it by more than
        its head's cost per weight (up to that lead, placing past it stays within fair sharing's bound of one
        request: the fleet's room is used, not kept), or active with nothing waiting and sending less cost per
        weight than `tenant` is being placed (its next arrivals are within what `tenant` takes). Else 0: no one
        to keep room for (a tenant with nothing else waiting takes what it fits: it is within what it sends).
        Placed cost and cost sent are decaying sums over RATE_WINDOW_S."""
        if self.reserve <= 0.0:
            return 0.0
        me = self.tenants[tenant]
        band = me.band
        if band > self._top and any(s.band < band and (s.held or s.inflight > 1e-12) for s in self._states):
            return self.reserve
        if not me.held:
            return 0.0
        got = _decayed(me.got, me.got_t, now) / me.weight
        for t in refused:
            r = self.tenants[t]
            if r is not me and r.band == band and (got - _decayed(r.got, r.got_t, now) / r.weight
                                                   > (r.held[0].cost / r.weight if r.held else 0.0)):
                return self.reserve
        for s in self._states:
            if (s is not me and s.band == band and not s.held and s.inflight > 1e-12
                    and _decayed(s.sent, s.sent_t, now) / s.weight < got):
                return self.reserve
        return 0.0

    def order(self) -> Iterator[Held]:
        """Every held request in service order: bands first, then tenants by cost in flight per weight (as if
        each were placed in turn), EDF within a tenant. A snapshot: the caller may take() while it walks it."""
        by_band: dict[int, list[_State]] = {}
        for s in self.tenants.values():
            if s.held:
                by_band.setdefault(s.band, []).append(s)
        for band in sorted(by_band):
            heap = []
            for i, s in enumerate(by_band[band]):
                queue = list(s.held)
                heap.append((s.inflight / s.weight, -s.weight, i, 0, queue, s))
            heapq.heapify(heap)
            while heap:
                held, nw, i, j, queue, s = heapq.heappop(heap)
                h = queue[j]
                yield h
                if j + 1 < len(queue):
                    heapq.heappush(heap, (held + h.cost / s.weight, nw, i, j + 1, queue, s))

    def head(self, skip: Container[str] = (), last_band: int | None = None) -> Held | None:
        """The held request that goes next: the highest band that holds any, the tenant of it with the least
        cost in flight per weight (ties: the heavier), its earliest deadline. O(tenants). `skip`: tenants whose
        turn is over; `last_band`: no tenant of a lower band (a pump's turns, `Turns`)."""
        if not self._n_held:
            return None
        best = None
        kb, ks, kw = math.inf, math.inf, 0.0  # the best's band, in flight per weight, weight
        for s in self._states:
            if s.held:
                b = s.band
                if b > kb or (last_band is not None and b > last_band) or (skip and s.tenant.name in skip):
                    continue
                st = s.inflight / s.weight
                if b < kb or st < ks or (st == ks and s.weight > kw):
                    best, kb, ks, kw = s, b, st, s.weight
        return best.held[0] if best is not None else None

    # ---- changing ----
    def arrived(self, tenant: str, cost: float = 0.0, now: float = 0.0) -> None:
        """A new request of `tenant` (not a retry of one held): its demand."""
        s = self.tenants[tenant]
        s.stats.requests += 1
        s.sent = _decayed(s.sent, s.sent_t, now) + cost
        s.sent_t = now

    def hold(self, key: str, tenant: str, cost: float, deadline: float, now: float, item: object = None,
             again: bool = False) -> Held | None:
        """Hold a request (`again`: one taken out to be placed and still refused, not counted twice, the same
        Held back with its deadline, what was placed past it and its last refusal); None: its tenant already holds
        max_held (refuse it: `refused`)."""
        s = self.tenants[tenant]
        if len(s.held) >= self.max_held:
            return None
        self._seq += 1
        h = self._taken
        if again and h is not None and h.key == key:  # the same request back
            h.arrival, h.item, h.seq = now, item, self._seq
            deadline = h.deadline
        else:
            h = Held(key, tenant, cost, deadline, now, item, self._seq)
        bisect.insort(s.held, h, key=_edf)
        s.walked = -1
        self._n_held += 1
        self._held_in[s.band] += 1
        if deadline < self._due:
            self._due = deadline
        s.stats.held += not again
        return h

    def take(self, h: Held, now: float) -> None:
        """`h` leaves the queue (placed or refused next: call placed() or refused())."""
        s = self.tenants[h.tenant]
        held = s.held
        if held[0] is h:  # the head: the common case
            del held[0]
        else:  # by identity
            del held[next(i for i, x in enumerate(held) if x is h)]
        s.walked = -1
        self._n_held -= 1
        self._held_in[s.band] -= 1
        s.stats.held_s += max(now - h.arrival, 0.0)
        self._taken = h

    def expired(self, now: float) -> list[Held]:
        """Held requests past their deadline, taken out of the queue (refuse each). EDF keeps them on top."""
        out: list[Held] = []
        if not self._n_held or now <= self._due:
            return out
        due = math.inf
        for s in self._states:
            held = s.held
            while held and held[0].deadline < now:
                h = held[0]
                self.take(h, now)
                out.append(h)
            if held and held[0].deadline < due:
                due = held[0].deadline
        self._due = due
        return out

    def placed(self, tenant: str, cost: float, tokens: int = 0, now: float = 0.0) -> None:
        """A request of `tenant` was placed: its in-flight cost."""
        s = self.tenants[tenant]
        s.got = _decayed(s.got, s.got_t, now) + cost
        s.got_t = now
        s.inflight += cost
        s.stats.placed += 1
        s.stats.tokens += tokens

    def finished(self, tenant: str, cost: float, now: float, slo_met: bool | None = None) -> None:
        """A request of `tenant` left the fleet: its room may go to any held request (`epoch`)."""
        self.epoch += 1
        s = self.tenants[tenant]
        s.inflight = max(s.inflight - cost, 0.0)
        s.rate = _decayed(s.rate, s.rate_t, now) + cost
        s.rate_t = now
        if slo_met is not None:
            s.stats.finished += 1
            s.stats.slo_met += slo_met

    def refused(self, tenant: str) -> None:
        self.tenants[tenant].stats.refused += 1

    def recheck(self) -> None:
        """Every held request may be tried again (`epoch`): the shells call it each admission hold period, as
        the predictions move with time."""
        self.epoch += 1


class Turns:
    """One pump's walk of the queue: held requests in its order (`FlowQueue.head`). A refusal ends every lower
    band's turn (strict priority) but not its band's: the others' requests may fit where it did not, with headroom
    left for its tenant (`FlowQueue.headroom`'s `refused`: `done`). Within the refused tenant, the next
    `lookahead` requests in EDF order are tried in turn: one that fits goes, charged to its tenant's share as any
    placement (the shares hold), and the refused head stays first for the next pump. A head is passed over so for
    at most its own cost (`Held.passed`): its wait grows by at most what it would take itself, as if one more
    request of its tenant had come before it; from then on its tenant's room is kept for it. A request refused at
    its full share since room last freed (`FlowQueue.epoch`) counts as refused again without a placement; one
    refused with headroom left for others ends its tenant's turn (the room it missed is kept for someone else).
    At most 1 + `lookahead` refused placements per tenant per pump, and each held request at most one per epoch."""

    __slots__ = ("_ahead", "done", "last_band", "lookahead", "over", "q", "tried")

    def __init__(self, q: FlowQueue) -> None:
        self.q = q
        self.lookahead = q.lookahead
        self.done: set[str] = set()  # tenants with a refusal this pump (owed room)
        self.over: set[str] = set()  # tenants whose turn is over
        self.tried: dict[str, set[str]] = {}  # per tenant, the keys refused this pump
        self.last_band: int | None = None
        self._ahead: Held | None = None  # the last request handed out past its tenant's refused head

    def next(self) -> Held | None:
        """The next request to place (place it, or call `refused`)."""
        q = self.q
        if (c := self._ahead) is not None:  # placed (not refused): charged to the head it passed
            self._ahead = None
            held = q.tenants[c.tenant].held
            if held:
                head = held[0]
                head.passed += c.cost
                if head.passed >= head.cost:
                    self.over.add(c.tenant)
        epoch = q.epoch
        while (h := q.head(self.over, self.last_band)) is not None:
            t = h.tenant
            s = q.tenants[t]
            if s.walked == epoch:  # nothing of it to try until room frees or it holds something new
                self._refused(h)
                self.over.add(t)
                continue
            tried = self.tried.get(t, ())
            fresh = False  # a request within reach that the fleet has not refused at its full share this epoch
            for c in s.held[: self.lookahead + 1]:  # EDF
                if c.refused_in != epoch:
                    fresh = True
                    if c.key not in tried:
                        if c is not h:
                            self._ahead = c
                        return c
                elif c.key not in tried:  # nothing freed since the fleet refused it: refused again, unasked
                    self._refused(c)
                    if t in self.over:
                        break
            if not fresh:
                s.walked = epoch
            self.over.add(t)
        return None

    def refused(self, h: Held, now: float, kept: bool = False) -> None:
        """`h` could not be placed now (held again, or still held); `kept`: it was placed with headroom left for
        others (`FlowQueue.headroom` > 0)."""
        self._ahead = None
        if kept:
            self.over.add(h.tenant)
        else:
            h.refused_in = self.q.epoch
        self._refused(h)

    def _refused(self, h: Held) -> None:
        t = h.tenant
        self.done.add(t)
        if self.last_band is None:
            self.last_band = self.q.tenants[t].band
        tried = self.tried.setdefault(t, set())
        if not tried and h.passed >= h.cost:
            self.over.add(t)  # passed over for its own cost already: its tenant's room is kept for it
        tried.add(h.key)
        if len(tried) > self.lookahead:
            self.over.add(t)
