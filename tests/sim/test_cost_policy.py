"""The cost policy on hand-made WorkerViews: feasible placements, predictions, objectives."""

from __future__ import annotations

import msgspec
import pytest

from hetmesh.costmodel import CostModel, accelerator, model_spec
from hetmesh.placement import RequestInfo, WorkerView, make_policy
from hetmesh.protocol import Role


def view(wid: str, acc: str, role: Role = Role.BOTH, running: int = 0, queue: int = 0, model: str = "llama-3.1-70b",
         max_batch: int = 64) -> WorkerView:
    return WorkerView(worker_id=wid, model=model, accelerator=acc, vendor=acc.split("-")[0], devices=8, role=role,
                      queue_depth=queue, running=running, max_batch=max_batch, kv_blocks_total=100_000,
                      kv_blocks_used=0, block_size=16)


def req(prompt: int, out: int = 256, model: str = "llama-3.1-70b", cached: dict | None = None,
        t: float = 0.0) -> RequestInfo:
    return RequestInfo(request_id="r", model=model, prompt_len=prompt, max_tokens=out, cached_blocks=cached or {},
                       block_size=16, arrival=t)


RUBIN = [view("cpx-0", "nvidia-rubin-cpx"), view("vr-0", "nvidia-rubin-vr200", running=40)]


def test_long_prompts_go_disaggregated_short_ones_stay() -> None:
    pol = make_policy("cost")  # no models mapping: WorkerView.model is the spec id
    long = pol.place(req(32_000, 64), RUBIN)
    assert long is not None and long.mode == "disaggregated"
    # the VR200 has more compute than the CPX too; what it must not do is stall its 40 decodes
    assert long.prefill_worker != long.decode_worker
    short = make_policy("cost").place(req(50, 512), RUBIN)
    assert short is not None and short.mode == "aggregated"


def test_predictions_come_from_the_cost_model() -> None:
    pol = make_policy("cost", models={"svc": "llama-3.1-8b"})
    w = view("h-0", "nvidia-h100", model="svc")
    d = pol.place(req(2048, 100, model="svc"), [w])
    assert d is not None and d.mode == "aggregated"
    cm = CostModel(accelerator("nvidia-h100"), model_spec("llama-3.1-8b"), devices=8)
    assert d.predicted_ttft_s == pytest.approx(cm.prefill_time(2048), rel=1e-6)
    assert d.predicted_tpot_s == pytest.approx(cm.decode_step_time(1, 2048 + 50), rel=1e-6)


def test_prefix_hits_lower_the_predicted_ttft_and_attract_the_request() -> None:
    ws = [view("a-0", "nvidia-h100"), view("a-1", "nvidia-h100")]
    d = make_policy("cost").place(req(8192, 16, cached={"a-1": 500}), ws)
    assert d is not None and d.decode_worker == "a-1" and d.expected_cached_tokens == 8000
    cold = make_policy("cost").place(req(8192, 16), ws)
    assert cold is not None and d.predicted_ttft_s < cold.predicted_ttft_s / 4


def test_backlog_it_placed_spreads_later_requests() -> None:
    pol = make_policy("cost")
    ws = [view("a-0", "nvidia-h100"), view("a-1", "nvidia-h100")]
    first = pol.place(req(16_000, 8), ws)
    second = pol.place(req(16_000, 8), ws)  # same instant: a-0's queue is now the first prefill
    assert first is not None and second is not None
    assert {first.decode_worker, second.decode_worker} == {"a-0", "a-1"}


def test_latency_objective_keeps_tpot_inside_the_slo() -> None:
    busy = view("vr-0", "nvidia-rubin-vr200", running=60, max_batch=64)
    idle_slow = view("n300-0", "tenstorrent-wormhole-n300", model="llama-3.1-8b")
    ws = [view("vr-0", "nvidia-rubin-vr200", model="llama-3.1-8b", running=60), idle_slow]
    del busy
    pol = make_policy("cost", objective="latency", ttft_slo_s=5.0, tpot_slo_s=0.05)
    d = pol.place(req(1000, 200, model="llama-3.1-8b"), ws)
    assert d is not None and d.predicted_tpot_s is not None and d.predicted_tpot_s <= 0.05


