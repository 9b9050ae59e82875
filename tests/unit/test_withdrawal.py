"""A placement withdrawn with its booking (hetmesh.placement.withdrawal) and the parts of the live mesh that carry
it out: the scheduler's choice (hetmesh.scheduler.withdraw), the worker as arbiter (RequestBook.withdraw) and the
gateway's restart that uses up no attempt (ReplyStream)."""

from __future__ import annotations

import time

from hetmesh.gateway.stream import Fail, ReplyStream, Retry
from hetmesh.placement import ClusterState, Decision, RequestInfo
from hetmesh.placement.cost import CostPolicy
from hetmesh.placement.withdrawal import Placed, Recent, reconsider
from hetmesh.protocol import (
    Booked,
    ErrorInfo,
    Heartbeat,
    InferenceRequest,
    Phase,
    Placement,
    RequestError,
    Role,
    SamplingParams,
    WorkItem,
)
from hetmesh.scheduler.reconcile import InFlight
from hetmesh.scheduler.withdraw import Withdrawals
from hetmesh.worker.requests import RequestBook, Stop, Verdict


def _policy() -> CostPolicy:
    return CostPolicy(models={"m": "llama-3.1-70b"}, admission_margin=0.0, learn=False)


def _hb(wid: str, ts: float) -> Heartbeat:
    return Heartbeat(worker_id=wid, model="m", accelerator="nvidia-h100", vendor="nvidia", devices=8, role=Role.BOTH,
                     engine="sim", work_subject=f"w.{wid}", queue_depth=0, running=0, max_batch=64,
                     kv_blocks_total=100_000, kv_blocks_used=0, block_size=16, ts=ts)


def _state(now: float) -> ClusterState:
    s = ClusterState(heartbeat_timeout_s=5.0)
    for w in ("a", "b"):
        s.observe(_hb(w, now), 0.0)
    return s


def _info(rid: str, now: float, prompt: int = 8000) -> RequestInfo:
    return RequestInfo(request_id=rid, model="m", prompt_len=prompt, max_tokens=64, arrival=now)


def _req(rid: str, **kw: object) -> InferenceRequest:
    return InferenceRequest(request_id=rid, model="m", prompt_tokens=[1, 2, 3], block_hashes=[],
                            sampling=SamplingParams(max_tokens=4), reply_subject=f"r.{rid}", arrival_ts=0.0, **kw)


def test_recent_finds_own_placements_after_an_earlier_key_on_a_shared_worker() -> None:
    r: Recent[str] = Recent(horizon_s=1.0)
    d_a, d_b = Decision(mode="aggregated", decode_worker="a"), Decision(mode="aggregated", decode_worker="b")
    r.add(Placed((10.0, "s1"), 10.0, _info("x", 10.0), d_a, "x"))
    r.add(Placed((10.5, "s1"), 10.5, _info("y", 10.5), d_a, "y"))
    r.add(Placed((10.6, "s1"), 10.6, _info("z", 10.6), d_b, "z"))
    assert [p.tag for p in r.behind((10.2, "s2"), ("a",), 10.7)] == ["y"]  # after the key, on its worker
    assert [p.tag for p in r.behind((10.5, "s0"), ("a", "b"), 10.7)] == ["y", "z"]  # ties: the scheduler id orders
    assert [p.tag for p in r.behind((10.5, "s2"), ("a",), 10.7)] == []
    assert [p.tag for p in r.behind((9.0, "s2"), ("a",), 11.2)] == ["y"]  # x is past the horizon: forgotten
    r.drop(r.behind((9.0, "s2"), ("a",), 11.2)[0])
    assert [p.tag for p in r.behind((9.0, "s2"), ("a", "b"), 11.2)] == ["z"]


def test_reconsider_keeps_a_placement_that_knowing_the_other_would_not_change() -> None:
    views = _state(0.0).views()
    pol = _policy()
    mine = pol.place(_info("mine", 0.0, prompt=2000), views)
    assert mine is not None and mine.workers == ("a",)  # the first placement: worker a (the first of two idle)
    small = Decision(mode="aggregated", decode_worker="b")  # the other's, on the other worker: nothing moves
    pol.booked(small)
    assert reconsider(pol, _info("mine", 0.001, prompt=2000), mine, lambda: views, 0.001) is not None


def test_reconsider_moves_a_placement_behind_an_earlier_long_prefill_and_unbooks_it() -> None:
    views = _state(0.0).views()
    alone, pol = _policy(), _policy()
    mine = pol.place(_info("mine", 0.0), views)
    assert mine is not None and mine.workers == ("a",)
    theirs = alone.place(_info("theirs", 0.0, prompt=32000), views)  # another replica's, on a as well
    assert theirs is not None and theirs.workers == ("a",)
    pol.booked(theirs)
    assert reconsider(pol, _info("mine", 0.001), mine, lambda: views, 0.001) is None  # it would go to b now
    # nothing of it stays booked: a third request prices worker a as the other's long prefill alone
    probe, ref = pol.place(_info("probe", 0.002), views), alone.place(_info("probe", 0.002), views)
    assert probe is not None and ref is not None and probe.workers == ref.workers == ("b",)
    assert abs(probe.predicted_ttft_s - ref.predicted_ttft_s) < 1e-9


