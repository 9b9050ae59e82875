"""Several scheduler replicas in the simulator, each placing on the view the live mesh gives it.

Live schedulers share nothing but the bus (docs/architecture.md, several gateways and schedulers): each folds
every worker's heartbeats (one per `heartbeat_s`) and Finished records (batched, `finished_s` late) into its own
`ClusterState`, and adds what it placed itself since a worker's last heartbeat on top; another replica's
placements it sees only in the worker's next heartbeat. Each replica runs its own policy object, so a policy's
own bookkeeping (the cost policy's prefill backlog) holds that replica's placements only. Sharing bookings
(`share_s`) and withdrawing (`withdraw`, as the live scheduler does: hetmesh.placement.withdrawal), a replica
that hears another's placement on a worker it has placed on since without knowing of it (the later of the two)
un-books its own and places it again, knowing of the other's: where its policy now picks other workers or
refuses it, the other replicas un-book it a bus hop later, its worker drops it then if its engine has not
started it (else it goes on), and two hops after that (the worker's error to the gateway, the gateway's submit)
a replica the gateway picks places it anew, once per request. A replica busy placing (`place_s` a placement)
handles what it hears only once the placements it had queued are done. A
gateway sends each request, and each client retry, to a replica picked at random; a request a replica refuses
and holds stays on that replica, which places it again (the scheduler's hold loop). The worker's engine is the
arbiter: its batching core admits nothing past its batch or its KV blocks, the rest waits in its queue.

`ReplicaSimulator` is the Simulator with that in front of the workers; its `overbooking` says what the replicas
did not see when they placed, and checks after every step that no worker holds more than its limits.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from msgspec.structs import replace

from hetmesh.batching.data import State
from hetmesh.config import MeshConfig
from hetmesh.placement import REFUSED, Decision, Policy, RequestInfo, WorkerView
from hetmesh.placement.withdrawal import Placed, Recent, reconsider
from hetmesh.sim import policy_for
from hetmesh.sim.cluster import Simulator
from hetmesh.sim.metrics import Slo, summarize
from hetmesh.sim.results import SimResult
from hetmesh.sim.spec import SimConfig, WorkerSpec
from hetmesh.sim.traces import Trace

FINISHED_S = 0.02  # a worker's Finished records wait this long for company on the bus (hetmesh.bus.EVENT_BATCH_S)


@dataclass
class Overbooking:
    """What the replicas' placements did not see, over a run."""

    placements: int = 0
    unseen: int = 0  # requests on the chosen workers the placing replica's view did not count, summed
    unseen_max: int = 0
    blind_full: int = 0  # placed on a worker its view showed with a free batch slot, whose batch was in fact full
    collided: int = 0  # prefills placed on a worker with another replica's placement not heard yet (share_s)
    pool_full_missed: int = 0  # admitted while the pool held more than pool_full allows (its view said less)
    peak_pool_load: float = 0.0  # the most the pool held, over what pool_full lets it hold
    over_limit: int = 0  # steps in which a worker ran past its max_batch or KV blocks (must stay 0)
    rechecked: int = 0  # own placements placed again on hearing an earlier placement on the same worker
    withdrawn: int = 0  # ... that went elsewhere or were refused then: taken back (a Cancel to their worker)
    withdrawal_refused: int = 0  # ... whose engine had started them by the time the Cancel came: they went on
    per_replica: list[int] = field(default_factory=list)  # placements each replica made


class _Replica:
    """One scheduler's books: the heartbeats every replica shares, plus its own placements since each."""

    __slots__ = ("assigned", "busy", "dirty", "policy", "recent", "unheard", "views")

    def __init__(self, policy: Policy, views: list[WorkerView], horizon_s: float) -> None:
        self.policy = policy
        self.views = list(views)
        self.assigned = [0] * len(views)  # placed on each worker since its last heartbeat
        self.dirty: set[int] = set()
        self.unheard = [0] * len(views)  # other replicas' placements on each worker on their way here
        self.recent: Recent[Any] = Recent(horizon_s)  # own placements the others may not have heard of yet
        self.busy = 0.0  # until when its placements keep it busy: what it hears waits behind them (`place_s`)


