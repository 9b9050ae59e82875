"""The anchors' routing rules (llm-d, Dynamo) and SLO-aware admission, pinned against hand-computed cases."""

import math

import msgspec
import pytest

from hetmesh.config import ClusterConfig, ModelConfig, SchedulerConfig
from hetmesh.placement import REFUSED, Decision, RequestInfo, WorkerView, make_policy
from hetmesh.placement.admission import (
    admit,
    hold_s,
    hold_wait_s,
    over_slo,
    quiet_s,
    retry_after_s,
    retry_wait_s,
)
from hetmesh.placement.dynamo import Dynamo, argmin, decode_cost, isl_bounding, kv_cost
from hetmesh.placement.llmd import (
    LlmD,
    disaggregate,
    kv_scores,
    max_score,
    prefix_scores,
    queue_scores,
    weighted,
)
from hetmesh.placement.policies import check_options
from hetmesh.protocol import Role
from hetmesh.sim import pool
from hetmesh.wiring import policy_options


def view(wid: str, role: Role = Role.BOTH, queue: int = 0, running: int = 0, used: int = 0, total: int = 100,
         model: str = "m") -> WorkerView:
    return WorkerView(worker_id=wid, model=model, accelerator="nvidia-h100", vendor="nvidia", devices=1, role=role,
                      queue_depth=queue, running=running, max_batch=8, kv_blocks_total=total, kv_blocks_used=used,
                      block_size=16)


def req(prompt: int = 160, cached: dict[str, int] | None = None, out: int = 10, arrival: float = 0.0) -> RequestInfo:
    return RequestInfo(request_id="r", model="m", prompt_len=prompt, max_tokens=out, cached_blocks=cached or {},
                       block_size=16, arrival=arrival)


# ---- llm-d ----
def test_llmd_scorers_by_hand() -> None:
    pool_ = [view("a", queue=2, used=50), view("b", queue=6, used=0), view("c", queue=4, used=100)]
    assert prefix_scores(req(160, {"a": 5, "c": 10}), pool_) == [0.5, 0.0, 1.0]  # 10 blocks of 16
    assert queue_scores(pool_) == [1.0, 0.0, 0.5]  # (6 - q) / (6 - 2)
    assert queue_scores([view("a", queue=3), view("b", queue=3)]) == [1.0, 1.0]  # all equal: 1.0 each
    assert kv_scores(pool_) == [0.5, 1.0, 0.0]
    # the example P/D profile: prefix 2, queue 1 -> a: 2*0.5 + 1 = 2.0, b: 0 + 0 = 0.0, c: 2*1 + 0.5 = 2.5
    scores = weighted([(2.0, [0.5, 0.0, 1.0]), (1.0, [1.0, 0.0, 0.5])], 3)
    assert scores == [2.0, 0.0, 2.5]
    assert max_score(pool_, scores).worker_id == "c"


def test_llmd_picker_breaks_ties_at_random_but_repeatably() -> None:
    pool_ = [view("a"), view("b"), view("c")]
    picks = [LlmD(seed=7).pick(req(), pool_).worker_id for _ in range(2)]
    assert picks[0] == picks[1]  # same seed, same pick
    p = LlmD(seed=1)
    assert {p.pick(req(), pool_).worker_id for _ in range(30)} == {"a", "b", "c"}  # not always the first


@pytest.mark.parametrize(("prompt", "cached", "threshold", "split"), [
    (1000, 0, 0, False),  # 0 disables disaggregation
    (1000, 0, 1, True),
    (1000, 200, 800, True),  # non-cached 800 >= 800
    (1000, 201, 800, False),  # 799 < 800
    (4096, 4096 - 2047, 2048, False),
])
def test_llmd_pd_decider_threshold(prompt: int, cached: int, threshold: int, split: bool) -> None:
    assert disaggregate(prompt, cached, threshold) is split


