"""Planner: the asyncio shell that runs the pure planner on the live mesh.

Every `planner.interval_s` the leading planner takes the scheduler's last demand report
(`hetmesh.sched.demand`) and its view of the workers (`hetmesh.sched.status`), plans each model's
own workers with `hetmesh.planner.plan` (its `horizon_s` is the hysteresis: a move must pay for its
switch cost within it), and publishes the proposal on `hetmesh.planner.plan` plus a `proposal`
event. With `planner.scope = "fleet"` it makes one plan over every model with traffic instead, so that
workers may move between models (hetmesh.planner.commands). In `act` mode it also sends the commands
(`RoleSwitch`, `ModelSwitch`), at most `max_moving_share` of the fleet moving at once and none it moved
within the last `horizon_s` (the move was priced to hold that long; no flapping); the workers drain,
switch and reload on their own (hetmesh.worker.switch); a multi-device worker's change of parallel
layout is a `ModelSwitch` too (a reload). A stop is reported, not made.

One planner acts at a time: the leader holds a lease, the key "leader" of the JetStream KV bucket
`hetmesh_planner`, whose TTL is `planner.lease_ttl_s`. It creates the key (only if absent) and renews
it with a compare-and-set on its revision; a planner whose renewal fails has lost the lease and stops
acting, and another creates the key once the dead leader's entry has aged out. If no planner runs,
the mesh keeps its last layout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
import uuid
from collections import deque
from typing import Any

import nats.js.errors
from nats.js.kv import KeyValue
from prometheus_client import CollectorRegistry, Counter, Gauge

from hetmesh import config, metrics, subjects, telemetry
from hetmesh.bus import Bus, EventBatcher, decode, encode
from hetmesh.costmodel.learn import pooled
from hetmesh.planner import plan
from hetmesh.planner.commands import commands, plan_fleet
from hetmesh.planner.live import forecast, merge, plan_models, to_send
from hetmesh.protocol import (
    DemandReport,
    ModelDemandStats,
    ModelSwitch,
    PlanProposal,
    ProposedMove,
    RoleSwitch,
    SchedulerStatus,
    ServiceEvent,
)
from hetmesh.runtime import run_service
from hetmesh.wiring import efficiencies

log = logging.getLogger("hetmesh.planner")

LEASE_KEY = "leader"
STATUS_TIMEOUT_S = 5.0
REPORTS_KEPT_INTERVALS = 3  # a scheduler replica's report counts until this many intervals without a newer one
CHECK_DURATION_S = 120.0  # seconds of synthetic demand each candidate layout is simulated on


class Lease:
    """Leader election on a JetStream KV key: create-if-absent to take it, compare-and-set on the revision
    to keep it; the bucket's TTL ends a dead leader's lease."""

    def __init__(self, kv: KeyValue, instance: str) -> None:
        self.kv = kv
        self.instance = instance
        self.revision: int | None = None  # set while this planner holds the lease
        self._lock = asyncio.Lock()  # one compare-and-set at a time: two with the same revision, one would fail

    @property
    def held(self) -> bool:
        return self.revision is not None

    async def refresh(self) -> bool:
        """Renew the lease if held, else try to take it. True while held."""
        async with self._lock:
            return await self._refresh()

    async def _refresh(self) -> bool:
        try:
            if self.revision is not None:
                self.revision = await self.kv.update(LEASE_KEY, self.instance.encode(), last=self.revision)
            else:
                self.revision = await self.kv.create(LEASE_KEY, self.instance.encode())
        except nats.js.errors.KeyWrongLastSequenceError:
            self.revision = None  # someone else holds it (or ours aged out and was taken)
            # ... or it is still ours, and only a renewal's answer was lost: carry on from its revision
            with contextlib.suppress(Exception):
                entry = await self.kv.get(LEASE_KEY)
                if entry.value == self.instance.encode():
                    self.revision = entry.revision
        except Exception as exc:  # the bus or JetStream away: not knowing is not holding
            log.warning("lease refresh failed: %r", exc)
            self.revision = None
        return self.held


class PlannerService:
    def __init__(self, cfg: config.ClusterConfig, instance: str, mode: str) -> None:
        self.cfg = cfg
        self.instance = instance
        self.mode = mode
        self.demand: dict[str, tuple[float, DemandReport]] = {}  # scheduler instance -> (received, report)
        self.rounds: deque[list[ModelDemandStats]] = deque(maxlen=2)  # the last rounds' demand (planner.forecast)
        self.moved_at: dict[str, float] = {}  # worker -> when this planner last moved it (monotonic)
        self.tracer = telemetry.setup("planner", instance)
        self.registry = CollectorRegistry()
        self.m_plans = Counter("hetmesh_planner_plans", "Plans made by the leading planner", ["chosen"],
                               registry=self.registry)
        self.m_moves = Counter("hetmesh_planner_moves", "Role and model switches proposed and sent", ["state"],
                               registry=self.registry)
        self.m_gain = Gauge("hetmesh_planner_predicted_gain", "Proposed over current simulated goodput",
                            registry=self.registry)
        self.m_leader = Gauge("hetmesh_planner_leader", "1 while this planner holds the lease", registry=self.registry)
        self.http: metrics.MetricsServer | None = None
        self.bus: Bus
        self.events: EventBatcher
        self.lease: Lease
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self.bus = await Bus.for_mesh(self.cfg.mesh, f"planner-{self.instance}")
        self.events = EventBatcher(self.bus, "planner")
        js = self.bus.nc.jetstream(timeout=STATUS_TIMEOUT_S)
        replicas = self.cfg.work_queue.replicas  # on a NATS cluster the lease outlives any one node
        try:
            kv = await js.create_key_value(bucket=subjects.PLANNER_BUCKET, ttl=self.cfg.planner.lease_ttl_s,
                                           history=1, replicas=replicas)
        except nats.js.errors.BadRequestError:  # there already, made with another TTL: use it as it is
            kv = await js.key_value(subjects.PLANNER_BUCKET)
        self.lease = Lease(kv, self.instance)
        # `hetmesh plan --live`
        self.latest = await js.create_key_value(bucket=subjects.PLAN_BUCKET, history=1, replicas=replicas)
        await self.bus.subscribe(subjects.DEMAND, DemandReport, self.on_demand)  # garbage: logged, dropped
        self._tasks = [asyncio.create_task(self._lease_loop()), asyncio.create_task(self._plan_loop())]
        self.http = metrics.serve_from_env(self.registry, self._ready)
        log.info("planner %s up, mode %s, every %.1fs", self.instance, self.mode, self.cfg.planner.interval_s)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.lease.held:  # hand the lease on at once rather than after its TTL
            try:
                await self.lease.kv.delete(LEASE_KEY, last=self.lease.revision)
            except Exception as exc:
                log.info("lease not released (%r); it ages out", exc)
        if self.http is not None:
            self.http.close()
        await self.events.close()
        await self.bus.close()

    def _ready(self) -> dict[str, object]:
        return {"ready": self.bus.nc.is_connected, "instance": self.instance, "leader": self.lease.held}

    def _event(self, kind: str, **detail: str | int | float | bool | None) -> None:
        self.events.add(ServiceEvent(service="planner", instance=self.instance, request_id="", kind=kind,
                                     ts=time.time(), detail=detail))

    async def on_demand(self, report: DemandReport, _m: Any) -> None:
        self.demand[report.instance] = (time.monotonic(), report)

    def current_demand(self) -> list[ModelDemandStats]:
        """Every scheduler replica's last report (each placed its own share), those gone quiet dropped."""
        stale = time.monotonic() - REPORTS_KEPT_INTERVALS * self.cfg.planner.interval_s
        self.demand = {k: v for k, v in self.demand.items() if v[0] >= stale}
        return merge(r.models for _t, r in self.demand.values())

    async def _lease_loop(self) -> None:
        period = self.cfg.planner.lease_ttl_s / 3
        while True:
            was = self.lease.held
            now = await self.lease.refresh()
            if now != was:
                log.info("planner %s %s the lease", self.instance, "holds" if now else "lost")
                self._event("leader_acquired" if now else "leader_lost")
                self.m_leader.set(1 if now else 0)
            await asyncio.sleep(period)

    async def _plan_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.planner.interval_s)
            if not self.lease.held:
                continue
            try:
                await self.plan_once()
            except Exception as exc:  # bad input or a planner failure: logged, and the next round tries again
                log.exception("planning failed")
                self._event("plan_failed", error=repr(exc)[:300])

    async def plan_once(self) -> PlanProposal | None:
        began = time.monotonic()
        self.rounds.append(self.current_demand())
        demand = forecast(list(self.rounds), self.cfg.planner.forecast)
        reply = await self.bus.nc.request(subjects.SCHED_STATUS, b"", timeout=STATUS_TIMEOUT_S)
        status = decode(reply.data, SchedulerStatus)
        workers = status.details
        pc = self.cfg.planner
        storage = self.cfg.worker.storage_bytes_per_s  # a model move's reload: weights / this (as the workers')
        # each kind of server at the speed the scheduler learned from its engines, over the file's factors
        learned = {**efficiencies(self.cfg), **{k: e for k, (e, _, _) in pooled(workers).items()}}
        with self.tracer.start_as_current_span("plan") as span:
            plans = await asyncio.to_thread(
                plan_fleet if pc.scope == "fleet" else plan_models, demand, workers, self.cfg,
                lambda g, d: plan(g, d, horizon_s=pc.horizon_s, check_duration_s=CHECK_DURATION_S,
                                  storage_bytes_per_s=storage, efficiencies=learned))
            moves = [m for p in plans.values() for m in commands(p)]
            sent: list[str] = []
            if not await self.lease.refresh():  # the lease may have gone while the plan ran: say and do nothing
                log.info("planner %s lost the lease while planning; nothing proposed", self.instance)
                return None
            if self.mode == "act" and moves:
                moving = sum(bool(w.moving_to) for w in workers)
                by_worker = {c.worker_id: c for c in moves}
                now = time.monotonic()
                for wid, role, mv in to_send([(c.worker_id, c.role, c.move) for c in moves], len(workers), moving,
                                             pc.max_moving_share, self.moved_at, now,
                                             pc.horizon_s / self.cfg.mesh.time_scale):  # engine s -> wall s
                    self.moved_at[wid] = now
                    c = by_worker[wid]
                    await self.bus.publish(subjects.worker_command(wid), ModelSwitch(
                        worker_id=wid, model=c.model, role=role, planner=self.instance, reason="planner",
                        seconds=mv.seconds, parallel=c.parallel) if c.model else RoleSwitch(
                        worker_id=wid, role=role, planner=self.instance, reason="planner"))
                    sent.append(wid)
            pred = sum(p.predicted.get("goodput_tok_s", 0.0) for p in plans.values())
            cur = sum(next((c.goodput_tok_s for c in p.candidates if c.name == "current"), 0.0)
                      for p in plans.values())
            proposal = PlanProposal(
                planner=self.instance, mode=self.mode, ts=time.time(),
                chosen=",".join(f"{m}:{p.chosen}" for m, p in sorted(plans.items())),
                current={w.worker_id: f"{w.model}/{w.role.value}" for w in workers},
                proposed={a.server[:-2]: f"{a.model}/{a.role.value}" for p in plans.values() for a in p.assignments},
                moves=[ProposedMove(worker_id=c.worker_id, change=c.move.change, before=c.move.before,
                                    after=c.move.after, seconds=c.move.seconds) for c in moves],
                sent=sent, predicted_goodput_tok_s=pred, current_goodput_tok_s=cur)
            span.set_attribute("hetmesh.moves", len(moves))
            span.set_attribute("hetmesh.sent", len(sent))
        await self.bus.publish(subjects.PLAN, proposal)
        await self.latest.put("latest", encode(proposal))
        log.info("planned in %.2fs: %s, %d moves, %d sent", time.monotonic() - began, proposal.chosen or "no demand",
                 len(moves), len(sent))
        self._event("proposal", mode=self.mode, chosen=proposal.chosen, moves=len(moves), sent=",".join(sent),
                    predicted_goodput_tok_s=round(pred, 3), current_goodput_tok_s=round(cur, 3))
        for p in plans.values():
            self.m_plans.labels(p.chosen).inc()
        self.m_moves.labels("proposed").inc(len(moves))
        self.m_moves.labels("sent").inc(len(sent))
        if cur > 0:
            self.m_gain.set(pred / cur)
        return proposal


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m hetmesh.planner_service", description=__doc__)
    ap.add_argument("--cluster", help="cluster file (TOML)")
    ap.add_argument("--instance", default=f"planner-{uuid.uuid4().hex[:6]}")
    ap.add_argument("--mode", choices=["advise", "act"], default=None,
                    help="override the cluster file's planner.mode")
    ap.add_argument("--scope", choices=["model", "fleet"], default=None,
                    help="override the cluster file's planner.scope (fleet: workers may also change model)")
    args = ap.parse_args()
    cfg = config.load(args.cluster)
    if args.scope:
        cfg.planner.scope = args.scope
    mode = args.mode or cfg.planner.mode
    if mode == "off":
        print("python -m hetmesh.planner_service: planner.mode is off in the cluster file; pass --mode advise|act",
              file=sys.stderr)
        sys.exit(2)
    run_service(lambda: PlannerService(cfg, args.instance, mode))
