"""Flow control in the simulator: the scheduler's flow queue (hetmesh.placement.flow, built by
hetmesh.wiring.flow_queue) at the point where the scheduler holds or refuses a request.

A request the policy refuses but could still serve in time (`Decision.hold_s`) waits in the queue instead of
being placed again on its own; the queue is pumped, in its fair order, on each arrival it holds, whenever a
request finishes and every admission hold period while it holds anything, and a refusal ends its tenant's turn
in the pump once the requests behind it that may go instead have been tried (`Turns`); a refusal stands until a
request finishes or the next periodic pump (`FlowQueue.recheck`). A new arrival joins the queue while anything of
a higher band waits there, or a tenant of its band with less in flight per weight than its own
(`FlowQueue.may_try`).
The policy sees each request with the headroom its tenant must leave others (`FlowQueue.headroom`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hetmesh.placement import Decision
from hetmesh.placement.admission import DEFAULT_HOLD_S, retry_wait_s
from hetmesh.placement.flow import FlowQueue, Turns, hold_deadline, reserved
from hetmesh.placement.state import RequestInfo
from hetmesh.wiring import flow_queue, pricer

if TYPE_CHECKING:
    from hetmesh.sim.cluster import Simulator


class _Reserving:
    """The simulator's policy as flow control shows it to the cluster: a request placed with its tenant's
    headroom (`reserved`); everything else is the policy's own."""

    def __init__(self, policy: Any, flow: SimFlow) -> None:
        self._policy = policy
        self._flow = flow

    def place(self, info: RequestInfo, workers: Any) -> Decision | None:
        fl = self._flow
        req = fl.sim.reqs.get(int(info.request_id))
        fl.headroom = 0.0
        if req is not None:
            fl.headroom = fl.q.headroom(req.tenant, fl.sim.now, fl.turns.done if fl.turns else ())
            info = reserved(info, fl.headroom)
        return self._policy.place(info, workers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)


class SimFlow:
    def __init__(self, sim: Simulator, policy: Any) -> None:
        cfg = sim.cfg
        self.sim = sim
        self.q: FlowQueue = flow_queue(cfg.tenants, cfg.flow_max_held, cfg.retry_floor_s, cfg.flow_headroom,
                                          cfg.flow_lookahead)
        if self.q.reserve > 0:
            sim.policy = _Reserving(policy, self)
        self.tick_s = getattr(policy, "admission_hold_s", DEFAULT_HOLD_S) or DEFAULT_HOLD_S
        slos = getattr(policy, "slos", {})
        default = getattr(policy, "ttft_slo", cfg.hold_limit_s)
        self.ttft_slo: Callable[[str], float] = lambda m: slos.get(m, (default,))[0]
        self.prices: dict[str, Callable[[int, int, int], float]] = {}
        for w in sim.workers:  # each model's first worker prices its requests
            self.prices.setdefault(w.spec.model, pricer(w.cm, w.spec.max_batch))
        self.blocked = False  # the last placement the pump tried was refused: the fleet is still full
        self.tick_at = -math.inf  # when the next periodic pump is due (past: none queued)
        self.soon_at = -math.inf  # when a pump for a finished request was last queued
        self.busy = False  # a pump is running (what it places re-enters arrive() and refused())
        self.turns: Turns | None = None  # the running pump's turns
        self.headroom = 0.0  # what the last placement left others (`_Reserving`)

    def cost(self, req: Any, model: str) -> float:
        return self.prices[model](req.n_in, 0, req.n_out)

    def arrive(self, req: Any, model: str) -> bool:
        """A new arrival: True when it waits in the queue (or was refused) instead of going to the policy now."""
        q = self.q
        if req.tries == 0:
            req.cost = self.cost(req, model)
            q.arrived(req.tenant, req.cost, self.sim.now)
        if q.may_try(req.tenant):
            return False
        self._hold(req, model)
        if not self.busy:
            self._drain()  # room may have freed since the last pump: it goes to the queue's head
        return True

    def refused(self, req: Any, d: Decision, model: str) -> None:
        """The policy refused it: held while it may still be served in time, else refused (429)."""
        if d.hold_s is not None and self.sim.now - req.sent + d.hold_s <= self.sim.cfg.hold_limit_s:
            self._hold(req, model)
            self.blocked = True
        else:
            self._refuse(req, retry_wait_s(d, self.sim.cfg.retry_floor_s), d.predicted_ttft_s or 0.0)

    def _hold(self, req: Any, model: str) -> None:
        q, now = self.q, self.sim.now
        deadline = hold_deadline(req.sent, self.ttft_slo(model), self.prices[model](req.n_in, 0, 0),
                                 self.sim.cfg.hold_limit_s, q.headroom(req.tenant, now))
        if q.hold(str(req.rid), req.tenant, req.cost, deadline, now, req, again=req.held) is None:
            self._refuse(req, q.retry_after_s(req.tenant, now), 0.0)
            return
        req.held = True
        self._tick()

    def _refuse(self, req: Any, retry_after: float, backoff: float) -> None:
        sim = self.sim
        self.q.refused(req.tenant)
        if req.tries < sim.cfg.client_retries:
            req.tries += 1
            sim.retried += 1
            sim.retry(req, max(retry_after, self.q.retry_after_s(req.tenant, sim.now)))
            return
        sim.refused += 1
        sim.reject(req, backoff)

    def placed(self, req: Any) -> None:
        self.q.placed(req.tenant, req.cost, req.n_in + req.n_out, self.sim.now)

    def finished(self, req: Any) -> None:
        now = self.sim.now
        self.q.finished(req.tenant, req.cost, now)
        if len(self.q) and self.soon_at != now:  # its room goes to the queue's head, once it is freed
            self.soon_at = now
            self.sim.pump_at(now)

    def _tick(self) -> None:
        """While the queue holds anything, a pump every admission hold period (predictions change with time)."""
        if len(self.q) and self.tick_at <= self.sim.now:
            self.tick_at = self.sim.now + self.tick_s
            self.sim.pump_at(self.tick_at)

    def pump(self) -> None:
        """A pump event (periodic, or a finished request's room): drain the queue, keep ticking while it holds."""
        if self.sim.now >= self.tick_at:  # the periodic one: predictions moved, every held request may go
            self.q.recheck()
        self._drain()
        self._tick()

    def _drain(self) -> None:
        """Place held requests in the queue's order, each tenant's until the fleet refuses it (`Turns`)."""
        q, now = self.q, self.sim.now
        self.busy = True
        for h in q.expired(now):
            self._refuse(h.item, q.retry_after_s(h.tenant, now), 0.0)
        turns = self.turns = Turns(q)
        while (h := turns.next()) is not None:
            q.take(h, now)
            self.blocked = False
            self.headroom = 0.0
            self.sim.place_held(h.item)
            if self.blocked:
                turns.refused(h, now, kept=self.headroom > 0)
        self.turns = None
        self.busy = False
