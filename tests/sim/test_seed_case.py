"""Pins the seed case study: calibrated on the two single-server figures only, the simulator
predicts the load-balanced and disaggregated figures within 15% and their ratio within 0.1."""

from __future__ import annotations

import pytest
from casestudy import (
    PRIOR,
    SEED,
    SEED_RATIO,
    Workload,
    calibrate_seed,
    feasibility_point,
    reproduce,
)


@pytest.fixture(scope="module")
def result() -> dict:
    return reproduce(Workload())


def test_calibration_hits_the_two_single_server_figures(result: dict) -> None:
    assert result["predicted"]["mi300x"] == pytest.approx(SEED["mi300x"], rel=0.01)
    assert result["predicted"]["mi308x"] == pytest.approx(SEED["mi308x"], rel=0.01)
    # only compute efficiency is fitted; the cut-down MI308X reaches no more of its peak than MI300X
    eff = result["efficiency"]
    assert eff["amd-mi308x"]["compute"] <= eff["amd-mi300x"]["compute"]
    assert eff["amd-mi300x"]["memory"] == eff["amd-mi308x"]["memory"]


def test_predicts_the_cluster_figures_it_was_not_fitted_on(result: dict) -> None:
    p = result["predicted"]
    assert p["load_balanced"] == pytest.approx(SEED["load_balanced"], rel=0.15)
    assert p["disaggregated"] == pytest.approx(SEED["disaggregated"], rel=0.15)
    assert result["ratio"] == pytest.approx(SEED_RATIO, abs=0.1)


def test_the_gain_depends_on_the_workload() -> None:
    # long outputs make decode (MI308X's strength is only bandwidth) the bottleneck: no gain
    wl = Workload(output_len=1024)
    r = reproduce(wl, calibrate_seed(wl))
    assert r["ratio"] < 1.2


@pytest.mark.slow
def test_feasibility_map_says_which_assumptions_still_reproduce_the_seed() -> None:
    # benchmarks/seed_feasibility.py maps these; here one point of each kind, short runs
    kw = {"seeds": (1,), "requests_per_client": 12}
    shipped = feasibility_point(**kw)
    assert shipped["reproduces"]
    assert shipped["ratio"] == pytest.approx(reproduce(Workload())["ratio"], rel=1e-9)
    assert shipped["compute"] == pytest.approx({k: v.compute for k, v in calibrate_seed(Workload()).items()})
    assert shipped["cost_x_lb"] > 1.4 and shipped["static_x_lb"] > 1.4
    # a memory-efficient stack gives a split ratio far from the seed's
    far = feasibility_point(memory=0.85, **kw)
    assert far["reachable"] and not far["reproduces"] and far["ratio"] < SEED_RATIO - 0.1
    # a 40 ms step overhead leaves the MI300X figure out of reach of any compute efficiency
    out_of_reach = feasibility_point(overhead_s=0.04, **kw)
    assert out_of_reach == {"input_len": 4096, "output_len": 256, "clients_per_server": 4, "overhead_s": 0.04,
                            "memory": PRIOR["memory"], "reachable": False}
    # so does a workload whose prefill share is small: 1K-token prompts give the split almost nothing
    short = feasibility_point(Workload(input_len=1024), **kw)
    assert short["reachable"] and not short["reproduces"] and short["static_x_lb"] < 1.25
