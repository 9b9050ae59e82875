"""llm-d's predicted-latency routing: its online regressors, its SLO-headroom picker, its feedback hooks."""

import itertools
import math
import random

import pytest

from hetmesh.placement import REFUSED, RequestInfo, WorkerView, make_policy
from hetmesh.placement.llmd import LlmD
from hetmesh.placement.llmd_latency import MODELS, LlmDLatency
from hetmesh.protocol import Role
from hetmesh.sim import Slo, pool, simulate, synthetic


def view(wid: str, queue: int = 0, running: int = 0, used: int = 0, role: Role = Role.BOTH) -> WorkerView:
    return WorkerView(worker_id=wid, model="m", accelerator="nvidia-h100", vendor="nvidia", devices=1, role=role,
                      queue_depth=queue, running=running, max_batch=8, kv_blocks_total=100, kv_blocks_used=used,
                      block_size=16)


def req(rid: str, prompt: int = 512, cached: dict[str, int] | None = None) -> RequestInfo:
    return RequestInfo(request_id=rid, model="m", prompt_len=prompt, max_tokens=32, cached_blocks=cached or {},
                       block_size=16)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_regressor_learns_that_ttft_grows_with_the_queue(model: str) -> None:
    m = MODELS[model](3, quantile=0.9)
    rng = random.Random(1)
    for _ in range(600):
        q = rng.randrange(20)
        m.add((q, rng.random(), rng.random()), 0.05 + 0.1 * q + rng.gauss(0.0, 0.02))
    preds = [m.predict((q, 0.5, 0.5)) for q in range(20)]
    assert all(b >= a - 1e-9 for a, b in itertools.pairwise(preds))  # monotone in the queue
    assert preds[-1] - preds[0] > 1.5  # about 0.1 s per queued request
    for q in (2, 10, 17):  # the p90: the mean plus about 1.28 noise sigmas, within a tolerance
        assert preds[q] == pytest.approx(0.05 + 0.1 * q + 1.28 * 0.02, abs=0.12)


def train(p: LlmDLatency, n: int, slow: str, seed: int = 2) -> None:
    """n requests placed by p over pods fast and slow at random loads, each learned from: the slow pod's TTFT
    and TPOT ten times the fast one's at the same load."""
    rng = random.Random(seed)
    for i in range(n):
        views = [view("fast", queue=rng.randrange(6)), view("slow", queue=rng.randrange(6))]
        d = p.place(req(f"t{i}"), views)
        assert d is not None
        q = next(v.queue_depth for v in views if v.worker_id == d.decode_worker)
        k = 10.0 if d.decode_worker == slow else 1.0
        p.request_first_token(f"t{i}", k * (0.02 + 0.01 * q), 0.0)
        p.request_done(f"t{i}", d.decode_worker, d.decode_worker, None, k * 0.005, 0.0)


def test_it_routes_away_from_a_pod_it_learned_is_slow() -> None:
    p = LlmDLatency(ttft_slo_s=0.2, tpot_slo_s=0.02, per_pod=True, seed=3)
    train(p, 120, slow="slow")
    assert p.observed == 120 and not p.pending
    same = [view("fast", queue=2), view("slow", queue=2)]  # one load: only what it learned tells them apart
    fast = p.models[("ttft", ("pod", "fast"))].predict((0.0, 0.512, 2.0, 0.0, 0.0, 0.512))
    slow = p.models[("ttft", ("pod", "slow"))].predict((0.0, 0.512, 2.0, 0.0, 0.0, 0.512))
    assert slow > 5 * fast
    picks = [p.place(req(f"r{i}"), same) for i in range(200)]
    assert sum(d is not None and d.decode_worker == "fast" for d in picks) >= 190  # the rest: its 1% exploration