def test_llmd_decode_first_then_prefill_if_decider_approves() -> None:
    ws = [view("p0", Role.PREFILL, queue=1), view("p1", Role.PREFILL), view("d0", Role.DECODE),
          view("d1", Role.DECODE, queue=3)]
    # d0 holds 4 of the prompt's 10 blocks: non-cached 160 - 64 = 96
    d = LlmD(non_cached_tokens=96).place(req(160, {"d0": 4}), ws)
    assert d is not None and d.mode == "disaggregated" and d.decode_worker == "d0" and d.prefill_worker == "p1"
    d = LlmD(non_cached_tokens=97).place(req(160, {"d0": 4}), ws)
    assert d is not None and d.mode == "aggregated" and d.decode_worker == "d0" and d.expected_cached_tokens == 64
    assert LlmD().place(req(), [view("p", Role.PREFILL)]) is None  # no decode endpoint


# ---- Dynamo ----
def test_dynamo_documented_worked_example() -> None:
    """docs: cost = overlap_score_weight * prefill_blocks + decode_blocks; W1 = 18, W2 = 10 (chosen), W3 = 11."""
    costs = [kv_cost(8, 0, 10), kv_cost(5, 0, 5), kv_cost(2, 0, 9)]
    assert costs == [18.0, 10.0, 11.0]
    assert argmin([view("w1"), view("w2"), view("w3")], costs).worker_id == "w2"


def test_dynamo_cost_terms() -> None:
    # raw prefill 12, credit 1 x 5 cached -> 7, scale 1 -> 7 + decode 9 = 16
    assert kv_cost(12, 5, 9) == 16.0
    assert kv_cost(3, 5, 9) == 9.0  # the credit never takes prefill below 0
    # agentic preset: credit 2, scale 4, request weight 64: 4 * max(12 - 2*5, 0) + 9 + 64 * 3 = 209
    assert kv_cost(12, 5, 9, 3, prefill_load_scale=4, overlap_score_credit=2, request_weight=64) == 209.0
    assert decode_cost(9, 4) == 5.0 and decode_cost(3, 4, 2, request_weight=1.5) == 3.0


def test_dynamo_isl_bounding_edges() -> None:
    assert isl_bounding(4000, 3000)  # effective 1000 < 2048, ratio 0.25 < 0.7: local
    assert not isl_bounding(1000, 0)  # effective 1000 < 2048 but nothing cached (ratio 1.0): split
    assert not isl_bounding(2000, 600)  # ratio exactly 0.7
    assert isl_bounding(10000, 7953) and not isl_bounding(10000, 7952)  # eff 2047 vs 2048


def test_dynamo_routes_to_cheapest_and_tracks_its_prefills() -> None:
    # Two idle `both` workers; b holds 6 of the 10 prompt blocks: a = 10 + 11, b = 4 + 11 -> b.
    ws = [view("a"), view("b")]
    p = Dynamo()
    d = p.place(req(160, {"b": 6}), ws)
    assert d is not None and d.mode == "aggregated" and d.decode_worker == "b"
    # b now has 4 uncached prompt blocks waiting (queue 1): a = 21, b = 4 + 10 + 11 = 25 -> a.
    d = p.place(req(160), [view("a"), view("b", queue=1)])
    assert d is not None and d.decode_worker == "a"
    # b's request left the queue: its prefill no longer counts, b = 10 + 11 = a -> tie.
    assert p._active_prefill(view("b", queue=0)) == 0.0


