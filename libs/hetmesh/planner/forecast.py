"""Demand forecasts for the next planning window from the windows seen so far (pure).

A planner that plans from the last window lags any trend by a window, so it forecasts: `last` (Dynamo's
constant predictor), `trend` (the line through the last two windows), `holt` (Holt's linear trend) and
`seasonal` (the window one period back). Every field of a model's demand is forecast the same way, then
clamped to what it can be (rates >= 0, lengths >= 1, prefix hits in [0, 1]). See docs/planner.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from hetmesh.planner.inputs import ModelDemand

METHODS = ("last", "trend", "holt", "seasonal")


def holt(series: Sequence[float], alpha: float = 0.8, beta: float = 0.5, steps: int = 1) -> float:
    """Holt's linear-trend forecast `steps` windows past the end of `series`.

    level_t = alpha * y_t + (1 - alpha) * (level_{t-1} + slope_{t-1})
    slope_t = beta * (level_t - level_{t-1}) + (1 - beta) * slope_{t-1}
    forecast = level_T + steps * slope_T, started from level_1 = y_1, slope_1 = y_2 - y_1.
    A series on a straight line is forecast exactly, whatever alpha and beta."""
    if not series:
        raise ValueError("no windows to forecast from")
    if not (0.0 < alpha <= 1.0 and 0.0 < beta <= 1.0):
        raise ValueError(f"holt needs 0 < alpha, beta <= 1 (got {alpha}, {beta})")
    if len(series) == 1:
        return float(series[0])
    level, slope = float(series[0]), float(series[1] - series[0])
    for y in series[1:]:
        prev = level
        level = alpha * y + (1 - alpha) * (level + slope)
        slope = beta * (level - prev) + (1 - beta) * slope
    return level + steps * slope


def forecast_value(series: Sequence[float], method: str = "holt", *, period: int = 0, alpha: float = 0.8,
                   beta: float = 0.5) -> float:
    """The next window's value of `series` (oldest first) by `method` (one of METHODS)."""
    if not series:
        raise ValueError("no windows to forecast from")
    if method == "last":
        return float(series[-1])
    if method == "trend":
        return float(2 * series[-1] - series[-2]) if len(series) > 1 else float(series[-1])
    if method == "holt":
        return holt(series, alpha, beta)
    if method == "seasonal":
        if period < 1:
            raise ValueError("the seasonal forecast needs period >= 1 (windows per cycle)")
        return float(series[-period]) if len(series) >= period else float(series[-1])
    raise ValueError(f"unknown forecast method {method!r}: use one of {', '.join(METHODS)}")


def forecast_demand(history: Sequence[Sequence[ModelDemand]], method: str = "holt", *, period: int = 0,
                    alpha: float = 0.8, beta: float = 0.5) -> list[ModelDemand]:
    """Each model's demand in the next window from its demand in the windows so far (oldest first;
    each window lists every model, in any order). A model missing from a window had no demand in it
    (rate 0, its other fields as last seen). SLOs, priority and spec are the latest window's."""
    if not history:
        raise ValueError("no windows to forecast from")
    out: list[ModelDemand] = []
    for latest in history[-1]:
        seen: list[ModelDemand] = []
        for w in history:
            d = next((x for x in w if x.name == latest.name), None)
            seen.append(d if d is not None else msgspec.structs.replace(seen[-1] if seen else latest, rate=0.0,
                                                                        peak_rate=0.0))

        def f(field: str, seen: list[ModelDemand] = seen) -> float:
            return forecast_value([getattr(d, field) for d in seen], method, period=period, alpha=alpha, beta=beta)

        rate = max(f("rate"), 0.0)
        out.append(msgspec.structs.replace(
            latest, rate=rate, peak_rate=max(f("peak_rate"), rate) if latest.peak_rate else 0.0,
            input_mean=max(f("input_mean"), 1.0), output_mean=max(f("output_mean"), 1.0),
            prefix_hit=min(max(f("prefix_hit"), 0.0), 1.0)))
    return out
