"""Several scheduler replicas: another replica's placement booked in a cost policy (CostPolicy.booked), and the
simulator's replicas (hetmesh.sim.replicas), each placing on its own heartbeat-old view."""

from __future__ import annotations

from hetmesh.placement import REFUSED, RequestInfo, WorkerView
from hetmesh.placement.cost import CostPolicy
from hetmesh.protocol import Role
from hetmesh.sim import policy_for, pool, synthetic
from hetmesh.sim.replicas import ReplicaSimulator


def _view(wid: str) -> WorkerView:
    return WorkerView(worker_id=wid, model="m", accelerator="nvidia-h100", vendor="nvidia", devices=8, role=Role.BOTH,
                      queue_depth=0, running=0, max_batch=64, kv_blocks_total=100_000, kv_blocks_used=0, block_size=16)


def _req(rid: str, now: float) -> RequestInfo:
    return RequestInfo(request_id=rid, model="m", prompt_len=8000, max_tokens=64, arrival=now)


def _policy() -> CostPolicy:
    return CostPolicy(models={"m": "llama-3.1-70b"}, admission_margin=0.0, learn=False)


def test_a_booking_heard_from_another_replica_prices_like_its_own() -> None:
    views = [_view("w0")]
    a, b, alone = _policy(), _policy(), _policy()
    first = a.place(_req("r1", 0.0), views)
    assert first is not None and first.booking is not None and first.booking.prefill_s > 0
    b.booked(first)
    # the next request: b prices the backlog a put there exactly as a does; a replica that heard nothing does not
    da, db, dn = (p.place(_req("r2", 0.01), views) for p in (a, b, alone))
    assert da is not None and db is not None and dn is not None
    assert db.predicted_ttft_s == da.predicted_ttft_s
    assert dn.predicted_ttft_s is not None and db.predicted_ttft_s is not None
    assert db.predicted_ttft_s > dn.predicted_ttft_s + first.booking.prefill_s * 0.9


def _run(replicas: int, share_s: float | None) -> ReplicaSimulator:
    ws = pool("h100", 2, "nvidia-h100", model="llama-3.1-70b", max_batch=16)
    trace = synthetic(300, rate=12.0, input_mean=2000, output_mean=100, seed=3)
    reps = [policy_for("cost", ws, admission_margin=0.0) for _ in range(replicas)]
    sim = ReplicaSimulator(ws, reps, share_s=share_s, seed=1)
    res = sim.run(trace)
    assert len(res.records) + res.rejected == len(trace)  # every request served once
    return sim


def test_one_replica_sees_all_it_placed_and_the_worker_is_the_arbiter() -> None:
    ob = _run(1, None).overbooking
    assert ob.placements == 300 and ob.unseen == 0 and ob.blind_full == 0
    assert ob.over_limit == 0


def test_replicas_miss_each_others_placements_until_they_share_them() -> None:
    own = _run(2, None).overbooking
    shared = _run(2, 0.001).overbooking
    assert all(n > 50 for n in own.per_replica)  # requests split among the replicas
    assert own.unseen > 0  # placed on a worker holding more than its view said
    assert shared.unseen < own.unseen / 2
    assert own.over_limit == shared.over_limit == 0  # the batching core never runs past its batch or KV


def test_a_held_request_is_placed_again_by_the_replica_that_held_it() -> None:
    # as the scheduler's hold loop does: the gateway picked a replica once, the hold runs there
    ws = pool("h100", 1, "nvidia-h100", model="llama-3.1-70b", max_batch=16)
    reps = [policy_for("cost", ws) for _ in range(2)]
    calls: list[tuple[str, int, bool]] = []  # (request, replica, refused and held)
    for k, p in enumerate(reps):
        def place(info: RequestInfo, views: list[WorkerView], k: int = k, place=p.place) -> object:
            d = place(info, views)
            calls.append((info.request_id, k, d is not None and d.mode == REFUSED and d.hold_s is not None))
            return d
        p.place = place  # type: ignore[method-assign]
    sim = ReplicaSimulator(ws, reps, share_s=0.001, seed=1)
    sim.run(synthetic(150, rate=6.0, input_mean=6000, output_mean=100, seed=3))
    holder: dict[str, int] = {}
    again = []
    for rid, k, held in calls:
        if rid in holder:
            again.append(holder.pop(rid) == k)
        if held:
            holder[rid] = k
    assert sim.held > 50 and len(again) == sim.held
    assert all(again)


