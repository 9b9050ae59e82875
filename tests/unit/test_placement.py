import msgspec

from hetmesh.placement import ClusterState, LeastLoaded, PrefixAware, RequestInfo, RoundRobin, make_policy
from hetmesh.protocol import Heartbeat, Role


def hb(wid: str, role: Role = Role.BOTH, queue: int = 0, running: int = 0, model: str = "m",
       max_batch: int = 8) -> Heartbeat:
    return Heartbeat(worker_id=wid, model=model, accelerator="nvidia-h100", vendor="nvidia", devices=1, role=role,
                     engine="sim", work_subject=f"w.{wid}", queue_depth=queue, running=running, max_batch=max_batch,
                     kv_blocks_total=100, kv_blocks_used=0, block_size=16, ts=0.0)


def req(cached: dict[str, int] | None = None, model: str = "m", exclude: frozenset[str] = frozenset()) -> RequestInfo:
    return RequestInfo(request_id="r", model=model, prompt_len=100, max_tokens=10, cached_blocks=cached or {},
                       exclude=exclude)


def cluster(*beats: Heartbeat) -> ClusterState:
    s = ClusterState(heartbeat_timeout_s=1.0)
    for b in beats:
        s.observe(b, now=0.0)
    return s


def test_round_robin_cycles() -> None:
    s = cluster(hb("a"), hb("b"), hb("c"))
    p = RoundRobin()
    assert [p.place(req(), s.views()).decode_worker for _ in range(6)] == ["a", "b", "c"] * 2  # type: ignore[union-attr]


def test_least_loaded_counts_assignments_since_heartbeat() -> None:
    s = cluster(hb("a", running=1), hb("b", running=2))
    p = LeastLoaded()
    first = p.place(req(), s.views())
    assert first is not None and first.decode_worker == "a"
    s.assigned(first)
    s.assigned(first)  # a now has 3 (1 running + 2 assigned) > b's 2
    second = p.place(req(), s.views())
    assert second is not None and second.decode_worker == "b"


def test_prefix_aware_prefers_cache_then_load() -> None:
    s = cluster(hb("a", running=5), hb("b"), hb("c", running=1))
    p = PrefixAware()
    d = p.place(req({"a": 3, "c": 1}), s.views())
    assert d is not None and d.decode_worker == "a" and d.expected_cached_tokens == 48
    d = p.place(req({}), s.views())
    assert d is not None and d.decode_worker == "b"


def test_disaggregated_when_only_split_pools() -> None:
    s = cluster(hb("p", role=Role.PREFILL), hb("d1", role=Role.DECODE, running=3), hb("d2", role=Role.DECODE))
    d = LeastLoaded().place(req(), s.views())
    assert d is not None and d.mode == "disaggregated" and d.prefill_worker == "p" and d.decode_worker == "d2"
    assert d.workers == ("p", "d2")


def test_exclusion_model_filter_and_none() -> None:
    s = cluster(hb("a"), hb("b", model="other"))
    assert PrefixAware().place(req(exclude=frozenset({"a"})), s.views()) is None
    assert RoundRobin().place(req(model="nope"), s.views()) is None


def test_expire_drops_silent_workers() -> None:
    s = ClusterState(heartbeat_timeout_s=1.0)
    s.observe(hb("a"), now=0.0)
    s.observe(hb("b"), now=0.8)
    assert s.expire(now=1.5) == ["a"]
    assert [v.worker_id for v in s.views()] == ["b"]


def test_a_heartbeat_from_another_run_of_a_known_worker_is_a_restart() -> None:
    s = ClusterState(heartbeat_timeout_s=1.0)
    first = msgspec.structs.replace(hb("a"), instance="run-1")
    assert s.observe(first, now=0.0) == "joined"
    assert s.observe(first, now=0.5) == ""
    assert s.observe(msgspec.structs.replace(first, instance="run-2"), now=0.9) == "restarted"
    assert s.observe(msgspec.structs.replace(first, instance="run-2"), now=1.2) == ""
    # a worker that names no run (an older build) is never taken for restarted
    assert s.observe(hb("b"), now=0.0) == "joined"
    assert s.observe(msgspec.structs.replace(hb("b"), instance="run-1"), now=0.1) == ""
    assert s.expire(now=2.0) == ["b"]  # its silence still expires it


