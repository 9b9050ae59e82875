"""Bad input on the bus, the pure parts: a stale heartbeat (delayed behind a newer one of the same run, from a
run since replaced, or from before the worker was counted lost) is dropped; a worker back from a partition
with its old run rejoins; other schedulers' bookings count only from schedulers heard beating, of workers in
the view."""

from __future__ import annotations

from hetmesh.placement import ClusterState
from hetmesh.protocol import Booked, Heartbeat, Role
from hetmesh.scheduler.bookings import Peers, sift


def hb(seq: int, running: int = 0, instance: str = "run1", wid: str = "w") -> Heartbeat:
    return Heartbeat(worker_id=wid, model="m", accelerator="nvidia-h100", vendor="nvidia", devices=1, role=Role.BOTH,
                     engine="sim", work_subject="s", queue_depth=0, running=running, max_batch=8, kv_blocks_total=64,
                     kv_blocks_used=0, block_size=16, ts=float(seq), instance=instance, seq=seq)


def running(s: ClusterState) -> int:
    v = s.view("w")
    assert v is not None
    return v.running


def test_a_heartbeat_older_than_one_folded_in_is_dropped() -> None:
    s = ClusterState(heartbeat_timeout_s=1.0)
    assert s.observe(hb(1), 0.0) == "joined"
    assert s.observe(hb(3, running=5), 0.1) == ""
    assert s.observe(hb(2, running=0), 0.2) == "stale"  # delayed on the bus
    assert s.observe(hb(3, running=0), 0.2) == "stale"  # the same one twice
    assert running(s) == 5
    assert s.observe(hb(4, running=1), 0.3) == "" and running(s) == 1


def test_unnumbered_heartbeats_fold_in_as_they_come() -> None:
    s = ClusterState(heartbeat_timeout_s=1.0)
    s.observe(hb(0, running=5, instance=""), 0.0)
    assert s.observe(hb(0, running=2, instance=""), 0.1) == "" and running(s) == 2


def test_a_late_heartbeat_of_a_replaced_run_does_not_fail_the_new_one_over() -> None:
    s = ClusterState(heartbeat_timeout_s=1.0)
    s.observe(hb(7, instance="old"), 0.0)
    assert s.observe(hb(1, running=2, instance="new"), 0.1) == "restarted"
    assert s.observe(hb(8, instance="old"), 0.2) == "stale"  # sent before the restart, heard after it
    assert s.observe(hb(2, running=2, instance="new"), 0.3) == "" and running(s) == 2


def test_a_worker_counted_lost_rejoins_with_its_run_but_not_on_a_late_heartbeat() -> None:
    s = ClusterState(heartbeat_timeout_s=1.0)
    s.observe(hb(5), 0.0)
    assert s.expire(2.0) == ["w"]
    assert s.observe(hb(4), 2.1) == "stale" and "w" not in s  # from before its silence: it stays lost
    assert s.observe(hb(9, running=1), 2.2) == "rejoined"  # the partition healed: same run, newer beat
    assert running(s) == 1
    assert s.expire(4.0) == ["w"]
    assert s.observe(hb(1, instance="run2"), 4.1) == "joined"  # a new run after a loss: a plain join


def test_bookings_count_from_schedulers_heard_beating_of_workers_in_view() -> None:
    peers = Peers(timeout_s=1.0)
    peers.heard("s2", 0.0)
    peers.heard("gone", -5.0)
    batch = [Booked(scheduler="me", request_id="echo", decode_worker="a"),
             Booked(scheduler="s2", request_id="r1", decode_worker="a"),
             Booked(scheduler="s2", request_id="r2", decode_worker="b", prefill_worker="a"),
             Booked(scheduler="s2", request_id="r3", decode_worker="ghost"),
             Booked(scheduler="stranger", request_id="r4", decode_worker="a"),
             Booked(scheduler="gone", request_id="r5", decode_worker="a"),
             Booked(scheduler="s2", request_id="r1", decode_worker="a", placed_at=0.25, withdrawn=True)]
    got = sift(batch, "me", lambda s: peers.alive(s, 0.5), {"a", "b"}.__contains__, now=1.0)
    assert [(d.mode, d.workers) for _, d in got.booked] == [("aggregated", ("a",)), ("disaggregated", ("a", "b"))]
    assert [d.workers for d in got.withdrawn] == [("a",)]  # taken back by s2: un-booked, not booked
    assert (got.unknown_scheduler, got.unknown_worker) == (2, 1)
    assert got.lags == [1.0, 1.0, 1.0, 0.75]  # s2's four, each from its placed_at (r3's worker unknown: heard all the same)