class ReplicaSimulator(Simulator):
    """`replicas` policy objects (one per scheduler) over one simulated cluster. queue_factor: the scheduler's
    pool_full bound, for counting admissions past it (the simulated replicas do not refuse by it)."""

    def __init__(self, workers: Sequence[WorkerSpec], replicas: Sequence[Policy], config: SimConfig | None = None,
                 heartbeat_s: float = MeshConfig().heartbeat_interval_s, finished_s: float = FINISHED_S,
                 seed: int = 0, queue_factor: float = 4.0, share_s: float | None = None,
                 withdraw: bool = False, place_s: float = 0.0) -> None:
        self._reps: list[Policy] = list(replicas)
        super().__init__(workers, _Router(self), config)
        self.heartbeat_s = heartbeat_s
        self.finished_s = finished_s
        self.queue_factor = queue_factor
        self.share_s = share_s
        self.withdraw = withdraw
        self.place_s = place_s  # a replica's time per placement; 0: instant
        self._rng = random.Random(seed)
        self.overbooking = Overbooking(per_replica=[0] * len(self._reps))
        self._books: list[_Replica] = []
        self._hb: list[WorkerView] = []  # each worker's last heartbeat
        self._hb_t: list[float] = []
        self._fin: list[int] = []  # Finished records heard since it (every replica hears them)
        self._beats = 0  # heartbeat events pending
        self._refused_by: dict[str, int] = {}  # request id -> the replica that refused it last
        self._held = False  # the request being placed comes back from a hold
        self._order = 0  # placements so far, over every replica: which of two came first
        self._moved: set[int] = set()  # requests withdrawn once

    # ---- the replicas' views ----
    def _start(self) -> None:
        """The workers' first heartbeats at the first placement, then one per heartbeat_s each, out of phase."""
        truth = self._views()
        self._hb, self._hb_t, self._fin = list(truth), [self.now] * len(truth), [0] * len(truth)
        self._books = [_Replica(p, truth, self.heartbeat_s) for p in self._reps]
        for i in range(len(truth)):
            self._beat_at(i, self.now + self._rng.uniform(0.0, self.heartbeat_s))

    def _beat_at(self, i: int, t: float) -> None:
        self._beats += 1
        self.call_at(t, lambda: self._beat(i))

    def _beat(self, i: int) -> None:
        self._beats -= 1
        self._hb[i] = self._views()[i]
        self._hb_t[i] = self.now
        self._fin[i] = 0
        for b in self._books:
            b.assigned[i] = 0
            b.dirty.add(i)
        if len(self._events) > self._beats:  # anything else still to happen
            self._beat_at(i, self.now + self.heartbeat_s)

    def _heard_finished(self, i: int, ts: float) -> None:
        if ts > self._hb_t[i]:  # else the heartbeat in hand already counts it
            self._fin[i] += 1
            for b in self._books:
                b.dirty.add(i)

    def _heard_booking(self, b: _Replica, d: Decision, order: int) -> None:
        """Another replica's placement, heard on the bus: counted on its workers until their next heartbeat,
        and booked in this replica's policy (its prefill backlog); then this replica's own placements on those
        workers made since, without knowing of it, are judged again."""
        for wid in d.workers:
            i = self._index[wid]
            b.assigned[i] += 1
            b.unheard[i] -= 1
            b.dirty.add(i)
        booked = getattr(b.policy, "booked", None)
        if booked is not None:
            booked(d)
            self._recheck(b, d, order)

    def _recheck(self, b: _Replica, d: Decision, order: int) -> None:
        """b's placements after d (by order) on one of d's workers whose prefill has not started: each is
        un-booked and placed again by b's policy, now knowing of d; one it would place elsewhere or refuse is
        withdrawn (hetmesh.placement.withdrawal)."""
        if not self.withdraw or getattr(b.policy, "withdrawn", None) is None or self.flow is not None:
            return
        for p in b.recent.behind((float(order), ""), d.workers, self.now):
            q = p.decision
            req = self.reqs.get(int(p.info.request_id))
            if req is None or req.decision is not q or req.rid in self._moved:
                continue  # once moved, a request stays where it lands: withdrawals must not chase each other
            self.overbooking.rechecked += 1

            def views(b: _Replica = b, q: Decision = q) -> list[WorkerView]:
                self._count(b, q, -1)
                return self.view_of(b)

            info = replace(p.info, arrival=self.now, waited_s=self.now - req.arrival)
            if reconsider(b.policy, info, q, views, self.now) is not None:  # type: ignore[arg-type]
                self._count(b, q, 1)  # the same choice knowing d: it stays, booked behind d
                continue
            self.overbooking.withdrawn += 1
            b.recent.drop(p)
            self._withdraw(b, req, q)

    def _count(self, b: _Replica, d: Decision, k: int) -> None:
        for wid in d.workers:
            i = self._index[wid]
            b.assigned[i] = max(b.assigned[i] + k, 0)
            b.dirty.add(i)

    def _withdraw(self, b: _Replica, req: Any, q: Decision) -> None:
        """Take q back as the live mesh does: un-booked by every other replica once they hear it; a Cancel that
        reaches its worker a bus hop later, which drops it only if its engine has not started it; then the
        worker's error to the gateway and the gateway's submit of its next attempt to a replica it picks (two
        more hops)."""
        self._moved.add(req.rid)
        hop = self.share_s or 0.0
        for other in self._books:
            if other is not b:
                self.call_at(self._heard_at(other), lambda o=other: self._heard_withdrawal(o, q))
        self.call_at(self.now + hop, lambda: self._arbitrate(req, q))

    def _heard_at(self, other: _Replica) -> float:
        """When `other` handles a message on the bus sent now: a hop later, or once its own placements queued by
        then are done (`place_s`)."""
        return max(self.now + (self.share_s or 0.0), other.busy)

    def _arbitrate(self, req: Any, q: Decision) -> None:
        """The worker's side of a withdrawal: drop the item only if its engine has not started it."""
        pw, dw = req.pw, req.dw
        seq = pw.core.seqs.get(req.rid) if pw is not None and req.decision is q else None
        if seq is None or seq.state != State.WAITING or seq.admitted_at >= 0:
            self.overbooking.withdrawal_refused += 1  # under way (or over): it goes on where it is
            return
        pw.core.abort(req.rid)
        if pw is not dw:
            dw.inbound -= 1
        self._stale.add(pw)
        req.decision = None
        self.call_at(self.now + 2 * (self.share_s or 0.0), lambda: self._arrive(req, self._block_tokens, held=True))

    def _heard_withdrawal(self, b: _Replica, q: Decision) -> None:
        self._count(b, q, -1)
        b.policy.withdrawn(q, self.now)  # type: ignore[attr-defined]

    def view_of(self, b: _Replica) -> list[WorkerView]:
        """The replica's views, as its ClusterState builds them (only workers that moved get a new one)."""
        for i in b.dirty:
            hb, fin = self._hb[i], self._fin[i]
            leftover = max(fin - hb.running, 0)
            b.views[i] = replace(hb, queue_depth=max(hb.queue_depth + b.assigned[i] - leftover, 0),
                                 running=max(hb.running - fin, 0))
        b.dirty.clear()
        return b.views

    # ---- placing ----
    def place(self, info: RequestInfo, truth: list[WorkerView]) -> Decision | None:
        if not self._books:
            self._start()
        k = self._refused_by.pop(info.request_id, None)
        if k is None or not self._held:  # a new request or a client's retry: the gateway picks
            k = self._rng.randrange(len(self._books))
        b = self._books[k]
        b.busy = max(b.busy, self.now) + self.place_s
        mine = self.view_of(b)
        d = b.policy.place(info, mine)
        if d is None or d.mode == REFUSED:
            if d is not None:
                self._refused_by[info.request_id] = k  # held, it comes back to this replica
            return d
        ob = self.overbooking
        ob.placements += 1
        ob.per_replica[k] += 1
        idx = self._index
        ob.collided += b.unheard[idx[d.prefill_worker or d.decode_worker]] > 0
        for wid in d.workers:
            i = idx[wid]
            t, m = truth[i], mine[i]
            unseen = max(t.load - m.load, 0)
            ob.unseen += unseen
            ob.unseen_max = max(ob.unseen_max, unseen)
            ob.blind_full += m.load < m.max_batch <= t.load
            b.assigned[i] += 1
            b.dirty.add(i)
        if self.share_s is not None:
            self._order += 1
            if self.withdraw:  # only a withdrawal reads them (`_recheck`, which also drops the old ones)
                b.recent.add(Placed((float(self._order), ""), self.now, info, d, None))
            for other in self._books:
                if other is not b:
                    for wid in d.workers:
                        other.unheard[idx[wid]] += 1
                    self.call_at(self._heard_at(other), lambda o=other, n=self._order: self._heard_booking(o, d, n))
        cap = sum(w.max_batch for w in truth if w.model == info.model) * (1.0 + self.queue_factor)
        held = sum(w.load for w in truth if w.model == info.model)
        ob.peak_pool_load = max(ob.peak_pool_load, held / cap)
        ob.pool_full_missed += held >= cap
        return d

    # ---- the simulator's events, heard by every replica ----
    def _arrive(self, req, block_tokens: int, held: bool = False) -> None:  # type: ignore[no-untyped-def]
        self._held = held
        super()._arrive(req, block_tokens, held)

    def _build(self, hash_tokens: int) -> None:
        super()._build(hash_tokens)
        self._index = {w.spec.worker_id: w.index for w in self.workers}

    def _finished(self, r) -> None:  # type: ignore[no-untyped-def]
        if r.dw is not None:
            self._finished_at(r.dw.index)
        super()._finished(r)

    def _ship_kv(self, src, r) -> None:  # type: ignore[no-untyped-def]
        self._finished_at(src.index)  # the prefill side's Finished ("prefill_done")
        super()._ship_kv(src, r)

    def _finished_at(self, i: int) -> None:
        if self._books:
            ts = self.now
            self.call_at(ts + self.finished_s, lambda: self._heard_finished(i, ts))

    def _start_step(self, w) -> None:  # type: ignore[no-untyped-def]
        super()._start_step(w)
        c = w.core
        self.overbooking.over_limit += len(c.running) > c.s.max_batch or c.cache.used > c.s.kv_blocks


