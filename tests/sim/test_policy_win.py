"""Pins the cost policy's win in the simulator over every other policy and the seed's static split."""

from __future__ import annotations

import pytest

from hetmesh.sim.casestudy import compare


@pytest.fixture(scope="module", params=["case-study", "rubin"])
def rows(request: pytest.FixtureRequest) -> list[dict]:
    return compare(request.param)


def test_cost_beats_every_other_policy_on_throughput_and_goodput(rows: list[dict]) -> None:
    cost = next(r for r in rows if r["label"] == "cost")
    for r in rows:
        if r is cost:
            continue
        assert cost["output_tok_s_steady"] > r["output_tok_s_steady"], r["label"]
        assert cost["goodput_tok_s"] > r["goodput_tok_s"], r["label"]


def test_cost_mixes_aggregated_and_disaggregated_placements(rows: list[dict]) -> None:
    cost = next(r for r in rows if r["label"] == "cost")
    assert cost["modes"].get("aggregated", 0) > 0 and cost["modes"].get("disaggregated", 0) > 0
