"""The demand forecaster on series whose next value is checkable by hand."""

from __future__ import annotations

import pytest

from hetmesh.planner import ModelDemand
from hetmesh.planner.forecast import forecast_demand, forecast_value, holt


def test_every_method_continues_a_straight_line_or_holds_it() -> None:
    ramp = [10.0, 14.0, 18.0, 22.0]
    assert forecast_value(ramp, "last") == 22.0
    assert forecast_value(ramp, "trend") == 26.0
    assert forecast_value(ramp, "holt") == pytest.approx(26.0)  # a line is forecast exactly, any alpha/beta
    assert holt(ramp, alpha=0.3, beta=0.2, steps=3) == pytest.approx(34.0)
    assert forecast_value([5.0], "trend") == 5.0 and forecast_value([5.0], "holt") == 5.0


def test_holt_smooths_a_step_by_hand() -> None:
    # level 0, slope 0 over [0, 0]; then y = 10: level = 0.5*10 = 5, slope = 0.5*(5 - 0) = 2.5 -> 7.5
    assert holt([0.0, 0.0, 10.0], alpha=0.5, beta=0.5) == pytest.approx(7.5)
    # alpha = beta = 1 is the last-two-windows line
    assert holt([3.0, 1.0, 10.0], alpha=1.0, beta=1.0) == pytest.approx(19.0)


def test_seasonal_naive_repeats_the_window_one_period_back() -> None:
    day_night = [100.0, 20.0, 100.0, 20.0]
    assert forecast_value(day_night, "seasonal", period=2) == 100.0
    assert forecast_value(day_night[:1], "seasonal", period=2) == 100.0  # less than a period: the last
    with pytest.raises(ValueError, match="period"):
        forecast_value(day_night, "seasonal")
    with pytest.raises(ValueError, match="unknown forecast method"):
        forecast_value(day_night, "arima")


def _d(name: str, rate: float, inp: float = 1000.0, **kw: float) -> ModelDemand:
    return ModelDemand(name=name, spec="llama-3.1-70b", rate=rate, input_mean=inp, output_mean=200.0, **kw)


def test_forecast_demand_extrapolates_each_model_and_clamps() -> None:
    history = [[_d("A", 30.0, 1000.0), _d("B", 5.0)],
               [_d("A", 20.0, 1500.0), _d("B", 15.0)],
               [_d("A", 10.0, 2000.0, prefix_hit=0.6), _d("B", 25.0)]]
    got = {d.name: d for d in forecast_demand(history, "trend")}
    assert got["A"].rate == 0.0  # 10 - 10 clamps at no demand, never below
    assert got["A"].input_mean == 2500.0 and got["A"].prefix_hit == pytest.approx(1.0)  # 0.6 + 0.6 clamps
    assert got["B"].rate == 35.0 and got["B"].output_mean == 200.0
    assert {d.name: d.rate for d in forecast_demand(history, "last")} == {"A": 10.0, "B": 25.0}


def test_a_model_missing_from_a_window_had_no_demand_in_it() -> None:
    history = [[_d("A", 10.0)], [_d("A", 10.0), _d("B", 8.0)]]
    (b,) = [d for d in forecast_demand(history, "trend") if d.name == "B"]
    assert b.rate == 16.0  # 0 then 8: the line goes on to 16
    with pytest.raises(ValueError, match="no windows"):
        forecast_demand([])
