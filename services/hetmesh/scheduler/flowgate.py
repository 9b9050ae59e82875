"""The scheduler's side of flow control: the flow queue (hetmesh.placement.flow, built by hetmesh.wiring.flow,
as the simulator builds its own) at the point where the scheduler holds a request it cannot place yet.

A submit that arrives while anything of a higher band is held or a tenant of its band with less in flight per
weight than its own (`FlowQueue.may_try`), or that the policy refuses while its SLO is still in reach, waits on a
future; a pump places held requests in the queue's order as it is held, every admission hold period and whenever
a request finishes, a refusal ending its tenant's turn once the requests behind it that may go instead have been
tried (`Turns`) and standing until a request finishes or the next periodic pump (`FlowQueue.recheck`).
The queue runs on the policy's clock, the engines' (monotonic wall time x `mesh.time_scale`), as the simulator
runs it: its deadlines, its decaying sums of what each tenant sent and was placed, and the rate a tenant's work
drains at are in engine seconds; a Retry-After goes back to the client in wall seconds.
The policy sees each request with the headroom its tenant must leave others (`FlowQueue.headroom`). What the
pump places is booked in the cluster view at once (`ClusterState.assigned`), so the next placement of the same
pump sees it. A request's booked cost leaves its tenant's share when it finishes, is cancelled, its worker is
lost, its WorkItem is not stored, or reconciling finds no worker holds it (`done`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from hetmesh import config, wiring
from hetmesh.placement import REFUSED, ClusterState, Decision, RequestInfo, refusals
from hetmesh.placement.admission import DEFAULT_HOLD_S
from hetmesh.placement.flow import FlowQueue, Turns, hold_deadline, reserved, token_cost
from hetmesh.protocol import InferenceRequest

Placed = tuple[Decision | None, bool]  # the decision, and whether it is booked in the cluster view already


@dataclass(slots=True)
class _Waiting:
    fut: asyncio.Future[Placed | refusals.Refusal]
    info: RequestInfo
    req: InferenceRequest
    t0: float  # on the queue's clock (`FlowGate.now`), when it was first held


class FlowGate:
    def __init__(self, cfg: config.ClusterConfig, q: FlowQueue, place: Callable[[RequestInfo], Decision | None],
                 state: ClusterState) -> None:
        self.q = q
        self.cfg = cfg
        self.place_fn = place
        self.state = state
        self.scale = cfg.mesh.time_scale  # the policy's clock is the engines'
        self.tick_s = (cfg.scheduler.admission_hold_s or DEFAULT_HOLD_S) / self.scale
        self.prices = {m.name: wiring.cluster_pricer(cfg, m.name) for m in cfg.models}
        self.inflight: dict[str, tuple[str, float, float]] = {}  # request id -> tenant, cost, when placed
        self._pump_task: asyncio.Task[None] | None = None

    def now(self) -> float:
        """The queue's clock: the engines' (the policy's) time."""
        return time.monotonic() * self.scale

    def tenant(self, req: InferenceRequest) -> str:
        return req.tenant or wiring.DEFAULT_TENANT

    def unknown(self, req: InferenceRequest) -> refusals.Refusal | None:
        t = self.tenant(req)
        return None if t in self.q.tenants else refusals.unknown_tenant(t, self.cfg.flow.header)

    def cost(self, req: InferenceRequest, cached: int) -> float:
        price = self.prices.get(req.model)
        n, out = len(req.prompt_tokens), req.sampling.max_tokens
        return price(n, cached, out) if price is not None else token_cost(n - cached, out)

    def _place(self, req: InferenceRequest, info: RequestInfo,
               turns: Turns | None = None) -> tuple[Decision | None, float]:
        """The policy's placement, with the headroom its tenant leaves others (`FlowQueue.headroom`; `turns`: the
        pump's, whose refused tenants are owed room), and that headroom."""
        head = self.q.headroom(self.tenant(req), self.now(), turns.done if turns is not None else ())
        return self.place_fn(reserved(info, head)), head

    def _refusal(self, req: InferenceRequest, why: str) -> refusals.Refusal:
        t = self.tenant(req)
        self.q.refused(t)
        return refusals.flow_refused(req.model, t, why, self.q.retry_after_s(t, self.now()) / self.scale)

    def _booked(self, req: InferenceRequest, d: Decision | None, cost: float) -> None:
        if d is not None:
            t = self.tenant(req)
            self.q.placed(t, cost, len(req.prompt_tokens) + req.sampling.max_tokens, self.now())
            self.inflight[req.request_id] = (t, cost, time.monotonic())

    async def place(self, req: InferenceRequest, info: RequestInfo, cached: int) -> Placed | refusals.Refusal:
        """Place now, or hold in the queue until the pump places or refuses it."""
        t, q = self.tenant(req), self.q
        cost = self.cost(req, cached)
        if req.attempt == 0:
            q.arrived(t, cost, self.now())
        tried = q.may_try(t)
        if tried:
            d, _ = self._place(req, info)
            if d is None or d.mode != REFUSED:
                self._booked(req, d, cost)
                return d, False
            if d.hold_s is None:
                return d, False  # admission's own refusal: the caller answers it
        now = self.now()
        price = self.prices.get(req.model)  # its own prefill (none: unknown, taken as 0)
        prefill = price(len(req.prompt_tokens), cached, 0) if price is not None else 0.0
        deadline = hold_deadline(now, self.cfg.slo(req.model)[0], prefill, self.cfg.gateway.hold_limit_s * self.scale,
                                 q.headroom(t, now))
        fut: asyncio.Future[Placed | refusals.Refusal] = asyncio.get_running_loop().create_future()
        if q.hold(req.request_id, t, cost, deadline, now, _Waiting(fut, info, req, now)) is None:
            return self._refusal(req, f"it already holds {self.cfg.flow.max_held} requests")
        if self._pump_task is None or self._pump_task.done():
            self._pump_task = asyncio.create_task(self._pump_loop())
        if not tried:
            self.pump()  # room the fleet freed since the last pump goes to the queue's head
        return await fut

    async def _pump_loop(self) -> None:
        while len(self.q):
            await asyncio.sleep(self.tick_s)
            self.q.recheck()  # predictions moved: every held request may go
            self.pump()

    def pump(self) -> None:
        """Place held requests in the queue's order, each tenant's until the fleet refuses it (`Turns`; no await:
        one view)."""
        q, now = self.q, self.now()
        for h in q.expired(now):
            w: _Waiting = h.item  # type: ignore[assignment]
            if not w.fut.done():
                w.fut.set_result(self._refusal(w.req, "its wait passed the latest start that meets its TTFT SLO"))
        turns = Turns(q)
        while (h := turns.next()) is not None:
            w = h.item  # type: ignore[assignment]
            if w.fut.done():  # its client went away
                q.take(h, now)
                continue
            held = now - w.t0
            q.take(h, now)  # out of the queue while placed (its tenant's headroom counts the others waiting)
            d, head = self._place(w.req, msgspec.structs.replace(w.info, arrival=w.info.arrival + held,
                                                                 waited_s=w.info.waited_s + held), turns)
            if d is not None and d.mode == REFUSED and d.hold_s is not None:
                # the fleet is still full for it: back in the queue (its place kept), its tenant's turn goes on
                # with the requests behind it or is over (`Turns`)
                q.hold(h.key, h.tenant, h.cost, h.deadline, now, w, again=True)
                turns.refused(h, now, kept=head > 0)
                continue
            if d is not None and d.mode != REFUSED:
                self.state.assigned(d)
                self._booked(w.req, d, h.cost)
            w.fut.set_result((d, d is not None and d.mode != REFUSED))

    def done(self, request_id: str, slo_met: bool | None = None) -> None:
        """A request left the mesh (finished, cancelled, its worker lost, never dispatched, no worker holds it):
        its cost leaves its tenant's share; `slo_met`: a finished one's verdict (None: not judged)."""
        got = self.inflight.pop(request_id, None)
        if got is not None:
            self.q.finished(got[0], got[1], self.now(), slo_met)
            if len(self.q):
                self.pump()

    def rows(self) -> list[tuple[str, str, str, dict[str, str], float]]:
        """Per-tenant metrics rows (hetmesh.metrics.Row)."""
        out = []
        for name in self.q.tenants:
            s = self.q.stats(name)
            lab = {"tenant": name}
            out += [("hetmesh_tenant_requests_total", "Requests per tenant", "counter", lab, s.requests),
                    ("hetmesh_tenant_placed_total", "Requests placed per tenant", "counter", lab, s.placed),
                    ("hetmesh_tenant_refused_total", "Requests flow control refused per tenant (429)", "counter",
                     lab, s.refused),
                    ("hetmesh_tenant_held_total", "Requests flow control held per tenant", "counter", lab, s.held),
                    ("hetmesh_tenant_held_seconds_total", "Seconds requests were held, per tenant (engine time)", "counter", lab,
                     s.held_s),
                    ("hetmesh_tenant_tokens_total", "Prompt + max output tokens placed per tenant", "counter", lab,
                     s.tokens),
                    ("hetmesh_tenant_in_flight_cost", "Engine seconds placed and not finished per tenant", "gauge",
                     lab, self.q.tenants[name].inflight),
                    ("hetmesh_tenant_finished_total", "Requests finished per tenant, judged against their SLOs",
                     "counter", lab, s.finished),
                    ("hetmesh_tenant_slo_attained_total", "Requests per tenant that met their TTFT and TPOT SLOs "
                     "(from their submit, time held included)", "counter", lab, s.slo_met)]
        return out

    def status(self) -> dict[str, dict[str, float]]:
        """What `hetmesh status --tenants` shows."""
        out = {}
        for name, st in self.q.tenants.items():
            s = st.stats
            out[name] = {"weight": st.tenant.weight, "band": st.tenant.band, "requests": s.requests,
                         "placed": s.placed, "refused": s.refused, "held": len(st.held), "held_s": round(s.held_s, 3),
                         "tokens": s.tokens, "in_flight_cost_s": round(st.inflight, 3),
                         "slo_attainment": round(s.slo_attainment, 4), "finished": s.finished}
        return out