def test_a_pooled_model_cannot_tell_two_pods_of_one_load_apart() -> None:
    """llm-d's model is one per pool (one pod shape): pods under the same load get the same prediction."""
    p = LlmDLatency(ttft_slo_s=0.2, tpot_slo_s=0.02, seed=3)
    train(p, 120, slow="slow")
    m = p.models[("ttft", ("pool", "m", "both"))]
    assert ("ttft", ("pod", "slow")) not in p.models
    d = p.place(req("x"), [view("fast", queue=2), view("slow", queue=2)])
    assert d is not None and d.predicted_ttft_s == pytest.approx(m.predict((0.0, 0.512, 2.0, 0.0, 0.0, 0.512)))


def test_before_enough_samples_it_scores_as_llm_d_does() -> None:
    p = LlmDLatency(ttft_slo_s=1.0, tpot_slo_s=0.1, min_samples=10)
    ref = LlmD()
    views = [view("a", queue=3), view("b", queue=1), view("c", queue=0)]
    r = req("r0", cached={"a": 32})  # a holds the whole prompt
    assert p.place(r, views) == ref.place(r, views)
    assert p.cold == 1


def test_absurd_observations_train_nothing_and_unknown_ids_are_ignored() -> None:
    p = LlmDLatency()
    d = p.place(req("a"), [view("w")])
    assert d is not None
    p.request_first_token("a", math.nan, 1.0)
    p.request_done("a", "w", "w", -1.0, math.inf, 2.0)
    p.request_done("never-placed", "w", "w", 0.1, 0.01, 2.0)
    assert all(m.count == 0 for m in p.models.values()) and not p.pending


def test_a_sheddable_request_is_refused_when_no_pod_has_headroom_and_all_are_busy() -> None:
    p = LlmDLatency(ttft_slo_s=0.1, tpot_slo_s=0.01, sheddable=True, min_samples=1, seed=1)
    for i in range(5):  # every pod learned slow: 1 s TTFT
        d = p.place(req(f"t{i}"), [view("a"), view("b")])
        assert d is not None
        p.request_done(f"t{i}", d.decode_worker, d.decode_worker, 1.0, 0.05, 0.0)
    busy = [view("a", running=3), view("b", queue=1)]
    d = p.place(req("x"), busy)
    assert d is not None and d.mode == REFUSED
    d = p.place(req("y"), [view("a", running=3), view("b")])  # an idle pod: served there, late or not
    assert d is not None and d.decode_worker == "b"
    keep = LlmDLatency(ttft_slo_s=0.1, tpot_slo_s=0.01, min_samples=1, seed=1)
    keep.models = p.models
    d = keep.place(req("z"), busy)
    assert d is not None and d.mode != REFUSED  # not sheddable: still placed


def test_registered_with_its_options_checked() -> None:
    p = make_policy("llm_d_latency", ttft_slo_s=2.0, tpot_slo_s=0.1, per_pod=True, model="ridge")
    assert isinstance(p, LlmDLatency) and p.name == "llm_d_latency"
    with pytest.raises(ValueError, match="no option 'slo'"):
        make_policy("llm_d_latency", slo=2.0)
    for bad in ({"headroom": "middle"}, {"model": "xgb"}, {"quantile": 1.0}, {"min_samples": 0},
                {"ttft_slo_s": -1.0}):
        with pytest.raises(ValueError, match="llm_d_latency"):
            make_policy("llm_d_latency", **bad)


def test_the_simulator_reports_every_first_token_and_completion() -> None:
    ws = pool("w", 2, "nvidia-h100", model="llama-3.1-70b", devices=8, max_batch=32)
    t = synthetic(80, 4.0, input_mean=1000, output_mean=32, seed=1)
    p = make_policy("llm_d_latency", ttft_slo_s=2.0, tpot_slo_s=0.1)
    _, res = simulate(ws, p, t, slo=Slo(ttft_s=2.0, tpot_s=0.1))
    assert len(res.records) == len(t) and p.observed == len(t) and not p.pending
    assert p.models[("ttft", ("pool", "llama-3.1-70b", "both"))].count == len(t)
    assert p.cold < len(t)  # past its first samples the learned model placed
    assert any(r.predicted_ttft_s is not None for r in res.records)
