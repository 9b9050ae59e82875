"""The anchor policies and SLO-aware admission driven by the simulator: the same place() calls the live
scheduler makes, over batching cores. Properties of the rules, not figures of one trace."""

from pathlib import Path

from hetmesh import config
from hetmesh.protocol import Role
from hetmesh.sim import ClosedLoop, SimConfig, Slo, Trace, pool, simulate, synthetic, workers_from_config

KW = {"model": "llama-3.1-70b", "devices": 8, "max_batch": 64}
STATIC = pool("p", 1, "nvidia-h100", Role.PREFILL, **KW) + pool("d", 2, "nvidia-h100", Role.DECODE, **KW)
BOTH = pool("w", 3, "nvidia-h100", **KW)


def trace(n: int = 120, rate: float = 4.0) -> Trace:
    return synthetic(n, rate, input_mean=3000, output_mean=64, prefix_groups=4, prefix_tokens=2048, seed=3)


def test_llmd_threshold_decides_who_prefills() -> None:
    t = trace()
    never, _ = simulate(STATIC, "llm_d", t, non_cached_tokens=0)  # 0 disables the P/D decider
    assert never["modes"] == {"aggregated": len(t)} and never["pools"]["p"]["prefill_tokens"] == 0
    always, _ = simulate(STATIC, "llm_d", t, non_cached_tokens=1)
    assert always["modes"] == {"disaggregated": len(t)} and always["pools"]["d"]["prefill_tokens"] == 0
    some, res = simulate(STATIC, "llm_d", t, non_cached_tokens=2048)
    assert 0 < some["modes"].get("aggregated", 0) < len(t)
    # a prompt under the threshold can never be split, whatever the caches hold
    assert all(r.mode == "aggregated" for r in res.records if r.input_len < 2048)


def test_dynamo_isl_bounding_keeps_cached_requests_local() -> None:
    t = trace()
    split, _ = simulate(STATIC, "dynamo", t)
    assert split["modes"] == {"disaggregated": len(t)}
    cond, _ = simulate(STATIC, "dynamo", t, conditional="isl_bounding")
    assert 0 < cond["modes"].get("aggregated", 0) < len(t)  # warm prefixes stay on the decode worker
    agg, _ = simulate(BOTH, "dynamo", t)
    assert agg["modes"] == {"aggregated": len(t)} and agg["prefix_hit_rate"] > 0


def test_admission_refuses_under_overload_and_keeps_the_served_within_slo() -> None:
    slo = Slo(ttft_s=2.0, tpot_s=0.1)
    t = trace(300, rate=40.0)  # far past what three H100 servers prefill
    off, _ = simulate(BOTH, "cost", t, slo=slo, admission_margin=0.0)
    on, _ = simulate(BOTH, "cost", t, slo=slo, admission_margin=1.0)
    assert off["rejected"] == 0 and on["refused"] == on["rejected"] > 0
    assert on["requests"] + on["rejected"] == len(t)
    assert on["slo_attainment"] > off["slo_attainment"]


def test_a_refused_request_is_retried_after_its_retry_after_with_its_clock_running() -> None:
    """As the openai client retries a 429: the same request, after the refusal's Retry-After; its TTFT counts
    from the first send (what its user waits), and after the last retry it is rejected."""
    slo = Slo(ttft_s=2.0, tpot_s=0.1)
    t = trace(300, rate=40.0)
    # refused at once (no hold): a retry after Retry-After may still make its SLO, counted from its first send
    once, _ = simulate(BOTH, "cost", t, slo=slo, admission_margin=1.0, admission_hold_s=0.0)
    again, res = simulate(BOTH, "cost", t, SimConfig(client_retries=2), slo=slo, admission_margin=1.0,
                          admission_hold_s=0.0)
    assert once["retried"] == 0 and again["retried"] > 0
    assert again["requests"] > once["requests"] and again["requests"] + again["rejected"] == len(t)
    assert again["refused"] == again["rejected"] <= once["rejected"]
    sent = {r.arrival for r in t.requests}
    assert all(r.arrival in sent for r in res.records)  # timed from the first send, not the retry
    # a retry too late for its SLO is refused, not served: what is late is the TTFT predictions' error alone
    # (a clock restarted at each retry would serve many retries late)
    assert sum(r.ttft > slo.ttft_s for r in res.records) <= len(res.records) // 100


def test_no_admitted_request_waits_past_twice_its_ttft_slo_while_others_are_refused() -> None:
    """1.5-2x overload of the default cluster's three workers (an H100 serving both roles, a Rubin CPX prefilling
    for a Rubin VR200), streams of 512-2,048 tokens, clients that retry a 429 as the openai client does (twice,
    after Retry-After), holds on: the mesh refuses some, and no request it serves waits past twice its TTFT SLO
    from its first send (the retries' waits included)."""
    fleet = workers_from_config(config.load(str(Path(__file__).parents[2] / "ops" / "clusters" / "default.toml")))
    slo = Slo(ttft_s=2.0, tpot_s=0.1)
    for rate, seed in ((9.0, 1), (12.0, 2)):
        t = synthetic(500, rate, input_mean=256, output_mean=1280, input_dist="uniform", output_dist="uniform",
                      seed=seed)
        s, res = simulate(fleet, "cost", t, SimConfig(client_retries=2), slo=slo)
        assert s["refused"] > 0 and s["retried"] > 0 and s["requests"] + s["rejected"] == len(t)
        late = sorted(round(r.ttft, 2) for r in res.records if r.ttft > 2 * slo.ttft_s)
        assert not late, (rate, late)


def test_a_refusal_held_by_the_scheduler_is_placed_again_when_the_burst_is_over() -> None:
    """Short outputs behind long prompts under a tight TPOT SLO: refusals are mostly for TPOT, a burst of prefill
    beside the decodes; held (Decision.hold_s) and placed again, more requests are served, none of them later
    than its clock allows (TTFT counted from its arrival), and goodput does not drop."""
    t = synthetic(300, 8.0, input_mean=3000, output_mean=16, prefix_groups=4, prefix_tokens=2048, seed=3)
    slo = Slo(ttft_s=2.0, tpot_s=0.04)
    at_once, _ = simulate(BOTH, "cost", t, slo=slo, admission_hold_s=0.0)
    held, res = simulate(BOTH, "cost", t, slo=slo)
    assert at_once["held"] == 0 and at_once["rejected"] > 0 and held["held"] > 0
    assert held["requests"] > at_once["requests"] and held["rejected"] < at_once["rejected"]
    assert held["requests"] + held["rejected"] == len(t)
    assert held["goodput_tok_s"] >= at_once["goodput_tok_s"]
    sent = {r.arrival for r in t.requests}
    assert all(r.arrival in sent for r in res.records)


def test_a_refused_closed_loop_client_backs_off_instead_of_cascading() -> None:
    """Without the back-off each refusal would send the client's next request at the same instant, against the
    same backlog: nearly every request after the first round would be refused at once (3 of 200 served)."""
    loop = ClosedLoop(concurrency=16, total=200, input_len=3000, output_len=32, seed=1)
    s, _ = simulate(pool("w", 1, "nvidia-h100", **KW), "cost", loop, slo=Slo(ttft_s=2.0, tpot_s=0.1),
                    admission_margin=1.0)
    assert s["refused"] > 0  # 16 clients of 3000-token prompts overload one server
    assert s["requests"] > 16  # more than the first round: clients came back after backing off
    assert s["requests"] + s["rejected"] == 200
