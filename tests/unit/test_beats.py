"""hetmesh.beats: who is alive from their beats (the gateways', the workers' and the schedulers' one view); a
listener's own stall is no one's silence; a retry avoids its lost worker while another serves the model."""

from hetmesh import subjects
from hetmesh.beats import Beats, overslept
from hetmesh.placement import ClusterState, exclusion
from hetmesh.protocol import Heartbeat, Role


def _beat(i: int, ts: float) -> Heartbeat:
    wid = f"w{i}"
    return Heartbeat(worker_id=wid, model="m", accelerator="nvidia-h100", vendor="nvidia", devices=1,
                     role=Role.BOTH, engine="sim", work_subject=subjects.work_direct("both", "nvidia", "h100", wid),
                     queue_depth=0, running=0, max_batch=8, kv_blocks_total=100, kv_blocks_used=0, block_size=16,
                     ts=ts)


def test_an_instance_is_alive_while_heard_within_the_timeout() -> None:
    b = Beats(timeout_s=1.0)
    assert not b.alive("s1", 0.0) and b.live(0.0) == [] and b.silent(0.0) == set()  # never heard: not silent
    b.heard("s1", 0.0)
    b.heard("s2", 0.5)
    assert b.alive("s1", 1.0) and b.live(1.0) == ["s1", "s2"]
    assert not b.alive("s1", 1.2) and b.live(1.2) == ["s2"] and b.silent(1.2) == {"s1"}
    b.heard("s1", 1.3)  # back
    assert b.live(1.3) == ["s1", "s2"]


def test_a_bus_gap_restarts_every_clock_and_old_silence_is_forgotten() -> None:
    b = Beats(timeout_s=1.0)
    b.heard("s1", 0.0)
    b.bus_gap(5.0)  # the listener was away: the beats it missed prove nothing
    assert b.alive("s1", 5.5) and not b.alive("s1", 6.5)
    b.heard("s2", 6.0)
    assert b.forget_silent(100.0, 50.0) == ["s1", "s2"] and b.silent(100.0) == set() and len(b) == 0
    b.heard("s3", 0.0)
    b.heard("s4", 0.0)
    assert len(b) == 2
    b.forget("s3")
    assert not b.alive("s3", 0.0) and len(b) == 1


def test_a_listener_that_did_not_run_counts_none_of_that_time_as_silence() -> None:
    assert overslept(0.0, 0.1, 0.15) == 0.0 and overslept(0.0, 0.1, 0.2) == 0.0  # late within a period: on time
    assert overslept(0.0, 0.1, 3.1) == 3.0  # away 3 s past its period
    b = Beats(timeout_s=1.0)
    b.heard("s1", 0.0)
    b.heard("s2", 2.9)  # read during the stall's last moments
    b.paused(3.0, now=3.1)
    assert b.alive("s1", 3.1) and not b.alive("s1", 4.1)  # its silence: 0.1 s before the stall, then from 3.1
    assert b.alive("s2", 3.9)  # never moved past now
    b.paused(3.0, now=3.1)
    assert not b.alive("s2", 4.2)


def test_the_schedulers_view_of_workers_leaves_out_its_own_stall() -> None:
    state = ClusterState(heartbeat_timeout_s=1.0, wedge_timeout_s=0.0)
    state.observe(_beat(0, 0.0), 0.0)
    state.paused(3.0, 3.1)
    assert state.expire(3.1) == [] and state.expire(4.0) == [] and state.expire(4.2) == ["w0"]


def test_a_retry_avoids_its_lost_worker_unless_no_other_worker_serves_the_model() -> None:
    state = ClusterState(heartbeat_timeout_s=1.0)
    for i in range(2):
        state.observe(_beat(i, 0.0), 0.0)
    views = state.views()
    assert exclusion("m", views, ["w0"], ()) == {"w0"}
    assert exclusion("m", views, ["w0", "w1"], ()) == frozenset()  # both avoided: the retry goes to one back
    assert exclusion("m", views, ["w0"], {"w1"}) == {"w1"}  # the other drains: the avoided one serves
    assert exclusion("other", views, ["w0"], ()) == frozenset()