def test_a_busy_worker_whose_counters_stand_still_is_wedged_until_it_moves() -> None:
    s = ClusterState(heartbeat_timeout_s=1.0, wedge_timeout_s=10.0)
    r = msgspec.structs.replace
    busy = r(hb("a", running=2), tokens_generated=5)
    s.observe(busy, now=0.0)
    s.observe(r(hb("idle"), tokens_generated=5), now=0.0)
    for t in (4.0, 9.0):  # heartbeats on, two running, not a token more
        s.observe(busy, now=t)
        s.observe(r(hb("idle"), tokens_generated=5), now=t)  # nothing running: still is fine
    assert s.wedged(now=9.5) == []
    s.observe(r(busy, tokens_generated=6), now=10.0)  # one token: the clock starts again
    s.observe(r(busy, tokens_generated=6), now=19.0)
    assert s.wedged(now=20.0) == []
    assert s.wedged(now=20.5) == ["a"]
    assert s.wedged(now=30.0) == []  # reported once
    assert s.is_wedged("a") and [v.worker_id for v in s.views()] == ["idle"]
    assert {v.worker_id for v in s.every_view()} == {"a", "idle"}
    s.observe(r(busy, tokens_generated=6), now=31.0)  # still stuck: stays out
    assert [v.worker_id for v in s.views()] == ["idle"]
    s.observe(r(busy, prompt_tokens_computed=100, tokens_generated=6), now=32.0)  # a prefill chunk: it moves
    assert not s.is_wedged("a") and {v.worker_id for v in s.views()} == {"a", "idle"}
    off = ClusterState(heartbeat_timeout_s=1.0)  # wedge_timeout_s 0: off
    off.observe(busy, now=0.0)
    off.observe(busy, now=100.0)
    assert off.wedged(now=200.0) == []


def test_a_restart_or_a_bus_outage_resets_the_wedge_clock() -> None:
    s = ClusterState(heartbeat_timeout_s=1.0, wedge_timeout_s=10.0)
    busy = msgspec.structs.replace(hb("a", running=1), instance="run-1")
    s.observe(busy, now=0.0)
    s.observe(busy, now=11.0)
    assert s.wedged(now=11.0) == ["a"]
    assert s.observe(msgspec.structs.replace(busy, instance="run-2"), now=12.0) == "restarted"
    assert not s.is_wedged("a")
    s.touch_all(25.0)  # the scheduler's own outage: the heartbeats it missed may have shown progress
    s.observe(msgspec.structs.replace(busy, instance="run-2"), now=24.0)
    assert s.wedged(now=34.0) == []


def test_unknown_policy_is_a_clear_error() -> None:
    try:
        make_policy("fastest")
    except ValueError as e:
        assert "round_robin" in str(e)
    else:
        raise AssertionError("expected ValueError")


def test_finished_requests_stop_counting_before_the_next_heartbeat() -> None:
    s = cluster(hb("a", running=2), hb("b", running=1))
    p = LeastLoaded()
    s.finished("a", ts=-1.0)  # ended before the heartbeat was taken: already in its counts
    assert {v.worker_id: v for v in s.views()}["a"].running == 2
    s.finished("a", ts=1.0)
    s.finished("a", ts=1.0)  # both of a's requests ended: a is idle now, b still runs one
    d = p.place(req(), s.views())
    assert d is not None and d.decode_worker == "a"
    s.assigned(d)
    s.finished("a", ts=2.0)  # ... and the one just placed there ended too (more finished than running)
    view = {v.worker_id: v for v in s.views()}["a"]
    assert view.running == 0 and view.queue_depth == 0
    s.observe(hb("a", running=5), now=0.1)  # a new heartbeat is the truth again
    assert {v.worker_id: v for v in s.views()}["a"].running == 5