def test_the_scheduler_takes_back_the_later_placement_with_a_cancel_and_a_withdrawn_booking() -> None:
    now = time.time()
    state, pol, alone = _state(now), _policy(), _policy()
    w = Withdrawals(pol, state, "s2", horizon_s=1.0, time_scale=1.0, enabled=True)
    info = _info("mine", now)
    theirs = alone.place(_info("theirs", now - 0.01, prompt=32000), state.views())  # another's, placed first
    mine = pol.place(info, state.views())
    assert theirs is not None and mine is not None and theirs.workers == mine.workers == ("a",)
    state.assigned(mine)
    w.placed(_req("mine", attempt=1), info, mine, now)
    w.placed(_req("moved", moved=True), _info("moved", now), mine, now)  # placed anew once: never taken back
    kept, taken = w.count([((now - 0.001, "s1"), theirs)], [], now + 0.001)
    assert kept == 0 and [t.request_id for t in taken] == ["mine"]
    t = taken[0]
    assert (t.cancel.reason, t.cancel.worker_id, t.cancel.phase, t.cancel.attempt) == ("withdrawn", "a", Phase.FULL, 1)
    assert isinstance(t.booked, Booked) and t.booked.withdrawn and t.booked.placed_at == now
    view = state.view("a")
    assert view is not None and view.queue_depth == 1  # the other's booking counts there; its own left
    assert w.count([((now - 0.001, "s1"), theirs)], [], now + 0.002) == (0, [])  # once only
    # a later booking (by the order) moves nothing; off (flow control on), nothing is recorded
    off = Withdrawals(pol, state, "s2", horizon_s=1.0, time_scale=1.0, enabled=False)
    off.placed(_req("x"), info, mine, now)
    assert off.recent.behind((0.0, ""), ("a", "b"), now) == []


def _item(phase: Phase, attempt: int = 0) -> WorkItem:
    return WorkItem(request=_req("r", attempt=attempt), phase=phase,
                    placement=Placement(mode="aggregated", decode_worker="w"))


def test_the_worker_drops_a_withdrawn_item_only_before_its_engine_started_it() -> None:
    book: RequestBook[None] = RequestBook("m")
    book.accept(_item(Phase.FULL), 0.0, None)
    assert book.withdraw("r", Phase.FULL, 0, 1.0, lambda _rid: True) == Stop.NONE  # started: it goes on
    r = book.get("r")
    assert r is not None and not r.withdrawn and not r.cancelled
    assert book.withdraw("r", Phase.FULL, 0, 1.0, lambda _rid: False) == Stop.ENGINE  # queued: aborted, withdrawn
    assert r.withdrawn and r.cancelled
    # another attempt's withdrawal waits for that item; it is then answered as withdrawn, once
    assert book.withdraw("q", Phase.PREFILL, 2, 1.0, lambda _rid: False) == Stop.NONE
    item = WorkItem(request=_req("q", attempt=2), phase=Phase.PREFILL,
                    placement=Placement(mode="disaggregated", decode_worker="d", prefill_worker="w"))
    assert book.verdict(item) == Verdict.WITHDRAWN
    assert book.verdict(item) == Verdict.ACCEPT
    # the DECODE half, cancelled by its prefill worker: held, it ends as withdrawn; not yet here, when it comes
    book.accept(WorkItem(request=_req("d"), phase=Phase.DECODE, placement=item.placement), 0.0, None)
    assert book.cancel("d", 1.0, Phase.DECODE, 0, withdrawn=True) == Stop.KV_WAIT
    held = book.get("d")
    assert held is not None and held.withdrawn and held.cancelled
    half = WorkItem(request=_req("e"), phase=Phase.DECODE, placement=item.placement)
    book.cancel("e", 1.0, Phase.DECODE, 0, withdrawn=True)
    assert book.was_cancelled("e") and book.verdict(half) == Verdict.WITHDRAWN


def _withdrawn_error() -> RequestError:
    return RequestError(request_id="r", retryable=True,
                        error=ErrorInfo(message="withdrawn", type="server_error", code="withdrawn", status=503))


def test_the_gateway_places_a_withdrawn_request_anew_without_using_up_an_attempt() -> None:
    s = ReplyStream(max_attempts=1, stall_timeout_s=20.0, now=0.0)
    act = s.receive(_withdrawn_error())
    assert isinstance(act, Retry) and (act.attempt, act.reason, act.generated) == (1, "withdrawn", ())
    assert s.restarts == 0 and s.can_retry() is False  # one attempt allowed, none used
    # once per request: a second withdrawal is a retryable error like any (here: no attempt left)
    assert isinstance(s.receive(_withdrawn_error()), Fail)


def test_a_withdrawn_items_finished_ends_only_the_attempt_it_was_placed_for() -> None:
    books = InFlight(idle_grace_s=4.0)
    books.record("r", "reply.r", {"cpx-0", "vr-0"}, 0.0, attempt=0)
    books.record("r", "reply.r", {"cpx-1", "vr-0"}, 0.1, attempt=1)  # placed anew before the Finished came
    books.withdrawn("vr-0", "r", 0)  # attempt 0's decode half: attempt 1's record keeps its decode worker
    assert books.requests["r"].workers == {"cpx-1", "vr-0"}
    books.withdrawn("vr-0", "r", 1)
    assert books.requests["r"].workers == {"cpx-1"}