def test_no_candidates_means_no_placement() -> None:
    pol = make_policy("cost")
    assert pol.place(req(100, model="other"), RUBIN) is None
    assert pol.place(req(100), [view("p-0", "nvidia-rubin-cpx", Role.PREFILL)]) is None
    with pytest.raises(ValueError):
        make_policy("cost", objective="cheapest")


def test_a_prefill_is_charged_for_the_decodes_queued_where_it_would_run() -> None:
    # The seed cluster (shipped DeepSeek-R1 factors) hit by a burst of 4K prompts, the views updated
    # as the scheduler's optimistic accounting does. Each MI308X soon holds decodes waiting for their
    # KV; a 6 s prefill there would hold all of them up, so every prompt goes to the MI300X, although
    # its queue (prefills this policy put there, which a new one does not delay) keeps growing.
    pol = make_policy("cost", ttft_slo_s=10.0, tpot_slo_s=0.15)
    queued = {"mi300x": 0, "mi308x-0": 0, "mi308x-1": 0}
    prefilled_on = []
    for i in range(10):
        ws = [view(w, f"amd-{w.split('-')[0]}", queue=q, model="deepseek-r1", max_batch=128)
              for w, q in queued.items()]
        d = pol.place(RequestInfo(request_id=str(i), model="deepseek-r1", prompt_len=4096, max_tokens=256,
                                  block_size=16), ws)
        assert d is not None
        prefilled_on.append(d.prefill_worker or d.decode_worker)
        for w in set(d.workers):
            queued[w] += 1
    assert prefilled_on == ["mi300x"] * 10
    assert queued["mi308x-0"] >= 4 and queued["mi308x-1"] >= 4


def test_a_prefill_is_charged_only_the_time_it_takes_from_the_decodes_beside_it() -> None:
    # 10 decodes running on an H100 server: a 2048-token prompt's step there runs them too, which they would
    # have spent on a step of their own anyway. The delay it puts on them is the difference, per decode.
    pol = make_policy("cost")
    w = view("h-0", "nvidia-h100", running=10)
    r = req(2048, 100)
    pr = pol._price(r, [w])
    assert pr is not None
    cm = CostModel(accelerator("nvidia-h100"), model_spec("llama-3.1-70b"), devices=8)
    ctx = 2048 + 50  # the context every decode is priced at: the prompt and half the output
    pf = cm.step_time([(2048, 0)], [ctx] * 10)
    stolen = pf - cm.decode_step_time(10, 10 * ctx)
    assert pr.prefill[0] == pytest.approx(pf, rel=1e-6)
    assert pr.stolen[0] == pytest.approx(stolen, rel=1e-6) and 0 < stolen < pf
    assert pr.prefill_delay[0] == pytest.approx(10 * stolen, rel=1e-6)  # 10 decodes held up