def test_dynamo_disaggregates_unless_isl_bounding_keeps_it_local() -> None:
    ws = [view("p0", Role.PREFILL), view("d0", Role.DECODE), view("d1", Role.DECODE, used=40)]
    d = Dynamo().place(req(4000 // 16 * 16, {"d0": 190}), ws)
    assert d is not None and d.mode == "disaggregated" and d.decode_worker == "d0" and d.prefill_worker == "p0"
    d = Dynamo(conditional="isl_bounding").place(req(4000 // 16 * 16, {"d0": 190}), ws)  # eff 960, ratio 0.24
    assert d is not None and d.mode == "aggregated" and d.decode_worker == "d0"
    with pytest.raises(ValueError, match="conditional"):
        Dynamo(conditional="prefill_load")


# ---- admission ----
def test_admission_rule_by_hand() -> None:
    assert over_slo(3.0, 0.05, 100, ttft_slo_s=2.0, tpot_slo_s=0.1) == 1.5
    assert over_slo(1.0, 0.3, 100, 2.0, 0.1) == pytest.approx(3.0)
    assert over_slo(1.0, 0.3, 1, 2.0, 0.1) == 0.5  # one token: no TPOT
    assert admit(1.5, 1.5) and not admit(1.51, 1.5) and admit(100.0, 0.0)  # 0: off
    assert admit(3.0, 1.0, idle_over=3.0) and not admit(3.1, 1.0, idle_over=3.0)  # too long even when idle
    assert admit(1.0, 1.0, idle_over=0.2) and not admit(1.01, 1.0, idle_over=0.2)
    assert retry_after_s(7.0, 2.0, 1.5, 1.0) == 4.0  # 7 - 1.5 * 2
    assert retry_after_s(2.5, 2.0, 1.5, 1.0) == 1.0 and retry_after_s(1e6, 2.0, 1.5, 1.0) == 60.0
    # too long even when idle (3x its SLO): it waits only for what load adds, 13 - 1.5 * 3 * 2
    assert retry_after_s(13.0, 2.0, 1.5, 1.0, idle_over=3.0) == 4.0


def test_a_request_too_long_for_its_slo_is_served_only_while_it_holds_up_no_one() -> None:
    assert admit(3.0, 1.0, idle_over=3.0, arrivals=0.5) and not admit(3.0, 1.0, idle_over=3.0, arrivals=1.0)
    assert admit(0.9, 1.0, idle_over=3.0, arrivals=50.0)  # within its SLO: the arrivals do not matter
    assert quiet_s(3.0, 1.0, 3.0, math.e ** 2, 30.0) == pytest.approx(60.0)  # the rate decays below 1 in 2 windows
    assert quiet_s(3.5, 1.0, 3.0, 10.0, 30.0) == 0.0 and quiet_s(3.0, 1.0, 3.0, 0.9, 30.0) == 0.0

    ws = [WorkerView(worker_id="h-0", model="llama-3.1-70b", accelerator="nvidia-h100", vendor="nvidia", devices=8,
                     role=Role.BOTH, queue_depth=0, running=0, max_batch=64, kv_blocks_total=0, kv_blocks_used=0,
                     block_size=16)]
    long = RequestInfo(request_id="long", model="llama-3.1-70b", prompt_len=32_000, max_tokens=1, arrival=100.0)
    quiet = make_policy("cost", ttft_slo_s=1.0)  # a 32K prompt takes seconds: 1 s is out of reach even alone
    d = quiet.place(long, ws)
    assert d is not None and d.mode == "aggregated"  # nobody else comes: served, late
    busy = make_policy("cost", ttft_slo_s=1.0)
    for i in range(100):  # ten short requests a second, each prefilled long before the next
        short = RequestInfo(request_id=f"s{i}", model="llama-3.1-70b", prompt_len=100, max_tokens=1,
                            arrival=90.0 + 0.1 * i)
        assert (s := busy.place(short, ws)) is not None and s.mode == "aggregated"
    d = busy.place(long, ws)  # ~10/s x its seconds of prefill: it would hold up dozens
    assert d is not None and d.mode == REFUSED and d.retry_after_s == 60.0  # 30 s x ln(dozens), capped


def test_hold_rule_by_hand() -> None:
    assert hold_s(1.0, 0.5, 0.25, 1.0, 2.0) == 0.25  # 0.5 waited + 0.25 + 1.0 <= 2.0
    assert hold_s(1.0, 0.8, 0.25, 1.0, 2.0) is None  # 2.05 > 2.0: its TTFT would be gone by then
    assert hold_s(1.0, 0.0, 0.0, 1.0, 2.0) is None  # holding off
    assert hold_s(1.0, 1.5, 0.25, 1.5, 2.0) == 0.25  # the margin widens what admission allows: 2.75 <= 3.0
    assert hold_s(5.0, 0.0, 0.25, 1.0, 2.0, idle_over=3.0) == 0.25  # too long even when idle: 5.25 <= 6.0
    # the shell's limit (live: half the gateway's submit timeout): the whole wait stays within it
    held = Decision(mode=REFUSED, decode_worker="", hold_s=0.25)
    assert hold_wait_s(held, 2.0, 2.5) == 0.25 and hold_wait_s(held, 2.3, 2.5) is None
    assert hold_wait_s(Decision(mode=REFUSED, decode_worker=""), 0.0, 2.5) is None


def test_cost_policy_holds_a_refusal_for_tpot_and_counts_the_wait_in_its_ttft() -> None:
    def views(running: int, queue: int) -> list[WorkerView]:
        return [WorkerView(worker_id="h-0", model="llama-3.1-70b", accelerator="nvidia-h100", vendor="nvidia",
                           devices=8, role=Role.BOTH, queue_depth=queue, running=running, max_batch=64,
                           kv_blocks_total=0, kv_blocks_used=0, block_size=16)]

    r = RequestInfo(request_id="r", model="llama-3.1-70b", prompt_len=100, max_tokens=32, arrival=0.0)
    probe = make_policy("cost").place(r, views(63, 0))  # a full batch of 64
    assert probe is not None and probe.predicted_tpot_s and probe.predicted_ttft_s is not None
    step = probe.predicted_tpot_s
    # 64 running and 64 queued: the batch waits for slots, two rounds a token (2 x step), over a 1.5 x step SLO
    p = make_policy("cost", ttft_slo_s=2.0, tpot_slo_s=1.5 * step, admission_hold_s=0.25)
    d = p.place(r, views(64, 63))
    assert d is not None and d.mode == REFUSED and d.hold_s == 0.25
    assert math.isclose(d.predicted_tpot_s or 0, 2 * step, rel_tol=1e-6)
    # the queue drained: placed again 0.25 s later, its wait counted in its TTFT
    again = msgspec.structs.replace(r, arrival=0.25, waited_s=0.25)
    d = p.place(again, views(63, 0))
    assert d is not None and d.mode == "aggregated"
    # no time left: a refusal that has waited nearly its TTFT SLO is answered at once
    late = msgspec.structs.replace(r, arrival=1.9, waited_s=1.9)
    d = p.place(late, views(64, 63))
    assert d is not None and d.mode == REFUSED and d.hold_s is None
    # and past its TTFT SLO with the wait counted, it is refused even on an idle worker
    d = p.place(msgspec.structs.replace(r, arrival=2.5, waited_s=2.5), views(0, 0))
    assert d is not None and d.mode == REFUSED


def test_behind_a_full_batch_a_sequence_pays_its_wait_for_a_slot_once_when_admission_is_on() -> None:
    """Keeping SLOs (admission on), a sequence queued behind a full batch also waits until enough slots free,
    one every life / max_batch (life: the mean time the decodes placed there hold one), and waits once: on a
    `both` worker before its first token (its prefill needs the slot, then it runs through), on a decode
    worker after another's prefill spread over its own tokens (a 2-token request in its one TPOT interval, a
    101-token one over 100). Serving everything (admission off) only the b / max_batch rounds price the
    queue; with a slot free, no wait."""
    def views(split: bool, running: int, queue: int) -> list[WorkerView]:
        def view(wid: str, role: Role, running: int, queue: int) -> WorkerView:
            return WorkerView(worker_id=wid, model="llama-3.1-70b", accelerator="nvidia-h100", vendor="nvidia",
                              devices=8, role=role, queue_depth=queue, running=running, max_batch=64,
                              kv_blocks_total=0, kv_blocks_used=0, block_size=16)
        if not split:
            return [view("h-0", Role.BOTH, running, queue)]
        return [view("p-0", Role.PREFILL, 0, 0), view("d-0", Role.DECODE, running, queue)]

    def req(rid: str, n: int, at: float = 600.0) -> RequestInfo:
        return RequestInfo(request_id=rid, model="llama-3.1-70b", prompt_len=100, max_tokens=n, arrival=at)

    def placed(split: bool, margin: float, n: int, running: int, queue: int) -> tuple[float, float, float]:
        """(life of the one decode placed before, TTFT and TPOT predicted for an n-token request at that batch)"""
        p = make_policy("cost", admission_margin=margin)
        first = p.place(req("a", 33, 0.0), views(split, 0, 0))  # alone: its slot is held 32 steps of a batch of 1
        d = p.place(req("c", n), views(split, running, queue))  # 600 s on: the first one's prefill share is gone
        assert first is not None and first.predicted_tpot_s and d is not None and d.predicted_tpot_s
        assert d.predicted_ttft_s is not None and (d.prefill_worker == "p-0") == split
        return 32 * first.predicted_tpot_s, d.predicted_ttft_s, d.predicted_tpot_s

    for split in (False, True):
        over = {}
        for n in (2, 101):
            life, ttft_on, on = placed(split, 1e9, n, 64, 31)  # on, never refusing; 96 in 64 slots: 32 to free
            _, ttft_off, off = placed(split, 0.0, n, 64, 31)
            over[n] = on - off
            wait = 32 * life / 64
            if split:  # the decode joins the full batch after its first token
                assert math.isclose(over[n], wait / (n - 1), rel_tol=0.02)
                assert math.isclose(ttft_on, ttft_off, rel_tol=1e-9)
            else:  # it waits, then prefills and decodes in the batch
                assert math.isclose(ttft_on - ttft_off, wait, rel_tol=0.02)
                assert math.isclose(on, off, rel_tol=1e-9)
            free_on, free_off = placed(split, 1e9, n, 40, 0), placed(split, 0.0, n, 40, 0)  # a slot free
            assert math.isclose(free_on[1], free_off[1], rel_tol=1e-9) and math.isclose(free_on[2], free_off[2],
                                                                                         rel_tol=1e-9)
        if split:
            assert math.isclose(over[2] / over[101], 100, rel_tol=0.02)


def test_cost_policy_refuses_past_the_margin_and_commits_nothing() -> None:
    ws = [WorkerView(worker_id=w.worker_id, model="llama-3.1-70b", accelerator="nvidia-h100", vendor="nvidia",
                     devices=8, role=Role.BOTH, queue_depth=0, running=0, max_batch=64, kv_blocks_total=0,
                     kv_blocks_used=0, block_size=16) for w in pool("h", 1, "nvidia-h100")]
    r = RequestInfo(request_id="r", model="llama-3.1-70b", prompt_len=32_000, max_tokens=1, arrival=0.0)
    probe = make_policy("cost", ttft_slo_s=10.0).place(r, ws)
    assert probe is not None and probe.predicted_ttft_s is not None
    pf = probe.predicted_ttft_s  # the prefill alone, on the idle server
    # TTFT SLO = the idle prefill: the first request is admitted (a long prompt is never refused for itself),
    # the second waits behind it: 2 x its SLO, over a margin of 1.5.
    p = make_policy("cost", ttft_slo_s=pf, admission_margin=1.5)
    first = p.place(r, ws)
    assert first is not None and first.mode == "aggregated"
    second = p.place(r, ws)
    assert second is not None and second.mode == REFUSED and second.decode_worker == ""
    assert math.isclose(second.predicted_ttft_s or 0, 2 * pf, rel_tol=1e-6)
    assert math.isclose(second.retry_after_s or 0, 0.5 * pf, rel_tol=1e-6)  # the wait past 1.5x its SLO
    assert retry_wait_s(second, 1e6) == 60.0 and retry_wait_s(second, 0.0) == second.retry_after_s
    # The refusal queued nothing: the next one sees the same backlog, and a wider margin admits it.
    p.admission_margin = 2.1
    third = p.place(r, ws)
    assert third is not None and third.mode == "aggregated"
    assert math.isclose(third.predicted_ttft_s or 0, 2 * pf, rel_tol=1e-6)
    # per model: off
    q = make_policy("cost", ttft_slo_s=pf, admission_margin=1.5, admission_margins={"llama-3.1-70b": 0.0})
    assert [q.place(r, ws).mode for _ in range(3)] == ["aggregated"] * 3  # type: ignore[union-attr]


def test_admission_config_per_model_and_options() -> None:
    cfg = ClusterConfig(scheduler=SchedulerConfig(policy="cost", admission_margin=2.0),
                        models=[ModelConfig(name="a"), ModelConfig(name="b", admission_margin=0.0)]).validate()
    assert cfg.admission_margin("a") == 2.0 and cfg.admission_margin("b") == 0.0
    kw = policy_options(cfg)
    assert kw["admission_margin"] == 2.0 and kw["admission_margins"] == {"a": 2.0, "b": 0.0}
    with pytest.raises(ValueError, match="admission_margin"):
        ClusterConfig(scheduler=SchedulerConfig(admission_margin=-1.0)).validate()
    check_options("llm_d", {"non_cached_tokens": 2048, "prefix_weight": 3.0})
    with pytest.raises(ValueError, match="no option 'threshold'"):
        check_options("dynamo", {"threshold": 1})


def test_an_anchor_behind_the_admission_gate_is_judged_on_its_own_choice() -> None:
    # Dynamo over two idle H100 servers; the cost model predicts what Dynamo picks. TTFT SLO = the idle
    # prefill: the first request is admitted and booked; the second, on the same worker (Dynamo's tie goes
    # by id), waits behind it: 2x its SLO, over the margin of 1.5, refused, and withdrawn from Dynamo's own
    # count of active prefill blocks, so Dynamo's next choice is as if it never came.
    from hetmesh.placement.gate import Gated

    ws = [WorkerView(worker_id=f"h-{i}", model="llama-3.1-70b", accelerator="nvidia-h100", vendor="nvidia",
                     devices=8, role=Role.BOTH, queue_depth=0, running=0, max_batch=64, kv_blocks_total=0,
                     kv_blocks_used=0, block_size=16) for i in range(2)]
    r = RequestInfo(request_id="r", model="llama-3.1-70b", prompt_len=32_000, max_tokens=1, arrival=0.0)
    pf = make_policy("cost", ttft_slo_s=10.0).place(r, ws).predicted_ttft_s  # type: ignore[union-attr]
    assert pf is not None

    class Pinned:  # always h-0: the gate judges the choice, not the best placement
        name = "pinned"

        def place(self, req: RequestInfo, workers: list[WorkerView]) -> Decision:
            return Decision(mode="aggregated", decode_worker="h-0")

    g = Gated(Pinned(), make_policy("cost", ttft_slo_s=pf, admission_margin=1.5))  # type: ignore[arg-type]
    assert g.name == "pinned+admission"
    first = g.place(r, ws)
    assert first is not None and first.decode_worker == "h-0" and first.predicted_ttft_s == pytest.approx(pf)
    second = g.place(r, ws)  # h-1 is idle, but the choice is h-0 behind one prefill: 2 x the SLO
    assert second is not None and second.mode == REFUSED and second.predicted_ttft_s == pytest.approx(2 * pf)
    assert g.place(r, ws).mode == REFUSED  # type: ignore[union-attr]  # nothing booked by a refusal
    assert Gated(Pinned(), make_policy("cost", ttft_slo_s=pf), margin=2.1).place(r, ws).mode == "aggregated"  # type: ignore[arg-type,union-attr]

    dyn = Dynamo()
    gd = Gated(dyn, make_policy("cost", ttft_slo_s=pf, admission_margin=1.5))
    views = [msgspec.structs.replace(w, queue_depth=5) for w in ws]  # queued: Dynamo keeps counting its blocks
    # Dynamo spreads the two (its second choice counts the first's blocks); both admitted
    assert {gd.place(r, views).decode_worker for _ in range(2)} == {"h-0", "h-1"}  # type: ignore[union-attr]
    assert gd.place(r, views).mode == REFUSED  # type: ignore[union-attr]  # both busy: 2x the SLO either way
    assert [len(q) for q in dyn._prefills.values()] == [1, 1]  # the refused one was withdrawn


def test_admissions_idle_reference_counts_the_workers_first_token_gap() -> None:
    """A request over its TTFT SLO even on an idle worker, once that worker's first-token gap (time outside its
    engine's steps) is counted, is judged by the idle exception (admitted while nothing else is expected), not
    held and refused for load it does not face."""
    ws = [WorkerView(worker_id="h0", model="llama-3.1-70b", accelerator="nvidia-h100", vendor="nvidia", devices=8,
                     role=Role.BOTH, queue_depth=0, running=0, max_batch=64, kv_blocks_total=0, kv_blocks_used=0,
                     block_size=16)]
    r = RequestInfo(request_id="r", model="llama-3.1-70b", prompt_len=4_000, max_tokens=1, arrival=0.0)
    probe = make_policy("cost", ttft_slo_s=10.0).place(r, ws)
    assert probe is not None and probe.predicted_ttft_s is not None
    pf = probe.predicted_ttft_s  # the prefill alone, on the idle server
    p = make_policy("cost", ttft_slo_s=2 * pf, admission_margin=1.0)
    p.observe_gaps(ws[0], [3 * pf] * 8)  # the gap alone is past the SLO
    d = p.place(r, ws)
    assert d is not None and d.mode == "aggregated", d
    assert math.isclose(d.predicted_ttft_s or 0, 4 * pf, rel_tol=1e-6)