def test_prefills_placed_on_bookings_not_heard_yet_are_counted() -> None:
    near, late = (_run(2, s).overbooking for s in (0.001, 0.05))
    assert late.collided > 10 * max(near.collided, 1)  # the longer the bookings take, the more placements collide


def test_a_withdrawn_placement_leaves_the_backlog_it_booked() -> None:
    views = [_view("w0")]
    a, fresh = _policy(), _policy()
    first = a.place(_req("r1", 0.0), views)
    queued = a.place(_req("r2", 0.01), views)  # behind r1's prefill, not started
    assert first is not None and first.booking is not None and queued is not None
    a.withdrawn(queued, 0.01)
    again = a.place(_req("r3", 0.01), views)
    alone = fresh.place(_req("r3", 0.01), views)
    assert again is not None and alone is not None
    assert again.predicted_ttft_s is not None and alone.predicted_ttft_s is not None
    # r2's prefill is gone from a's books: r3 waits only for what is left of r1's
    assert abs(again.predicted_ttft_s - alone.predicted_ttft_s - (first.booking.prefill_s - 0.01)) < 1e-6


def _arbitrated(share_s: float, withdraw: bool = True) -> ReplicaSimulator:
    ws = pool("h100", 2, "nvidia-h100", model="llama-3.1-70b", max_batch=16)
    trace = synthetic(300, rate=6.0, input_mean=6000, output_mean=100, seed=3)
    sim = ReplicaSimulator(ws, [policy_for("cost", ws) for _ in range(2)], share_s=share_s, seed=1, withdraw=withdraw)
    res = sim.run(trace)
    ids = [(r.arrival, r.input_len, r.output_len) for r in res.records]  # a request's identity in a record
    assert len(ids) == len(set(ids)) and len(ids) + res.rejected == len(trace)  # each request once, none lost
    return sim


def test_a_replica_takes_back_a_placement_an_earlier_booking_heard_late_would_have_changed() -> None:
    # admission on, bookings heard 50 ms late: placements on a worker another replica filled first are placed
    # again when its booking arrives; those that then go elsewhere or are refused leave their engine's queue
    ob = _arbitrated(0.05).overbooking
    assert ob.rechecked > 0 and 0 < ob.withdrawn <= ob.rechecked
    assert ob.withdrawal_refused < ob.withdrawn  # most reach their worker before its engine starts them
    assert ob.over_limit == 0
    # heard at once, no placement is ever made without knowing of an earlier one
    assert _arbitrated(0.0).overbooking.rechecked == 0
    assert _arbitrated(0.05, withdraw=False).overbooking.rechecked == 0  # the live scheduler's way: the engine queues it


def test_what_a_busy_replica_hears_waits_behind_its_own_placements() -> None:
    ws = pool("h100", 2, "nvidia-h100", model="llama-3.1-70b", max_batch=16)
    trace = synthetic(300, rate=12.0, input_mean=2000, output_mean=100, seed=3)

    def collided(place_s: float) -> int:
        reps = [policy_for("cost", ws, admission_margin=0.0) for _ in range(2)]
        sim = ReplicaSimulator(ws, reps, share_s=1e-5, seed=1, place_s=place_s)
        res = sim.run(trace)
        assert len(res.records) + res.rejected == len(trace)
        return sim.overbooking.collided

    # a 10 us hop: every booking is heard before the next arrival; with placements that take time, a replica hears
    # the other's only once its own queued ones are done, and places more on views that miss them
    near, busy, busier = collided(0.0), collided(0.05), collided(0.2)
    assert near == 0 < busy < busier
