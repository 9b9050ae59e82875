"""Flow control's fair queue (hetmesh.placement.flow): strict bands, weighted shares, EDF, work conservation."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetmesh import wiring
from hetmesh.config import ClusterConfig
from hetmesh.placement import REFUSED, RequestInfo, WorkerView, make_policy
from hetmesh.placement.flow import (
    LOOKAHEAD,
    FlowQueue,
    Held,
    Tenant,
    Turns,
    hold_deadline,
    reserved,
    token_cost,
)
from hetmesh.protocol import Role


def _drain(q: FlowQueue, n: int, now: float = 0.0) -> list[str]:
    """Place the head `n` times, as the shell does while the fleet has room."""
    out = []
    for _ in range(n):
        h = q.head()
        if h is None:
            break
        q.take(h, now)
        q.placed(h.tenant, h.cost)
        out.append(h.tenant)
    return out


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.sampled_from([1.0, 2.0, 3.0, 4.0, 0.5]), min_size=2, max_size=5),
       cost=st.floats(1.0, 100.0))
def test_backlogged_tenants_get_shares_by_weight(weights: list[float], cost: float) -> None:
    q = FlowQueue([Tenant(f"t{i}", w) for i, w in enumerate(weights)], max_held=10_000)
    for i in range(len(weights)):
        for k in range(400):
            q.hold(f"t{i}-{k}", f"t{i}", cost, deadline=1e9, now=0.0)
    n = 300
    served = _drain(q, n)
    total_w = sum(weights)
    for i, w in enumerate(weights):
        # the least in flight per weight first: within one request of the weighted share
        assert abs(served.count(f"t{i}") - n * w / total_w) <= len(weights) + 1


@settings(max_examples=40, deadline=None)
@given(bands=st.lists(st.integers(0, 3), min_size=1, max_size=6), per=st.integers(1, 5))
def test_bands_are_strict_and_every_held_request_comes_out(bands: list[int], per: int) -> None:
    q = FlowQueue([Tenant(f"t{i}", 1.0 + i, b) for i, b in enumerate(bands)])
    for i in range(len(bands)):
        for k in range(per):
            q.hold(f"{i}-{k}", f"t{i}", 10.0 + k, deadline=float(k), now=0.0)
    order = list(q.order())
    assert len(order) == len(bands) * per  # work-conserving: nothing is left behind
    seen = [q.tenants[h.tenant].tenant.band for h in order]
    assert seen == sorted(seen)
    for i in range(len(bands)):  # EDF within a tenant
        mine = [h.deadline for h in order if h.tenant == f"t{i}"]
        assert mine == sorted(mine)


def test_room_goes_to_the_tenant_holding_least_per_weight_and_nothing_is_banked() -> None:
    q = FlowQueue([Tenant("a"), Tenant("b")])
    for _ in range(50):  # a alone for a while (b idle), its work done: no history is kept
        q.placed("a", 10.0)
        q.finished("a", 10.0, 0.0)
    for k in range(8):
        q.hold(f"a{k}", "a", 10.0, 1e9, 0.0)
        q.hold(f"b{k}", "b", 10.0, 1e9, 0.0)
    assert _drain(q, 6).count("b") == 3  # level: they alternate
    q.placed("a", 30.0)  # a holds 30 more in flight (placed on arrival, say): b gets the room until level
    assert _drain(q, 3) == ["b", "b", "b"]


def test_a_new_arrival_waits_while_a_higher_band_or_a_tenant_served_before_it_holds_requests() -> None:
    q = FlowQueue([Tenant("hi", band=0), Tenant("lo", band=1), Tenant("x"), Tenant("y")])
    assert q.may_try("lo") and q.may_try("x")  # nothing held: straight to the policy (work-conserving)
    q.hold("l", "lo", 1.0, 1e9, 0.0)
    assert q.may_try("hi") and q.may_try("x")  # a lower band holds: a higher one goes
    assert q.may_try("lo")  # its own held request is all its band holds: it may fit where that one did not
    q.hold("h", "hi", 1.0, 1e9, 0.0)
    assert not q.may_try("lo")  # a higher band holds
    # hi is the band's next tenant: its newcomer may take the room its held request was refused
    assert q.may_try("hi")
    q.placed("hi", 5.0)
    q.placed("x", 10.0)
    # y (nothing in flight) comes before hi (5), hi before x (10): y goes now, x waits behind hi's held request
    assert q.may_try("y") and not q.may_try("x")
    q.placed("x", 90.0)
    q.hold("x1", "x", 1.0, 1e9, 0.0)
    q.hold("y1", "y", 1.0, 1e9, 0.0)
    # the queue's order: band 0 by what each holds in flight (y nothing, hi 5, x 100), then band 1
    order = []
    while (h := q.head()) is not None:
        q.take(h, 0.0)
        order.append(h.key)
    assert order == ["y1", "h", "x1", "l"]


def test_head_is_the_first_of_order() -> None:
    q = FlowQueue([Tenant("a", 1.0), Tenant("b", 3.0), Tenant("c", 1.0, band=1)])
    for k in range(6):
        q.hold(f"a{k}", "a", 2.0, deadline=10.0 - k, now=0.0)
        q.hold(f"b{k}", "b", 5.0, deadline=float(k), now=0.0)
        q.hold(f"c{k}", "c", 1.0, deadline=float(k), now=0.0)
    while len(q):
        h = q.head()
        assert h is next(q.order())
        q.take(h, 0.0)
        q.placed(h.tenant, h.cost)


def test_a_lower_band_keeps_headroom_while_a_higher_one_is_busy() -> None:
    q = FlowQueue([Tenant("hi", band=0), Tenant("lo", band=1)], reserve=0.5)
    assert q.headroom("lo", 0.0) == 0.0  # the higher band is idle: nothing to keep room for
    q.placed("hi", 1.0)
    assert q.headroom("lo", 0.0) == 0.5 and q.headroom("hi", 0.0) == 0.0
    q.finished("hi", 1.0, now=1.0)
    assert q.headroom("lo", 1.0) == 0.0
    info = RequestInfo(request_id="r", model="m", prompt_len=10, max_tokens=5, waited_s=0.25)
    # both SLOs: the TTFT a prefill backlog leaves and the TPOT a decode batch leaves
    assert reserved(info, 0.5).slo_share == 0.5 and reserved(info, 0.5).waited_s == 0.25
    assert reserved(info, 0.0) is info
    with pytest.raises(ValueError, match="reserve"):
        FlowQueue([Tenant("a")], reserve=1.0)


def test_a_waiting_tenant_keeps_headroom_for_one_that_sends_less_than_it_is_placed() -> None:
    q = FlowQueue([Tenant("noisy"), Tenant("quiet"), Tenant("idle")], reserve=0.5)
    for t in range(10):
        q.arrived("noisy", 50.0, now=float(t))
        q.arrived("quiet", 1.0, now=float(t))
        q.placed("noisy", 5.0, now=float(t))
        q.placed("quiet", 1.0, now=float(t))
    q.hold("n", "noisy", 5.0, deadline=20.0, now=10.0)
    assert q.headroom("noisy", 10.0) == 0.5  # quiet is active, waits for nothing and sends less than noisy gets
    assert q.headroom("quiet", 10.0) == 0.0  # nothing of its own waits
    q.hold("q", "quiet", 1.0, deadline=20.0, now=10.0)
    assert q.headroom("noisy", 10.0) == 0.0  # quiet waits in the queue too: the queue's order serves it
    q.finished("quiet", 10.0, now=10.0)
    q.take(next(h for h in q.order() if h.tenant == "quiet"), 10.0)
    assert q.headroom("noisy", 10.0) == 0.0  # quiet has nothing in flight: no arrivals to keep room for


def test_equal_backlogged_tenants_keep_no_headroom_for_each_other() -> None:
    q = FlowQueue([Tenant("a"), Tenant("b")], reserve=0.5)
    for t in range(10):  # each sends three times what it is placed
        for n in "ab":
            q.arrived(n, 3.0, now=float(t))
            q.placed(n, 1.0, now=float(t))
    q.hold("a1", "a", 1.0, deadline=20.0, now=10.0)
    assert q.headroom("a", 10.0) == 0.0  # b wants more than a gets: it is not owed room


def test_a_refusal_ends_its_tenants_turn_and_lower_bands_not_its_band() -> None:
    q = FlowQueue([Tenant("a"), Tenant("b"), Tenant("c", band=1)])
    for n in "abc":
        for k in range(2):
            q.hold(f"{n}{k}", n, 1.0, deadline=10.0 + k, now=0.0)
    turns, seen = Turns(q), []
    while (h := turns.next()) is not None:
        seen.append(h.key)
        if h.tenant == "a":
            turns.refused(h, 0.0)  # a's requests do not fit: they stay held, a's turn is over
        else:
            q.take(h, 0.0)
            q.placed(h.tenant, h.cost)
    assert seen == ["a0", "a1", "b0", "b1"]  # b's fit behind a's refusals; band 1 waits for band 0
    assert [h.key for h in q.order()] == ["a0", "a1", "c0", "c1"]
    q = FlowQueue([Tenant("a"), Tenant("b"), Tenant("c", band=1)], reserve=0.5)
    assert q.headroom("b", 0.0, refused={"a"}) == 0.0  # b has nothing else waiting: it takes what it fits
    assert q.headroom("c", 0.0, refused={"a"}) == 0.0  # another band's refusal is not c's to make room for
    q.hold("a1", "a", 1.0, deadline=10.0, now=0.0)
    q.hold("b1", "b", 1.0, deadline=10.0, now=0.0)
    q.placed("b", 3.0, now=0.0)
    assert q.headroom("b", 0.0, refused={"a"}) == 0.5  # b, backlogged too and ahead of a, leaves a room
    assert q.headroom("b", 0.0, refused={"b"}) == 0.0


def test_a_tenant_within_one_request_of_a_refused_one_keeps_no_room_for_it() -> None:
    q = FlowQueue([Tenant("a"), Tenant("b", 2.0)], reserve=0.5)
    q.hold("a0", "a", 2.0, deadline=10.0, now=0.0)  # a's head: the fleet refused it this pump
    for k in range(2):
        q.hold(f"b{k}", "b", 1.0, deadline=10.0, now=0.0)
    q.placed("a", 1.0, now=0.0)
    q.placed("b", 6.0, now=0.0)  # per weight, b leads a by 2.0: a's head's cost per weight
    assert q.headroom("b", 0.0, refused={"a"}) == 0.0  # the fleet's room is used: within fair queuing's bound
    q.placed("b", 0.5, now=0.0)
    assert q.headroom("b", 0.0, refused={"a"}) == 0.5  # past it: b keeps a's room


def _pump(q: FlowQueue, fits: Callable[[Held], bool], now: float = 0.0) -> list[tuple[str, bool]]:
    """A pump as the shells run it: each request taken out and placed, or held again if it does not fit."""
    turns, seen = Turns(q), []
    while (h := turns.next()) is not None:
        q.take(h, now)
        if fits(h):
            q.placed(h.tenant, h.cost, now=now)
        else:
            q.hold(h.key, h.tenant, h.cost, h.deadline, now, again=True)
            turns.refused(h, now)
        seen.append((h.key, fits(h)))
    return seen


def test_a_refused_head_lets_its_tenants_next_requests_that_fit_go() -> None:
    q = FlowQueue([Tenant("a"), Tenant("b")])
    q.hold("a0", "a", 4.0, deadline=1.0, now=0.0)  # too big for the room there is
    for k in (1, 2):
        q.hold(f"a{k}", "a", 1.0, deadline=1.0 + k, now=0.0)
    q.hold("b0", "b", 1.0, deadline=1.0, now=0.0)
    seen = _pump(q, lambda h: h.cost <= 1.0)
    assert [k for k, ok in seen if ok] == ["a1", "b0", "a2"]  # a's turn goes on past a0, in fair order with b
    assert [h.key for h in q.order()] == ["a0"]  # a0 keeps its place at a's head
    assert next(iter(q.order())).passed == 2.0
    assert q.tenants["a"].inflight == 2.0  # a is charged for what it placed: the shares hold


def test_a_head_is_passed_over_for_at_most_its_own_cost() -> None:
    q = FlowQueue([Tenant("a")])
    q.hold("a0", "a", 2.0, deadline=1.0, now=0.0)
    for k in range(1, 6):
        q.hold(f"a{k}", "a", 1.0, deadline=1.0 + k, now=0.0)
    small = lambda h: h.cost <= 1.0  # noqa: E731
    assert _pump(q, small) == [("a0", False), ("a1", True), ("a2", True)]  # passed over for 2.0: no more
    assert _pump(q, small) == []  # nothing freed since: no placement is tried
    q.recheck()
    assert _pump(q, small) == [("a0", False)]  # its tenant's room is kept for it
    q.recheck()
    assert _pump(q, lambda h: True)[0] == ("a0", True)


def test_lookahead_is_bounded_per_pump() -> None:
    q = FlowQueue([Tenant("a")])
    for k in range(LOOKAHEAD + 6):
        q.hold(f"a{k}", "a", 1.0, deadline=float(k), now=0.0)
    assert len(_pump(q, lambda h: False)) == 1 + LOOKAHEAD
    q = FlowQueue([Tenant("a")], lookahead=0)
    for k in range(LOOKAHEAD + 6):
        q.hold(f"a{k}", "a", 1.0, deadline=float(k), now=0.0)
    turns = Turns(q)
    h = turns.next()
    assert h is not None
    turns.refused(h, 0.0)
    assert turns.next() is None


def test_over_share_and_retry_after() -> None:
    q = FlowQueue([Tenant("noisy"), Tenant("quiet")], retry_floor_s=0.5)
    q.placed("noisy", 90.0)
    q.placed("quiet", 10.0)
    assert q.over_share("noisy") and not q.over_share("quiet")
    q.finished("noisy", 20.0, now=1.0)  # it drains ~2 units/s over the rate window
    ra = q.retry_after_s("noisy", now=1.0)
    assert 0.5 <= ra <= 60.0
    assert q.retry_after_s("quiet", now=1.0) == 0.5


def test_expired_and_full_queue_refuse() -> None:
    q = FlowQueue([Tenant("a")], max_held=2)
    assert q.hold("1", "a", 1.0, deadline=1.0, now=0.0) is not None
    assert q.hold("2", "a", 1.0, deadline=5.0, now=0.0) is not None
    assert q.hold("3", "a", 1.0, deadline=5.0, now=0.0) is None
    assert [h.key for h in q.expired(2.0)] == ["1"]
    assert len(q) == 1 and q.stats("a").held_s == 2.0


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan")])
def test_a_weight_of_zero_or_below_is_an_error(weight: float) -> None:
    with pytest.raises(ValueError, match="weight"):
        Tenant("t", weight)


def test_token_cost() -> None:
    assert token_cost(100, 20) == 120.0 and token_cost(-5, 0) == 1.0


def test_the_cost_policy_keeps_a_reserved_request_within_its_share_of_the_tpot_slo() -> None:
    """A full batch with a queue behind it: a decode there is predicted well within its TTFT SLO and within its
    TPOT SLO (0.1 s) but not within half of it, so a request that must leave half its SLOs free (`reserved`) is
    refused (the policy may hold it) where one that need not is placed."""
    view = WorkerView(worker_id="w", model="llama-3.1-8b", accelerator="nvidia-h100", vendor="nvidia", devices=1,
                      role=Role.BOTH, queue_depth=8, running=64, max_batch=64, kv_blocks_total=0, kv_blocks_used=0,
                      block_size=16)
    info = RequestInfo(request_id="r", model="llama-3.1-8b", prompt_len=500, max_tokens=100)
    modes = []
    for share in (0.0, 0.5):
        d = make_policy("cost", ttft_slo_s=2.0, tpot_slo_s=0.1).place(reserved(info, share), [view])
        assert d is not None and d.predicted_ttft_s is not None and d.predicted_tpot_s is not None
        assert d.predicted_ttft_s < 0.5 and 0.05 < d.predicted_tpot_s < 0.1
        modes.append(d.mode)
    assert modes == ["aggregated", REFUSED]


def test_a_held_request_may_wait_until_the_latest_start_that_meets_its_ttft_slo() -> None:
    short = hold_deadline(10.0, ttft_slo_s=2.0, prefill_s=0.1, limit_s=30.0)
    long = hold_deadline(10.0, ttft_slo_s=2.0, prefill_s=1.5, limit_s=30.0)
    assert short == pytest.approx(11.9) and long == pytest.approx(10.5)  # its own prefill must still fit after it
    assert hold_deadline(10.0, ttft_slo_s=2.0, prefill_s=0.1, limit_s=1.0) == 11.0  # the client's patience first
    # a tenant that must leave others half its SLOs cannot be placed past half of it: no use holding it longer
    assert hold_deadline(10.0, ttft_slo_s=2.0, prefill_s=0.1, limit_s=30.0, headroom=0.5) == pytest.approx(10.9)
    q = FlowQueue([Tenant("a")])
    q.hold("long", "a", 1.5, long, now=10.0)
    q.hold("short", "a", 0.1, short, now=10.0)
    assert [h.key for h in q.order()] == ["long", "short"]  # EDF: the one with less room to wait goes first


def test_a_request_held_again_keeps_its_deadline() -> None:
    q = FlowQueue([Tenant("a")])
    h = q.hold("a0", "a", 1.0, deadline=5.0, now=0.0)
    q.hold("a1", "a", 1.0, deadline=6.0, now=0.0)
    q.take(h, 1.0)  # taken out to be placed, and still refused: the shell works out a deadline again
    q.hold("a0", "a", 1.0, deadline=9.0, now=1.0, again=True)
    assert [(x.key, x.deadline) for x in q.order()] == [("a0", 5.0), ("a1", 6.0)]


def test_the_lookahead_is_checked_and_reaches_each_pump() -> None:
    with pytest.raises(ValueError, match="lookahead"):
        FlowQueue([Tenant("a")], lookahead=-1)
    with pytest.raises(ValueError, match="lookahead"):
        msgspec.convert({"flow": {"lookahead": -1}, "tenants": [{"name": "a"}]}, ClusterConfig).validate()
    q = FlowQueue([Tenant("a")], lookahead=2)
    for k in range(6):
        q.hold(f"a{k}", "a", 1.0, deadline=float(k), now=0.0)
    assert len(_pump(q, lambda h: False)) == 3  # the head and the next two


def test_the_headroom_is_a_share_of_the_slos_checked_by_name() -> None:
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"flow\.headroom"):
            msgspec.convert({"flow": {"headroom": bad}, "tenants": [{"name": "a"}]}, ClusterConfig).validate()
    cfg = msgspec.convert({"flow": {"headroom": 0.25}, "tenants": [{"name": "a"}]}, ClusterConfig)
    cfg.validate()
    q = wiring.flow(cfg)
    assert q is not None and q.reserve == 0.25


def test_a_refusal_stands_until_room_may_have_freed() -> None:
    q = FlowQueue([Tenant("a"), Tenant("b")])
    for k in range(2):
        q.hold(f"a{k}", "a", 1.0, deadline=1.0 + k, now=0.0)
    assert _pump(q, lambda h: False) == [("a0", False), ("a1", False)]
    q.hold("a2", "a", 1.0, deadline=5.0, now=0.1)  # a new arrival, held: only it is new to this pump
    q.hold("b0", "b", 1.0, deadline=5.0, now=0.1)
    turns, seen = Turns(q), []
    while (h := turns.next()) is not None:
        seen.append(h.key)
        q.take(h, 0.1)
        q.hold(h.key, h.tenant, h.cost, h.deadline, 0.1, again=True)
        turns.refused(h, 0.1)
    assert sorted(seen) == ["a2", "b0"] and turns.done == {"a", "b"}  # a is owed room all the same
    q.placed("b", 1.0)
    q.finished("b", 1.0, now=0.2)  # room freed: every held request may go
    assert [k for k, _ in _pump(q, lambda h: False)] == ["a0", "a1", "a2", "b0"]
    q.recheck()  # as each admission hold period
    # a1 goes past a0 for a0's whole cost: a's turn ends there
    assert _pump(q, lambda h: h.key == "a1") == [("a0", False), ("a1", True), ("b0", False)]


def test_a_refusal_with_headroom_left_ends_its_tenants_turn_and_not_its_chances() -> None:
    q = FlowQueue([Tenant("a"), Tenant("b")])
    for k in range(3):
        q.hold(f"b{k}", "b", 1.0, deadline=1.0 + k, now=0.0)
    turns = Turns(q)
    h = turns.next()
    assert h is not None and h.key == "b0"
    q.take(h, 0.0)
    q.hold(h.key, h.tenant, h.cost, h.deadline, 0.0, again=True)
    turns.refused(h, 0.0, kept=True)  # placed leaving room for another: no lookahead past it
    assert turns.next() is None
    assert _pump(q, lambda h: True)[0] == ("b0", True)  # the same epoch: its refusal said nothing of its full share


def test_a_pump_asks_nothing_of_a_tenant_refused_since_room_last_freed_until_it_holds_something_new() -> None:
    q = FlowQueue([Tenant("a")], lookahead=3)
    for k in range(10):
        q.hold(f"a{k}", "a", 1.0, deadline=1.0 + k, now=0.0)
    assert len(_pump(q, lambda h: False)) == 4  # the head and three past it
    for _ in range(2):
        turns = Turns(q)
        assert turns.next() is None and turns.done == {"a"}  # still owed room, nothing asked
    q.hold("urgent", "a", 1.0, deadline=0.5, now=0.1)  # new, and first in EDF order
    assert _pump(q, lambda h: False) == [("urgent", False)]
    q.recheck()
    assert [k for k, _ in _pump(q, lambda h: False)] == ["urgent", "a0", "a1", "a2"]
