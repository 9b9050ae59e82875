"""A worker's part in live re-planning: the planner's commands on `hetmesh.worker.command.<worker_id>`.

- `RoleSwitch` (prefill <-> decode <-> both) keeps the engine: drain the old role's work, read the new
  role's work subjects.
- `ModelSwitch` reloads: drain (finish within worker.drain_timeout_s, hand the rest over: the gateway
  migrates those streams to another worker of the model), release the engine, build and start the new
  model's engine (in the command's parallel layout: tp, ep or dp over the worker's devices; a layout
  change of the same model reloads the same way), rejoin in the new role. The sim engine loads nothing; it waits as long as the
  weights would take to load (weights bytes / worker.storage_bytes_per_s, the same figure the planner
  prices the move with), so a move costs the live mesh what the planner counted.

Meanwhile the heartbeats say `draining`, `moving_to` (the new role) and `moving_model` (the new model;
`model` stays the old one until the move is over), so the scheduler places nothing here, and a request
for a model whose last worker is moving gets 503 + Retry-After. A move runs in a task of its own: the
command subscription stays responsive (a second command while moving is refused with an event), and
SIGTERM's drain cancels it. If the new model's engine cannot be built, the worker loads its old model
again and says so (`model_switch_failed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

import msgspec
from nats.aio.msg import Msg

from hetmesh import engines, wiring
from hetmesh.config import ClusterConfig, WorkerGroup
from hetmesh.costmodel.model import PARALLEL, CostModel
from hetmesh.engines.base import Engine
from hetmesh.protocol import ModelSwitch, Role, WorkerCommand

from .outbox import Outbox

log = logging.getLogger("hetmesh.worker")


class Host(Protocol):
    """What a move uses of its worker (service.Worker). The switch reads the worker's state and changes
    it only through these methods."""

    cfg: ClusterConfig
    worker_id: str
    drain_timeout_s: float
    out: Outbox

    @property
    def group(self) -> WorkerGroup: ...

    @property
    def role(self) -> Role: ...

    @property
    def draining(self) -> bool: ...

    async def drain_work(self) -> int:
        """Take no new work and finish or hand over the running requests (SIGTERM's drain); how many were
        handed over."""

    async def serve(self, role: Role) -> None:
        """Serve `role` after the drain: its KV port, its work subjects."""

    async def rejoin(self) -> None:
        """Take work again after the drain."""

    async def heartbeat(self) -> object:
        """Publish a heartbeat now (it carries this switch's moving_to, moving_model, ready_in_s)."""

    async def release_engine(self) -> None:
        """Close the engine and drop the KV landed for it."""

    async def adopt_engine(self, group: WorkerGroup, cost: CostModel, engine: Engine) -> None:
        """Serve `group` on `engine` (started) from now on."""


class Switch:
    """The move under way on one worker, if any, and how to make one."""

    def __init__(self, worker: Host) -> None:
        self.w = worker
        self.moving_to: Role | None = None  # the role being switched to
        self.moving_model = ""  # the model being switched to ("": the same model)
        self.ready_at = 0.0  # time.monotonic() when the move should be over (the heartbeats' ready_in_s)
        self.task: asyncio.Task[None] | None = None

    def ready_in_s(self) -> float:
        return max(self.ready_at - time.monotonic(), 0.0) if self.moving_to is not None else 0.0

    def _drain_bound_s(self) -> float:
        """The longest a drain takes: one heartbeat interval of settling, the running requests' time."""
        return self.w.cfg.mesh.heartbeat_interval_s + self.w.drain_timeout_s

    @property
    def busy(self) -> bool:
        return self.task is not None and not self.task.done()

    async def on_command(self, cmd: WorkerCommand, _m: Msg) -> None:
        w = self.w
        model = cmd.model if isinstance(cmd, ModelSwitch) else w.group.model
        parallel = (cmd.parallel if isinstance(cmd, ModelSwitch) else "") or w.group.parallel
        if cmd.worker_id != w.worker_id:
            log.warning("ignoring a command for %s sent to %s", cmd.worker_id, w.worker_id)
            return
        reload = model != w.group.model or parallel != w.group.parallel
        kind = "model_switch" if reload else "role_switch"
        if self.busy:
            w.out.event("", f"{kind}_refused", to_role=cmd.role.value, to_model=model, planner=cmd.planner,
                        reason=f"already moving to {self.moving_model or w.group.model}/{self.moving_to}")
            return
        if w.draining:  # shutting down
            return
        if reload:
            try:
                w.cfg.model(model)
            except KeyError:
                w.out.event("", "model_switch_refused", to_role=cmd.role.value, to_model=model, planner=cmd.planner,
                            reason="the cluster file has no such model")
                return
            if parallel not in PARALLEL:
                w.out.event("", "model_switch_refused", to_role=cmd.role.value, to_model=model, planner=cmd.planner,
                            reason=f"parallel {parallel!r} is not one of {', '.join(PARALLEL)}")
                return
            self.task = asyncio.create_task(self.switch_model(model, cmd.role, cmd.planner, cmd.reason,
                                                              cmd.seconds if isinstance(cmd, ModelSwitch) else 0.0,
                                                              parallel))
        elif cmd.role != w.role:
            self.task = asyncio.create_task(self.switch_role(cmd.role, cmd.planner, cmd.reason))

    async def cancel(self) -> None:
        """SIGTERM's drain takes over from a move's."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task

    async def _rejoin(self) -> None:
        """Take work again (whatever role and model the move ended in) and say so in a heartbeat at once."""
        w = self.w
        await w.rejoin()
        self.moving_to, self.moving_model = None, ""
        with contextlib.suppress(Exception):
            await w.heartbeat()

    async def switch_role(self, role: Role, planner: str = "", reason: str = "") -> None:
        """Serve `role` from now on, without reloading the engine: drain the old role's work, then read
        the new role's work subjects. The first heartbeat after says the new role."""
        w = self.w
        old, t0 = w.role, time.monotonic()
        self.moving_to, self.ready_at = role, t0 + self._drain_bound_s()
        w.out.event("", "role_switching", from_role=old.value, to_role=role.value, planner=planner, reason=reason)
        handed = -1
        try:
            handed = await w.drain_work()  # as SIGTERM's; lets go of the old subjects
            await w.serve(role)
        except Exception:
            log.exception("role switch to %s failed; serving %s", role, w.role)
        await self._rejoin()
        w.out.event("", "role_switched", from_role=old.value, to_role=w.role.value, handed_over=handed,
                    seconds=round(time.monotonic() - t0, 3), planner=planner)
        log.info("worker %s: role %s -> %s in %.2fs", w.worker_id, old, w.role, time.monotonic() - t0)

    async def switch_model(self, model: str, role: Role, planner: str = "", reason: str = "",
                           expected_s: float = 0.0, parallel: str = "") -> None:
        """Serve `model` in `role` (and `parallel`, "" to keep the layout) from now on: drain, release the
        engine, load the model's, rejoin. `expected_s`: the planner's estimate of the move (engine seconds),
        in the events beside the real one."""
        w = self.w
        old_group, old_role, t0 = w.group, w.role, time.monotonic()
        new_group = msgspec.structs.replace(old_group, model=model, parallel=parallel or old_group.parallel)
        load_s = self._load_s(new_group)  # expected, wall seconds
        self.moving_to, self.moving_model, self.ready_at = role, model, t0 + self._drain_bound_s() + load_s
        w.out.event("", "model_switching", from_model=old_group.model, to_model=model, from_role=old_role.value,
                    to_role=role.value, from_parallel=old_group.parallel, to_parallel=new_group.parallel,
                    planner=planner, reason=reason, expected_seconds=expected_s)
        handed, loaded_s, error = -1, 0.0, ""
        try:
            handed = await w.drain_work()  # as SIGTERM's; lets go of the old subjects
            t_load = time.monotonic()
            self.ready_at = t_load + load_s
            new_role = role
            try:
                await self._reload(new_group)
            except Exception as exc:  # the new model's engine cannot be built: serve the old one again
                log.exception("loading model %s failed; loading %s again", model, old_group.model)
                error = repr(exc)[:300]
                new_role = old_role
                await self._reload(old_group)
            loaded_s = time.monotonic() - t_load
            await w.serve(new_role)
        except Exception as exc:
            log.exception("model switch to %s failed", model)
            error = error or repr(exc)[:300]
        await self._rejoin()
        w.out.event("", "model_switch_failed" if error else "model_switched", from_model=old_group.model,
                    to_model=w.group.model, from_role=old_role.value, to_role=w.role.value,
                    from_parallel=old_group.parallel, to_parallel=w.group.parallel, handed_over=handed,
                    load_seconds=round(loaded_s, 3), seconds=round(time.monotonic() - t0, 3), planner=planner,
                    error=error or None)
        log.info("worker %s: %s/%s -> %s/%s in %.2fs (load %.2fs)", w.worker_id, old_group.model, old_role,
                 w.group.model, w.role, time.monotonic() - t0, loaded_s)

    def _load_s(self, group: WorkerGroup) -> float:
        """How long loading `group`'s weights takes, in wall seconds: weights bytes over the storage
        bandwidth (engine seconds, the planner's reload figure) at the mesh's time scale."""
        cfg = self.w.cfg
        return wiring.cost_model(cfg, group).weights_bytes() / cfg.worker.storage_bytes_per_s / cfg.mesh.time_scale

    async def _reload(self, group: WorkerGroup) -> None:
        """Release the engine (and the KV it held), build and start `group`'s, hand it to the worker."""
        w = self.w
        await w.release_engine()
        cost = wiring.cost_model(w.cfg, group)
        engine = engines.create(w.cfg, group, cost)
        if engine.name == "sim":  # loads nothing: spend the time the weights would take
            await asyncio.sleep(self._load_s(group))
        await engine.start()
        await w.adopt_engine(group, cost, engine)
