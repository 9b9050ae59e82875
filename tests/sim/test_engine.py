"""The simulator against hand-worked timelines, conservation laws and the real policy objects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetmesh.costmodel import CostModel, accelerator, link_bandwidth, model_spec
from hetmesh.placement import RoundRobin
from hetmesh.protocol import Role
from hetmesh.sim import ClosedLoop, SimConfig, Simulator, Trace, TraceRequest, pool, simulate, synthetic
from hetmesh.sim.__main__ import main
from hetmesh.sim.traces import load_azure, load_mooncake

DATA = Path(__file__).resolve().parents[1] / "data"  # the first rows of data/ traces
ROOT = Path(__file__).resolve().parents[2]


def _cm(acc: str) -> CostModel:
    return CostModel(accelerator(acc), model_spec("deepseek-r1"), devices=8)


def test_one_aggregated_request_follows_the_cost_model() -> None:
    n, out = 3000, 5
    summary, res = simulate(pool("x", 1, "amd-mi300x"), "round_robin", Trace([TraceRequest(1.0, n, out)]))
    (r,) = res.records
    cm = _cm("amd-mi300x")
    assert r.mode == "aggregated" and r.arrival == 1.0
    assert r.ttft == pytest.approx(cm.prefill_time(n), rel=1e-9)
    decode = sum(cm.decode_step_time(1, n + k) for k in range(1, out))
    assert r.finish - r.first_token == pytest.approx(decode, rel=1e-9)
    assert summary["requests"] == 1 and summary["kv_transfer_gb"] == 0


def test_one_disaggregated_request_pays_the_kv_transfer() -> None:
    n, out = 3000, 4
    workers = pool("p", 1, "amd-mi300x", Role.PREFILL) + pool("d", 1, "amd-mi308x", Role.DECODE)
    cfg = SimConfig(link_latency_s=0.0)
    summary, res = simulate(workers, "least_loaded", Trace([TraceRequest(0.0, n, out)]), cfg)
    (r,) = res.records
    p, d = _cm("amd-mi300x"), _cm("amd-mi308x")
    assert (r.mode, r.prefill_worker, r.decode_worker) == ("disaggregated", "p-0", "d-0")
    assert r.ttft == pytest.approx(p.prefill_time(n), rel=1e-9)
    xfer = n * p.kv_bytes_per_token() / link_bandwidth(p.accel, 8, d.accel, 8)
    decode = sum(d.decode_step_time(1, n + k) for k in range(1, out))
    assert r.finish - r.first_token == pytest.approx(xfer + decode, rel=1e-9)
    assert summary["kv_transfer_gb"] == pytest.approx(n * 70_272 / 1e9)


def test_every_request_finishes_and_every_token_is_counted() -> None:
    workers = pool("a", 2, "nvidia-h100", model="llama-3.1-70b") + \
        pool("p", 1, "nvidia-rubin-cpx", Role.PREFILL, model="llama-3.1-70b")
    trace = synthetic(300, rate=20.0, input_mean=1500, output_mean=120, seed=3)
    summary, res = simulate(workers, "least_loaded", trace)
    assert summary["requests"] == 300 and summary["rejected"] == 0
    assert all(r.first_token >= r.arrival and r.finish >= r.first_token for r in res.records)
    decoded = sum(w.decode_tokens for w in res.workers)
    assert decoded == sum(r.output_len - 1 for r in res.records)  # the first token comes from the prefill
    prefilled = sum(w.prefill_tokens for w in res.workers)
    assert prefilled == sum(r.input_len - r.cached_tokens for r in res.records)


def test_prefix_hits_skip_prefill_on_the_worker_that_holds_them() -> None:
    shared = tuple(range(8))  # 8 blocks of 512 tokens
    reqs = [TraceRequest(2.0 * i, 4096 + 100, 8, shared) for i in range(6)]  # each one alone on its worker
    summary, res = simulate(pool("a", 3, "amd-mi300x"), "prefix_aware", Trace(reqs))
    assert summary["prefix_hit_rate"] > 0.8 * 5 / 6
    later = res.records[1:]
    assert {r.decode_worker for r in later} == {res.records[0].decode_worker}
    assert all(r.cached_tokens == 4096 for r in later)
    assert later[0].ttft == pytest.approx(_cm("amd-mi300x").prefill_time(100, cached_tokens=4096), rel=1e-9)
    assert later[0].ttft < res.records[0].ttft / 2


def test_closed_loop_keeps_its_concurrency() -> None:
    n = 12
    _, res = simulate(pool("a", 2, "amd-mi300x"), "least_loaded",
                      ClosedLoop(concurrency=n, total=120, input_len=[500, 3000], output_len=[20, 200]))
    assert len(res.records) == 120
    events = sorted([(r.arrival, 1) for r in res.records] + [(r.finish, -1) for r in res.records],
                    key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    assert peak == n


def test_kv_capacity_bounds_the_batch() -> None:
    # room for exactly 3 requests of 1000 + 100 tokens: the rest must wait
    worker = pool("a", 1, "amd-mi300x", kv_tokens=3300, max_batch=64)
    reqs = [TraceRequest(0.0, 1000, 100) for _ in range(9)]
    _, res = simulate(worker, "round_robin", Trace(reqs))
    spans = [(r.arrival + r.ttft, r.finish) for r in res.records]
    for t, _ in spans:
        assert sum(1 for a, b in spans if a <= t < b) <= 3


def test_runs_the_scheduler_policy_object_it_is_given() -> None:
    pol = RoundRobin()
    workers = pool("a", 3, "amd-mi308x")
    res = Simulator(workers, pol).run(Trace([TraceRequest(float(i), 100, 2) for i in range(6)]))
    assert [r.decode_worker for r in res.records] == ["a-0", "a-1", "a-2"] * 2
    assert res.policy == "round_robin"


def test_trace_loaders_read_the_shared_samples() -> None:
    mc = load_mooncake(DATA / "mooncake_head50.jsonl", limit=50)
    assert len(mc) == 50 and mc.block_tokens == 512
    r0 = mc.requests[0]
    assert (r0.arrival, r0.input_len, r0.output_len, len(r0.hash_ids)) == (0.0, 40160, 6, 79)
    az = load_azure(DATA / "azure_code_head20.csv", limit=20)
    assert len(az) == 20 and az.requests[0].arrival == 0.0 and az.requests[0].input_len == 4808
    assert az.requests[1].arrival == pytest.approx(0.052)


def test_synthetic_generators() -> None:
    t = synthetic(2000, rate=10.0, input_mean=1000, prefix_groups=4, prefix_tokens=1024, seed=1)
    assert len(t) == 2000
    assert 180 < t.requests[-1].arrival < 220  # 2000 requests at 10/s
    firsts = {r.hash_ids[0] for r in t.requests if len(r.hash_ids) >= 2}
    assert len(firsts) <= 4
    b = synthetic(2000, rate=10.0, arrival="bursty", burst_factor=4.0, burst_period_s=20.0, seed=1)
    gaps_hi = [y.arrival - x.arrival for x, y in zip(b.requests, b.requests[1:], strict=False)
               if x.arrival % 20.0 < 10.0]
    gaps_lo = [y.arrival - x.arrival for x, y in zip(b.requests, b.requests[1:], strict=False)
               if x.arrival % 20.0 >= 10.0]
    assert sum(gaps_lo) / len(gaps_lo) > 3 * sum(gaps_hi) / len(gaps_hi)  # rates differ by 4x


def test_cli_writes_results_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    rc = main(["--cluster", str(ROOT / "ops" / "clusters" / "default.toml"), "--policy", "round_robin,least_loaded",
               "--requests", "200", "--rate", "20", "--input", "600", "--output", "50", "--quiet",
               "--out", str(out), "--plots", str(tmp_path / "p")])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [r["policy"] for r in data["runs"]] == ["round_robin", "least_loaded"]
    assert all(r["requests"] == 200 for r in data["runs"])
    assert (tmp_path / "p_latency_cdf.png").stat().st_size > 1000


@pytest.mark.parametrize("order", ["fcfs", "shortest"])
def test_prefill_order_decides_which_queued_prompt_is_served_first(order: str) -> None:
    # a 6000-token prompt is mid-prefill (4096-token steps) when a second long one and a short one queue
    trace = Trace([TraceRequest(0.0, 6000, 2), TraceRequest(0.001, 6000, 2), TraceRequest(0.002, 1000, 2)])
    _, res = simulate(pool("x", 1, "amd-mi300x", step_tokens=4096, prefill_order=order), "round_robin", trace)
    first, long2, short = sorted(res.records, key=lambda r: r.arrival)
    # a started prompt keeps going (with `shortest` the short one finishes in the same step)
    assert first.first_token < long2.first_token and first.first_token <= short.first_token
    if order == "fcfs":
        assert long2.first_token < short.first_token
    else:
        assert short.first_token < long2.first_token


def test_an_unknown_prefill_order_is_refused() -> None:
    with pytest.raises(ValueError, match="prefill_order"):
        Simulator(pool("x", 1, "amd-mi300x", prefill_order="random"), RoundRobin()).run(Trace([TraceRequest(0, 10, 2)]))
