"""The integer program's linear relaxation (a bound on what whole servers can cost), and the planner
telling a caller what it is simulating (a what-if on an overloaded fleet takes minutes)."""

from __future__ import annotations

import pytest

from hetmesh.planner import ModelDemand, ServerGroup, plan
from hetmesh.planner.buy import cheapest
from hetmesh.planner.solve import Option, solve
from hetmesh.protocol import Role


def _demand(rate: float) -> ModelDemand:
    return ModelDemand(name="m", spec="llama-3.1-70b", rate=rate, input_mean=2048, output_mean=256)


def test_the_relaxation_buys_fractions_and_bounds_the_whole_purchase() -> None:
    groups = [ServerGroup(name="a", accelerator="amd-mi300x", count=8),
              ServerGroup(name="b", accelerator="amd-mi308x", count=8)]
    # a: 1 req/s for $3/h; b: 0.6 req/s for $2/h ($3.33 per req/s, dearer per request but a finer grain)
    opts = [Option(0, "m", Role.BOTH, "tp", 1.0, 3.0), Option(1, "m", Role.BOTH, "tp", 0.6, 2.0)]
    whole = solve(groups, [_demand(2.5)], opts, minimize_cost=True)
    frac = solve(groups, [_demand(2.5)], opts, minimize_cost=True, relaxed=True)
    assert whole is not None and frac is not None
    assert frac.usd_per_hour == pytest.approx(2.5 * 3.0)  # 2.5 servers of the cheaper per request
    # whole servers: 2 a + 1 b ($8) beats 3 a ($9); the relaxation is below either
    assert whole.counts == {0: 2, 1: 1} and whole.usd_per_hour == pytest.approx(8.0)
    assert frac.usd_per_hour < whole.usd_per_hour


def test_plan_and_cheapest_say_what_they_simulate() -> None:
    heard: list[str] = []
    groups = [ServerGroup(name="h200", accelerator="nvidia-h200", count=2, model="m", role=Role.BOTH)]
    plan(groups, [_demand(1.0)], check_duration_s=30, progress=heard.append)
    assert any("the current layout" in h for h in heard)
    assert all(h.startswith(("simulating", "local search")) for h in heard)
    heard.clear()
    best = cheapest([ServerGroup(name="h200", accelerator="nvidia-h200", count=4)], [_demand(1.0)],
                    check_duration_s=30, progress=heard.append)
    assert best is not None and best.meets
    assert any(h.startswith("measuring h200 m") for h in heard)  # the capacities, by simulation
    assert any(h.startswith("sizing for 1.00x the mean demand") for h in heard)
