"""Capacity planning for several models: each model's servers are bought on its own requests (a server
runs one model), numbered apart, and checked together; the joint search where the kinds' counts
cannot hold the parts."""

from __future__ import annotations

import pytest

from hetmesh.planner import ModelDemand, ServerGroup
from hetmesh.planner.buy import cheapest
from hetmesh.planner.measure import calibrate
from hetmesh.planner.plan import demand_trace, options
from hetmesh.sim.traces import Trace

DEMANDS = [ModelDemand(name="chat", spec="llama-3.1-70b", rate=3.0, input_mean=1024, output_mean=256),
           ModelDemand(name="code", spec="qwen3-32b", rate=3.0, input_mean=4096, output_mean=64, ttft_slo_s=4.0,
                       tpot_slo_s=0.05)]


def _kinds(count: int) -> list[ServerGroup]:
    return [ServerGroup(name="h200", accelerator="nvidia-h200", count=count),
            ServerGroup(name="mi300x", accelerator="amd-mi300x", count=count)]


@pytest.mark.slow
def test_two_models_are_bought_apart_on_servers_numbered_apart() -> None:
    kinds = _kinds(4)
    tr = demand_trace(DEMANDS, 60.0)
    opts = calibrate(kinds, DEMANDS, options(kinds, DEMANDS), tr, 0.9)
    both = cheapest(kinds, DEMANDS, trace=tr, opts=opts)
    assert both is not None and both.meets
    assert set(both.model_attainment) == {"chat", "code"} and min(both.model_attainment.values()) >= 0.9
    ids = [a.server for a in both.assignments]
    assert len(set(ids)) == len(ids)
    each = [cheapest(kinds, [d], trace=Trace([r for r in tr.requests if r.model == d.name], tr.block_tokens),
                     opts=[o for o in opts if o.model == d.name]) for d in DEMANDS]
    assert all(p is not None and p.meets for p in each)
    assert both.usd_per_hour == pytest.approx(sum(p.usd_per_hour for p in each if p is not None))
    assert {a.model for a in both.assignments} == {"chat", "code"}


@pytest.mark.slow
def test_parts_the_counts_cannot_hold_fall_back_to_the_joint_search() -> None:
    kinds = _kinds(1)  # each model alone would take the cheaper kind's only server
    tr = demand_trace(DEMANDS, 60.0)
    opts = calibrate(kinds, DEMANDS, options(kinds, DEMANDS), tr, 0.9)
    got = cheapest(kinds, DEMANDS, trace=tr, opts=opts)
    assert got is not None
    assert all(n <= 1 for n in got.servers.values())
    assert len({a.server for a in got.assignments}) == len(got.assignments)
