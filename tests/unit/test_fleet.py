"""The cost policy's fleet table: synced by view identity, it always equals a table built afresh."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hetmesh.placement import WorkerView
from hetmesh.placement.cost import CostPolicy
from hetmesh.placement.fleet import Fleet
from hetmesh.protocol import Role

SHAPES = [("nvidia-h100", 8, "tp"), ("amd-mi300x", 8, "tp"), ("amd-mi300x", 8, "dp")]


def _view(i: int, shape: int, role: Role, running: int, queue: int) -> WorkerView:
    acc, devices, parallel = SHAPES[shape]
    return WorkerView(worker_id=f"w{i}", model="m", accelerator=acc, vendor=acc.split("-")[0], devices=devices,
                      role=role, queue_depth=queue, running=running, max_batch=64, kv_blocks_total=1000,
                      kv_blocks_used=running * 10, block_size=16, parallel=parallel)


_change = st.tuples(st.integers(0, 7), st.integers(0, 2), st.sampled_from(list(Role)), st.integers(0, 64),
                    st.integers(0, 9))


@settings(max_examples=60, deadline=None)
@given(rounds=st.lists(st.lists(_change, max_size=8), min_size=1, max_size=6))
def test_incremental_sync_equals_a_rebuild(rounds: list[list[tuple[int, int, Role, int, int]]]) -> None:
    policy = CostPolicy(models={"m": "llama-3.1-70b"})
    views = [_view(i, 0, Role.BOTH, 0, 0) for i in range(8)]
    live = Fleet(policy._cm_row, policy._slot, lambda: policy._coef)
    for changes in rounds:
        views = list(views)
        for i, shape, role, running, queue in changes:
            views[i] = _view(i, shape, role, running, queue)
        live.sync(views)
        fresh = Fleet(policy._cm_row, policy._slot, lambda: policy._coef)
        fresh.sync(views)
        for name in ("num", "rows", "slots", "role", "model_code", "coef"):
            assert np.array_equal(getattr(live, name), getattr(fresh, name)), name
        assert np.array_equal(live.coef2, fresh.coef2)
        assert live.ids == fresh.ids and live.views == views
