"""The online fit: it finds a worker's true speed from its step times, tracks drift, shrugs off outliers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetmesh.costmodel import CostModel, Efficiency, accelerator, model_spec
from hetmesh.costmodel.learn import FitBudget, Learner, StepLog, StepSample, WorkerKey, features, predict
from hetmesh.costmodel.truth import Truth
from hetmesh.placement import RequestInfo, WorkerView
from hetmesh.placement.cost import CostPolicy
from hetmesh.protocol import Role
from hetmesh.sim import Slo, pool, simulate, synthetic

PRIOR = Efficiency(compute=0.45, memory=0.6, overhead_s=0.008, per_seq_s=0.0002)
TRUE = Efficiency(compute=0.15, memory=0.2, overhead_s=0.024, per_seq_s=0.0006)  # 3x slower on every factor
KEY = WorkerKey("nvidia-h100", "llama-3.1-70b", 8, "tp")


def _cm(eff: Efficiency) -> CostModel:
    return CostModel(accelerator("nvidia-h100"), model_spec("llama-3.1-70b"), devices=8, efficiency=eff)


def _steps(cm: CostModel, n: int, rng: np.random.Generator, noise: float = 0.1) -> list[StepSample]:
    out = []
    for _ in range(n):
        new = int(rng.integers(16, 4096)) if rng.random() < 0.5 else 0
        nd = int(rng.integers(0 if new else 1, 64))
        ctx = nd * int(rng.integers(100, 4000))
        pairs = new * (new + 1) / 2
        t = cm.step_time_totals(new, int(new > 0), pairs, 0, nd, ctx) * rng.lognormal(0.0, noise)
        out.append(StepSample(new, int(new > 0), pairs, 0, nd, ctx, t))
    return out


def _error(learner: Learner, wid: str, test: list[StepSample]) -> float:
    f = features(_cm(PRIOR), test)
    y = np.array([s.seconds for s in test])
    return float(np.median(np.abs(predict(f, learner.fits[wid].theta) / y - 1.0)))


def test_learns_a_3x_wrong_prior_within_a_few_reports() -> None:
    rng = np.random.default_rng(1)
    truth, prior = _cm(TRUE), _cm(PRIOR)
    test = _steps(truth, 300, rng, noise=0.0)
    lr = Learner()
    lr.observe("w0", KEY, prior, [], 0.0)
    before = _error(lr, "w0", test)
    for i in range(10):
        lr.observe("w0", KEY, prior, _steps(truth, 8, rng), 0.5 * (i + 1))
    after = _error(lr, "w0", test)
    assert before > 0.5 and after < 0.08, (before, after)
    assert lr.speed("w0") == pytest.approx(1 / 3, rel=0.25)


def test_drift_is_relearned_and_outliers_do_not_poison_it() -> None:
    rng = np.random.default_rng(2)
    prior = _cm(PRIOR)
    lr = Learner()
    for i in range(20):
        lr.observe("w0", KEY, prior, _steps(prior, 32, rng), 0.5 * i)
    theta = lr.fits["w0"].theta.copy()
    # a GC pause, a preemption: a burst of steps 10x too long, and absurd reports
    burst = [StepSample(100, 1, 5050.0, 0, 10, 10_000, 5.0)] * 20
    bad = [StepSample(100, 1, 5050.0, 0, 10, 10_000, s) for s in (0.0, -1.0, math.nan, math.inf, 1e9)]
    lr.observe("w0", KEY, prior, burst + bad, 10.5)
    assert np.allclose(lr.fits["w0"].theta, theta, rtol=0.05)
    assert lr.fits["w0"].dropped >= len(bad)
    # the chip slows 2x: back within 15% in well under 30 s of engine time
    slow = _cm(Efficiency(compute=PRIOR.compute / 2, memory=PRIOR.memory / 2, overhead_s=2 * PRIOR.overhead_s,
                          per_seq_s=2 * PRIOR.per_seq_s))
    test = _steps(slow, 300, rng, noise=0.0)
    t = 11.0
    while _error(lr, "w0", test) > 0.15:
        lr.observe("w0", KEY, prior, _steps(slow, 32, rng), t)
        t += 0.5
        assert t < 11.0 + 30.0


def test_a_second_process_under_one_id_is_dropped_and_pooled_prior_seeds_new_workers() -> None:
    rng = np.random.default_rng(3)
    truth, prior = _cm(TRUE), _cm(PRIOR)
    lr = Learner()
    for i in range(10):
        lr.observe("w0", KEY, prior, _steps(truth, 16, rng), 0.5 * i, instance="run-a")
    fit = lr.fits["w0"].theta.copy()
    lr.observe("w0", KEY, prior, _steps(prior, 64, rng), 5.0, instance="impostor")
    assert lr.rejected_reports == 1 and np.array_equal(lr.fits["w0"].theta, fit)
    # a new worker of the same kind starts from what its pool learned, not from the catalog
    lr.observe("w1", KEY, prior, [], 5.0)
    assert lr.speed("w1") == 1.0  # no samples of its own yet
    assert np.allclose(lr.fits["w1"].theta, lr.fits["w0"].theta)
    assert lr.fits["w1"].theta[0] > 2.0 / PRIOR.compute


def test_step_log_is_bounded_and_spread() -> None:
    log = StepLog(cap=8)
    for i in range(1000):
        log.add(StepSample(i, 1, 0.0, 0, 0, 0, 0.01))
    got = log.drain()
    assert 1 <= len(got) <= 8
    assert got[-1].prefill_tokens > 850 and got[0].prefill_tokens < 150  # spread over all the steps taken
    assert log.drain() == []


@pytest.mark.slow
def test_simulated_slow_worker_is_priced_at_its_real_speed() -> None:
    """Two identical workers, one truly 2x slower than its prior: the learning cost policy serves within the SLO
    what the policy pricing both at the prior serves late; with a right prior, learning changes nothing."""
    kw = {"model": "llama-3.1-70b", "devices": 8, "max_batch": 64}
    trace = synthetic(n=600, rate=6.0, input_mean=2048, output_mean=128, seed=1)
    slo = Slo(ttft_s=2.0, tpot_s=0.1)
    right = pool("a", 2, "nvidia-h100", Role.BOTH, **kw)
    _, lres = simulate(right, "cost", trace, slo=slo)
    _, bres = simulate(right, "cost", trace, slo=slo, learn=False)
    assert [(r.prefill_worker, r.decode_worker, r.finish) for r in lres.records] == [
        (r.prefill_worker, r.decode_worker, r.finish) for r in bres.records]
    ws = pool("fast", 1, "nvidia-h100", **kw) + pool("slow", 1, "nvidia-h100", truth=Truth(slowdown=2.0), **kw)
    learned, _ = simulate(ws, "cost", trace, slo=slo)
    blind, _ = simulate(ws, "cost", trace, slo=slo, learn=False)
    assert learned["slo_attainment"] > 0.9 > blind["slo_attainment"]
    assert learned["goodput_tok_s"] > 1.5 * blind["goodput_tok_s"], (learned["goodput_tok_s"], blind["goodput_tok_s"])


def test_pooled_weights_each_kinds_fitted_workers_by_their_steps() -> None:
    from hetmesh.costmodel.learn import pooled
    from hetmesh.protocol import Role, WorkerStatus

    def ws(wid: str, accel: str, steps: int, compute: float) -> WorkerStatus:
        return WorkerStatus(worker_id=wid, model="m", accelerator=accel, role=Role.BOTH, engine="sim", devices=8,
                            queue_depth=0, running=0, max_batch=8, kv_blocks_used=0, kv_blocks_total=1,
                            heartbeat_age_s=0.0, fitted_steps=steps, cost_model="llama-3.1-70b",
                            efficiency={"compute": compute, "memory": 0.5, "overhead_s": 0.01, "per_seq_s": 0.0}
                            if steps else {})

    got = pooled([ws("a", "nvidia-h100", 300, 0.2), ws("b", "nvidia-h100", 100, 0.4), ws("c", "nvidia-h100", 0, 0.9),
                  ws("d", "amd-mi300x", 50, 0.3)])
    assert set(got) == {"nvidia-h100/llama-3.1-70b", "amd-mi300x/llama-3.1-70b"}
    eff, steps, ids = got["nvidia-h100/llama-3.1-70b"]
    assert steps == 400 and ids == ["a", "b"]
    assert eff.compute == pytest.approx(1 / (0.75 / 0.2 + 0.25 / 0.4))  # time multipliers averaged, not speeds


def test_a_deferred_report_waits_for_the_next_fit_thinned_to_the_cap() -> None:
    rng = np.random.default_rng(5)
    truth, prior = _cm(TRUE), _cm(PRIOR)
    lr = Learner(cap=16)
    lr.observe("w0", KEY, prior, _steps(truth, 8, rng), 0.0)
    assert lr.fitted("w0") and lr.fits["w0"].samples == 8
    for i in range(3):  # kept, not fitted: the fit does not move
        theta = lr.fits["w0"].theta.copy()
        assert lr.observe("w0", KEY, prior, _steps(truth, 8, rng), 2.0 * (i + 1), fit=False) is None
        assert np.array_equal(lr.fits["w0"].theta, theta) and lr.fits["w0"].samples == 8
    lr.observe("w0", KEY, prior, _steps(truth, 8, rng), 8.0)  # 32 waiting steps thinned to the cap, then fitted
    assert lr.fits["w0"].samples == 8 + 16
    lr.forget("w0")
    lr.observe("w0", KEY, prior, _steps(truth, 4, rng), 10.0, fit=False)
    assert not lr.fitted("w0")


def test_fit_budget_earns_a_share_of_other_cpu_and_a_floor_and_bounds_its_debt() -> None:
    b = FitBudget(share=0.1, floor=0.01, burst_s=0.05)
    b.tick(10.0, 100.0)
    b.credit = 0.0
    b.tick(10.2, 101.0)  # 0.2 s of other CPU and 1 s of wall: 0.02 + 0.01
    assert b.credit == pytest.approx(0.03) and b.ok
    b.spend(0.5)  # a storm of first fits: the debt stops at burst_s
    assert b.credit == pytest.approx(-0.05) and not b.ok
    b.tick(10.8, 101.0)  # the fit's own 0.5 s earns nothing; 0.1 s of other CPU earns 0.01
    assert b.credit == pytest.approx(-0.04)
    b.tick(100.0, 1000.0)  # idle credit is capped
    assert b.credit == pytest.approx(0.05)
    with pytest.raises(ValueError, match="share"):
        FitBudget(share=-1.0)


def test_degraded_compares_against_the_median_of_the_other_peers() -> None:
    rng = np.random.default_rng(6)
    lr = Learner()
    speeds = {"w0": 1.0, "w1": 1.0, "w2": 1.1, "w3": 2.5}
    for wid, slow in speeds.items():
        eff = Efficiency(compute=TRUE.compute / slow, memory=TRUE.memory / slow, overhead_s=TRUE.overhead_s * slow,
                         per_seq_s=TRUE.per_seq_s * slow)
        for i in range(10):
            lr.observe(wid, KEY, _cm(TRUE), _steps(_cm(eff), 16, rng, noise=0.02), 0.5 * i)
    for wid in speeds:
        others = [lr.typical_s[w] for w in speeds if w != wid]
        assert lr.degraded(wid) == pytest.approx(lr.typical_s[wid] / float(np.median(others)))
    assert lr.degraded("w3") > lr.degraded_ratio > lr.degraded("w2")


def test_first_token_gaps_are_learned_robustly_and_priced_into_ttft() -> None:
    lr = Learner(cap=8)
    assert lr.first_token_gap("w0") == 0.0
    assert lr.observe_gaps("w0", [0.5, 0.5]) == 0.0  # too few yet
    assert lr.observe_gaps("w0", [0.004] * 3 + [0.005, 0.006, 5.0]) == pytest.approx(0.0055)  # stalled ones move it little
    lr.observe_gaps("w0", [math.nan, -1.0, 1e6])
    assert lr.dropped_gaps == 3 and lr.first_token_gap("w0") == pytest.approx(0.0055)
    lr.observe_gaps("w0", [0.010] * 8)  # the newest `cap` only
    assert lr.first_token_gap("w0") == pytest.approx(0.010)

    def view(wid: str) -> WorkerView:
        return WorkerView(worker_id=wid, model="m", accelerator="nvidia-h100", vendor="nvidia", devices=8,
                          role=Role.BOTH, queue_depth=0, running=0, max_batch=64, kv_blocks_total=10_000,
                          kv_blocks_used=0, block_size=16)

    pol = CostPolicy(models={"m": "llama-3.1-70b"}, admission_margin=0.0)
    views = [view("a"), view("b")]

    def ttfts() -> dict[str, float]:
        d = pol.place(RequestInfo(request_id="r", model="m", prompt_len=512, max_tokens=1, arrival=0.0), views)
        assert d is not None
        return {p: t for p, _, t, _, _ in d.candidates}

    base = ttfts()
    pol = CostPolicy(models={"m": "llama-3.1-70b"}, admission_margin=0.0)  # no bookings left by the first place
    pol.observe_gaps(views[0], [0.25] * 8)
    got = ttfts()
    assert got["a"] == pytest.approx(base["a"] + 0.25) and got["b"] == pytest.approx(base["b"])
    pol.forget("a")
    assert pol._gap[pol._slots["a"]] == 0.0
