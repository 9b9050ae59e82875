"""Flow control's fair queue (hetmesh.placement.flow): strict bands, weighted shares, EDF, work conservation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetmesh.placement import RequestInfo
from hetmesh.placement.flow import FlowQueue, Tenant, reserved, token_cost


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
        # start-time fair queuing: within one request of the weighted share
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


def test_an_idle_tenant_banks_no_credit_and_a_lone_tenant_is_served() -> None:
    q = FlowQueue([Tenant("a"), Tenant("b")])
    for _ in range(50):  # a alone for a while: b idle, a gets everything
        q.placed("a", 10.0)
    for k in range(5):
        q.hold(f"a{k}", "a", 10.0, 1e9, 0.0)
        q.hold(f"b{k}", "b", 10.0, 1e9, 0.0)
    # b comes back at the band's virtual time, not 500 units behind: it alternates with a, it does not take over
    assert _drain(q, 6).count("b") <= 4


def test_a_new_arrival_waits_while_its_band_or_a_higher_one_holds_anything() -> None:
    q = FlowQueue([Tenant("hi", band=0), Tenant("lo", band=1), Tenant("x"), Tenant("y")])
    assert q.may_try("lo") and q.may_try("x")  # nothing held: straight to the policy (work-conserving)
    q.hold("l", "lo", 1.0, 1e9, 0.0)
    assert q.may_try("hi") and q.may_try("x") and not q.may_try("lo")  # a lower band holds: a higher one goes
    q.hold("h", "hi", 1.0, 1e9, 0.0)
    assert not q.may_try("x") and not q.may_try("hi")  # held requests go first, in the queue's order
    q.placed("x", 100.0)
    q.hold("x1", "x", 1.0, 1e9, 0.0)
    q.hold("y1", "y", 1.0, 1e9, 0.0)
    # the queue's head: the higher band, then y (x just took 100), then x, then the lower band
    order = []
    while (h := q.head()) is not None:
        q.take(h, 0.0)
        order.append(h.key)
    assert order == ["h", "y1", "x1", "l"]


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
    assert q.headroom("lo") == 0.0  # the higher band is idle: nothing to keep room for
    q.placed("hi", 1.0)
    assert q.headroom("lo") == 0.5 and q.headroom("hi") == 0.0
    q.finished("hi", 1.0, now=1.0)
    assert q.headroom("lo") == 0.0
    info = RequestInfo(request_id="r", model="m", prompt_len=10, max_tokens=5, waited_s=0.25)
    assert reserved(info, 1.0).waited_s == 1.25 and reserved(info, 0.0) is info
    with pytest.raises(ValueError, match="reserve"):
        FlowQueue([Tenant("a")], reserve=1.0)


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
