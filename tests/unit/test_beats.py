"""hetmesh.beats: who is alive from their beats (the gateways', the workers' and the schedulers' one view)."""

from hetmesh.beats import Beats


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
    assert b.forget_silent(100.0, 50.0) == ["s1", "s2"] and b.silent(100.0) == set()
    b.heard("s3", 0.0)
    b.forget("s3")
    assert not b.alive("s3", 0.0)
