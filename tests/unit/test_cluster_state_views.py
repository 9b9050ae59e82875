"""ClusterState keeps its placement views between placements and rebuilds only what changed: after any run of
heartbeats, bookings, finishes, removals and wedged workers they equal a rebuild from scratch, and a list
handed out earlier is never changed under its holder."""

from __future__ import annotations

import random

from hetmesh import subjects
from hetmesh.placement import ClusterState, Decision
from hetmesh.protocol import Heartbeat, Role


def beat(i: int, rng: random.Random, ts: float, running: int | None = None) -> Heartbeat:
    wid = f"w{i}"
    return Heartbeat(worker_id=wid, model="m", accelerator="nvidia-h100", vendor="nvidia", devices=1,
                     role=Role.BOTH, engine="sim", work_subject=subjects.work_direct("both", "nvidia", "h100", wid),
                     queue_depth=rng.randint(0, 3), running=rng.randint(0, 8) if running is None else running,
                     max_batch=8, kv_blocks_total=100, kv_blocks_used=rng.randint(0, 100), block_size=16, ts=ts)


def rebuilt(state: ClusterState) -> list[object]:
    return [ClusterState._view(e) for e in state._workers.values() if not e.wedged]


def test_views_kept_between_placements_equal_a_rebuild() -> None:
    rng = random.Random(7)
    state = ClusterState(heartbeat_timeout_s=1.0, wedge_timeout_s=0.5)
    now = 0.0
    handed: list[tuple[list[object], list[object]]] = []
    for step in range(3000):
        now += 0.01
        op = rng.random()
        i = rng.randrange(12)
        if op < 0.3:
            # a worker whose counters stand still while it runs goes wedged after a while
            state.observe(beat(i, random.Random(i), now, running=2) if i < 3 else beat(i, rng, now), now)
        elif op < 0.6:
            state.assigned(Decision(mode="aggregated", decode_worker=f"w{i}"))
        elif op < 0.8:
            state.finished(f"w{i}", now + 1)
        elif op < 0.83:
            state.remove(f"w{i}")
        elif op < 0.86:
            state.wedged(now)
        else:
            state.expire(now)
        views = state.views()
        assert views == rebuilt(state), step
        if step % 50 == 0:
            handed.append((views, list(views)))
    assert all(v == copy for v, copy in handed)  # never changed after it was handed out
