"""The live planner's moves as worker commands (pure): which of a plan's moves a running worker can carry
out, and the one plan over the whole fleet that may move workers between models (`planner.scope = fleet`).

A worker can switch role (a `RoleSwitch`: no reload) or model or parallel layout (a `ModelSwitch`: drain,
release the engine, load the model's in the new layout). It cannot stop: that move is proposed, not made.
The planner prices a reload as the drain plus the weights' bytes over the storage bandwidth
(`hetmesh.planner.plan.moves`), the figure the sim engine's reload takes on the live mesh too
(worker.storage_bytes_per_s).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from hetmesh.config import ClusterConfig
from hetmesh.planner.inputs import ModelDemand, ServerGroup
from hetmesh.planner.live import demand, fleet, role_moves
from hetmesh.planner.plan import Move, Plan
from hetmesh.protocol import ModelDemandStats, Role, WorkerStatus


class Command(NamedTuple):
    """One move a worker carries out: `model` and `parallel` empty for a role switch (a RoleSwitch)."""

    worker_id: str
    role: Role
    model: str
    parallel: str
    move: Move


def model_moves(p: Plan) -> list[Command]:
    """Each reload of the plan a worker can make: a model change, or a multi-device worker's change of
    parallel layout (on one device tp, ep and dp are the same: a role switch at most)."""
    new = {a.server: a for a in p.assignments}
    out = []
    for mv in p.moves:
        a = new.get(mv.server)
        if mv.change != "reload" or a is None or not a.model or not mv.server.endswith("-0"):
            continue
        model, _role, parallel = [*mv.before.split("/"), "", "", ""][:3]
        if a.model != model or (a.devices > 1 and a.parallel != parallel):
            out.append(Command(mv.server[:-2], a.role, a.model, a.parallel, mv))
    return out


def commands(p: Plan) -> list[Command]:
    """Every move of the plan a worker carries out live."""
    return [Command(w, r, "", "", mv) for w, r, mv in role_moves(p)] + model_moves(p)


def plan_fleet(stats: Sequence[ModelDemandStats], workers: Sequence[WorkerStatus], cfg: ClusterConfig,
               planner: Callable[[list[ServerGroup], list[ModelDemand]], Plan]) -> dict[str, Plan]:
    """One plan over every model with traffic and the live workers of those models, so that a worker may
    move to another model; a model without traffic keeps its workers. Keyed by the models, '+'-joined."""
    ds = [d for s in stats if (d := demand(s, cfg)) is not None]
    groups = [g for d in ds for g in fleet(workers, cfg, d.name)]
    if not ds or not groups:
        return {}
    return {"+".join(d.name for d in ds): planner(groups, ds)}
