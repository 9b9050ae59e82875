"""IdleWatch: which in-flight entries the workers' heartbeats say are over."""

from __future__ import annotations

from hetmesh.scheduler.reconcile import IdleWatch


def test_only_a_worker_heard_idle_for_the_grace_after_the_request_was_sent_drops_it() -> None:
    w = IdleWatch(grace_s=2.0)
    sent = {"early": 0.0, "late": 5.0}
    by_worker = {"a": {"early", "late"}, "b": {"early"}}
    for t in (1.0, 2.0, 3.5):  # a idle from 1.0 on; b busy
        w.observe("a", 0, t)
        w.observe("b", 3, t)
    assert w.stale(by_worker, sent.get) == [("early", "a")]  # idle 1.0 -> 3.5 after "early" was sent
    for t in (4.0, 6.0):
        w.observe("a", 0, t)
    assert w.stale(by_worker, sent.get) == [("early", "a")]  # "late" was sent at 5.0: not yet
    w.observe("a", 0, 7.0)
    assert sorted(w.stale(by_worker, sent.get)) == [("early", "a"), ("late", "a")]
    w.observe("a", 1, 7.5)  # busy again: its idle span is over
    assert w.stale(by_worker, sent.get) == []


def test_a_bus_outage_restarts_the_count() -> None:
    w = IdleWatch(grace_s=2.0)
    w.observe("a", 0, 0.0)
    w.reset()  # heartbeats not heard during the outage say nothing
    w.observe("a", 0, 10.0)
    assert w.stale({"a": {"r"}}, {"r": 0.0}.get) == []
    w.observe("a", 0, 12.0)
    assert w.stale({"a": {"r"}}, {"r": 0.0}.get) == [("r", "a")]
    assert w.stale({"a": {"gone"}}, {"r": 0.0}.get) == []  # no longer in flight: nothing to drop