def test_a_short_decode_is_priced_at_the_recent_prefill_share_a_long_one_at_the_window() -> None:
    # Three 2048-token prefills placed on one H100 server at t = 20 s (the policy's first placement at t = 0).
    # Half a second later a 5-token decode (life at its SLO: 4 x 0.1 s) reads the share at the ladder's
    # shortest time constant above 0.4 s (30 s / 27); a 500-token one (50 s) reads the 30 s window's.
    import math

    pol = make_policy("cost")  # window 30 s, TPOT SLO 0.1 s
    w = view("h-0", "nvidia-h100")
    assert pol.place(req(16, 2, t=0.0), [w]) is not None
    for _ in range(3):
        d = pol.place(req(2048, 2, t=20.0), [w])
        assert d is not None
    placed = d.predicted_ttft_s  # the prefill seconds placed at t = 20: the last TTFT includes those before it
    first = make_policy("cost")._price(req(16, 2, t=0.0), [w])  # the t = 0 prefill's seconds
    assert first is not None
    acc = float(first.prefill[0]) * math.exp(-20 / 30) + placed  # the t = 0 prefill decayed, plus the burst
    acc_short = float(first.prefill[0]) * math.exp(-20 / (30 / 27)) + placed
    cm = CostModel(accelerator("nvidia-h100"), model_spec("llama-3.1-70b"), devices=8)

    def expected(out: int, tau: float, a: float) -> float:
        share = a * math.exp(-0.5 / tau) / (tau * (1 - math.exp(-20.5 / tau)))
        return cm.decode_step_time(1, 16 + out // 2) / (1 - share)

    short = pol._price(req(16, 5, t=20.5), [w])
    long = pol._price(req(16, 500, t=20.5), [w])
    assert short is not None and long is not None
    assert long.tpot[0] == pytest.approx(expected(500, 30.0, acc), rel=1e-6)
    assert short.tpot[0] == pytest.approx(expected(5, 30 / 27, acc_short), rel=1e-6)
    # the burst slows the short decode's steps by 1.4x, the long one's by 1.04x
    assert short.tpot[0] / cm.decode_step_time(1, 18) > 1.3 > 1.1 > long.tpot[0] / cm.decode_step_time(1, 266)


def test_a_prefill_workers_running_sequences_are_not_priced_as_decodes() -> None:
    # the 10 sequences running on a prefill worker are prefills (already in its backlog): none decodes there
    d = view("d-0", "nvidia-h100", Role.DECODE)
    busy = make_policy("cost")._price(req(2048, 100), [view("p-0", "nvidia-h100", Role.PREFILL, running=10), d])
    idle = make_policy("cost")._price(req(2048, 100), [view("p-0", "nvidia-h100", Role.PREFILL), d])
    assert busy is not None and idle is not None
    assert busy.prefill[0] == pytest.approx(idle.prefill[0], rel=1e-9)


def test_a_prompt_behind_a_backlog_books_its_share_of_the_steps_it_fills() -> None:
    # On dp over 8 devices a 500-token prompt alone takes a whole step (every engine reads its weights); the
    # batching core packs queued prompts' chunks under one token budget, so 16 of them share one step.
    w = [msgspec.structs.replace(view("cpx-0", "nvidia-rubin-cpx", Role.PREFILL, model="qwen3-32b"), parallel="dp"),
         view("d-0", "amd-mi308x", Role.DECODE, model="qwen3-32b")]
    pol = make_policy("cost")
    ttfts = [d.predicted_ttft_s for _ in range(16) if (d := pol.place(req(500, 2, model="qwen3-32b"), w))]
    alone = ttfts[0]
    assert len(ttfts) == 16
    # the last waits for the first's step, 14 shares of a step and then its own: under 3x alone (booked as
    # steps of their own, 16x)
    assert ttfts[-1] < 3 * alone
    # a data-parallel `both` worker prefilling for a decoder packs its queue the same way
    w2 = [msgspec.structs.replace(w[0], role=Role.BOTH), w[1]]
    pol = make_policy("cost")
    both = [d.predicted_ttft_s for _ in range(16) if (d := pol.place(req(500, 2, model="qwen3-32b"), w2))]
    assert len(both) == 16 and both[-1] < 3 * both[0]
    # one engine over the 8 devices (tp): each prompt's own steps are booked, as its TTFT was measured
    w = [view("cpx-0", "nvidia-rubin-cpx", Role.PREFILL, model="qwen3-32b"), w[1]]
    pol = make_policy("cost")
    ttfts = [d.predicted_ttft_s for _ in range(16) if (d := pol.place(req(500, 2, model="qwen3-32b"), w))]
    assert ttfts[-1] == pytest.approx(16 * ttfts[0], rel=1e-6)