class _Router:
    """The gateways' side: the Simulator's one policy, handing each request to a replica."""

    def __init__(self, sim: ReplicaSimulator) -> None:
        self.sim = sim
        first = sim._reps[0]
        self.name = getattr(first, "name", type(first).__name__)
        self.learner = getattr(first, "learner", None)  # every replica learns from every worker's steps
        for hook in ("request_first_token", "request_done"):
            if getattr(first, hook, None) is not None:
                setattr(self, hook, self._fan(hook))

    def _fan(self, hook: str) -> Callable[..., None]:
        def call(*args: object) -> None:
            for p in self.sim._reps:
                getattr(p, hook)(*args)
        return call

    def observe(self, *args: object) -> None:
        for p in self.sim._reps:
            p.observe(*args)  # type: ignore[attr-defined]

    def place(self, info: RequestInfo, workers: Sequence[WorkerView]) -> Decision | None:
        return self.sim.place(info, workers)  # type: ignore[arg-type]


def simulate_replicas(workers: Sequence[WorkerSpec], policy: str, replicas: int, trace: Trace,
                      config: SimConfig | None = None, slo: Slo = Slo(), seed: int = 0,
                      share_s: float | None = None, queue_factor: float = 4.0, withdraw: bool = False,
                      place_s: float = 0.0, **policy_kwargs: Any) -> tuple[dict[str, Any], SimResult, Overbooking]:
    """`simulate` with `replicas` schedulers, each its own `policy` object, placing on its own view (share_s: each
    placement heard by the other replicas this late; None: not shared; withdraw: a placement an earlier one heard
    late left no room for is taken back and placed again; place_s: each replica's time per placement, which what it
    hears waits behind)."""
    if policy == "cost" and config is not None and config.efficiencies:
        policy_kwargs.setdefault("efficiencies", config.efficiencies)
    reps = [policy_for(policy, workers, slo, **policy_kwargs) for _ in range(replicas)]
    sim = ReplicaSimulator(workers, reps, config, seed=seed, queue_factor=queue_factor, share_s=share_s,
                           withdraw=withdraw, place_s=place_s)
    res = sim.run(trace)
    return summarize(res, slo), res, sim.overbooking
