"""Reading a service's metrics back (hetmesh.metrics.parse / total / histogram_quantile), as benchmarks and
tests read the live mesh's: on a registry's real exposition text."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from hetmesh.metrics import SchedulerMetrics, histogram_quantile, parse, total

pytestmark = pytest.mark.unit


def test_counters_sum_over_the_labels_asked_for() -> None:
    m = SchedulerMetrics(CollectorRegistry())
    m.placements.labels("cost", "aggregated").inc(3)
    m.placements.labels("cost", "disaggregated").inc(2)
    m.placements.labels("round_robin", "aggregated").inc(7)
    s = parse(generate_latest(m.registry).decode())
    assert total(s, "hetmesh_scheduler_placements_total") == 12
    assert total(s, "hetmesh_scheduler_placements_total", policy="cost") == 5
    assert total(s, "hetmesh_scheduler_placements_total", policy="cost", mode="aggregated") == 3
    assert total(s, "hetmesh_scheduler_placements_total", policy="none") == 0


def test_booking_lag_quantiles_over_two_schedulers() -> None:
    a, b = SchedulerMetrics(CollectorRegistry()), SchedulerMetrics(CollectorRegistry())
    for x in (0.00015, 0.00015, 0.00025, 0.0004):
        a.booking_lag.observe(x)
    for x in (0.0004, 0.0009, 0.004, 0.2):
        b.booking_lag.observe(x)
    both = [parse(generate_latest(m.registry).decode()) for m in (a, b)]
    name = "hetmesh_scheduler_booking_lag_seconds"
    # 8 observations, 3 up to 0.0003 and 5 up to 0.0005: the 4th, the median's rank, halfway through that bucket
    assert histogram_quantile(0.5, both, name) == pytest.approx(0.0004)
    assert 0.0001 < histogram_quantile(0.25, both, name) <= 0.0002
    assert histogram_quantile(1.0, both, name) == 0.1  # past the last finite bucket: its bound
    assert histogram_quantile(0.5, [parse(generate_latest(SchedulerMetrics(CollectorRegistry()).registry).decode())],
                              name) is None
