"""The live planner's pure parts: the scheduler's demand window, the fleet and demand the planner
service builds from the scheduler's reports, and which role switches it sends within the cap."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from hetmesh import config
from hetmesh.planner import Move, plan
from hetmesh.planner.live import DemandWindow, demand, fleet, plan_models, role_moves, to_send
from hetmesh.protocol import ModelDemandStats, Role, WorkerStatus
from tests.clusters import cluster_toml, group, load_cluster, model


def cluster(**tables: dict[str, object]) -> str:
    """One model on three H100 workers; `tables`: more of the file (e.g. planner={...})."""
    return cluster_toml(scheduler={"ttft_slo_s": 2.0, "tpot_slo_s": 0.1}, **tables,
                        models=[model("m", spec="llama-3.1-8b")], workers=[group("h", "m", "nvidia-h100", count=3)])


@pytest.fixture
def cfg(tmp_path: Path) -> config.ClusterConfig:
    return load_cluster(tmp_path, cluster())


def worker(wid: str, role: Role = Role.BOTH, model: str = "m", **kw: object) -> WorkerStatus:
    return WorkerStatus(worker_id=wid, model=model, accelerator="nvidia-h100", role=role, engine="sim", devices=1,
                        queue_depth=0, running=0, max_batch=64, kv_blocks_used=0, kv_blocks_total=100,
                        heartbeat_age_s=0.0, **kw)  # type: ignore[arg-type]


def test_window_rates_means_and_prefix_share() -> None:
    w = DemandWindow(10.0, {"m": (1.0, 0.1)})
    for i in range(5):
        w.submitted(f"a{i}", "m", 100.0 + i, prompt_tokens=100, max_tokens=50, cached_tokens=40)
    w.submitted("b0", "n", 101.0, prompt_tokens=30, max_tokens=8)
    w.finished("a0", 102.5, completion_tokens=20)  # 2.5 s <= 1 + 19 x 0.1: within
    w.finished("a1", 106.0, completion_tokens=20)  # 5 s: late
    w.finished("zzz", 104.0, completion_tokens=99)  # never submitted here: ignored
    (m, n) = w.report(106.5)
    assert (m.model, m.requests, m.rate) == ("m", 5, 0.5)
    assert (m.prompt_mean, m.output_mean, m.max_tokens_mean, m.prefix_hit) == (100.0, 20.0, 50.0, 0.4)
    assert m.slo_attainment == 0.5
    assert (n.requests, n.output_mean, n.slo_attainment, n.prefix_hit) == (1, 0.0, None, 0.0)  # no SLO known


def test_window_slo_attainment_from_first_token_and_time_scale() -> None:
    """A P/D request's first token (its prefill's Finished) is judged against the TTFT SLO and the rest
    against the TPOT SLO; latencies are wall seconds x time_scale; aborts and errors are not judged
    (the request may go on elsewhere) and keep it open."""
    w = DemandWindow(100.0, {"m": (1.0, 0.1)}, time_scale=2.0)
    for rid in ("late-first", "ok", "slow-decode", "moved"):
        w.submitted(rid, "m", 0.0, prompt_tokens=10, max_tokens=11)
    w.first_token("late-first", 0.6)  # 1.2 s engine time > 1 s: a miss though the end is early
    w.finished("late-first", 0.7, 11)
    w.first_token("ok", 0.4)
    w.first_token("ok", 0.45)  # only the first one counts
    w.finished("ok", 0.9, 11)  # TTFT 0.8 s, TPOT (1.8 - 0.8) / 10 = 0.1 s
    w.first_token("slow-decode", 0.1)
    w.finished("slow-decode", 0.7, 11)  # e2e 1.4 s is within 1 + 10 x 0.1, but TPOT 0.12 s is not
    w.finished("moved", 0.3, 4, "abort")  # handed over: not judged, still open
    (m,) = w.report(1.0)
    assert m.slo_attainment == 1 / 3 and m.output_mean == 11.0
    w.finished("moved", 0.8, 11)  # the continuation ended: 1.6 s <= 2 s
    assert w.report(1.0)[0].slo_attainment == 0.5
    with pytest.raises(ValueError):
        DemandWindow(1.0, time_scale=0)


def test_window_forgets_what_fell_out() -> None:
    w = DemandWindow(10.0)
    w.submitted("old", "m", 0.0, 10, 10)
    w.submitted("new", "m", 15.0, 30, 10)
    w.finished("old", 12.0, 5)  # finished inside the window: counted though it arrived before it
    (m,) = w.report(20.0)
    assert (m.requests, m.prompt_mean, m.output_mean) == (1, 30.0, 5.0)
    assert w.report(40.0) == []
    w.finished("new", 41.0, 7)  # still remembered as open (FORGET_AFTER_WINDOWS)
    assert w.report(42.0)[0].output_mean == 7.0
    with pytest.raises(ValueError):
        DemandWindow(0)


def test_fleet_leaves_out_moving_draining_and_other_models(cfg: config.ClusterConfig) -> None:
    ws = [worker("h-0"), worker("h-1", moving_to="prefill"), worker("h-2", draining=True),
          worker("h-0x", model="m"), worker("h-0", model="other")]
    groups = fleet(ws, cfg, "m")
    assert [g.name for g in groups] == ["h-0"]  # h-0x is in no group of the cluster file
    assert (groups[0].count, groups[0].role, groups[0].server_ids()) == (1, Role.BOTH, ["h-0-0"])
    # the layout it heartbeats (a ModelSwitch may have changed it), not the cluster file's
    assert groups[0].parallel == "tp" and fleet([worker("h-0", parallel="dp")], cfg, "m")[0].parallel == "dp"
    assert groups[0].layouts == ("tp", "ep", "dp")  # a sim worker: any layout; vLLM over 8 devices: tp only
    vllm = config.ClusterConfig(models=cfg.models, workers=[msgspec.structs.replace(cfg.workers[0], engine="vllm",
                                                                                     devices=8)])
    assert fleet([worker("h-0")], vllm, "m")[0].layouts == ("tp",)


def test_demand_from_stats(cfg: config.ClusterConfig) -> None:
    s = ModelDemandStats(model="m", requests=10, rate=2.0, prompt_mean=500, output_mean=0.0, max_tokens_mean=64,
                         prefix_hit=0.2)
    d = demand(s, cfg)
    assert d is not None and (d.rate, d.input_mean, d.output_mean, d.ttft_slo_s, d.tpot_slo_s) == (2.0, 500, 64, 2, .1)
    assert demand(msg_replace(s, model="nope"), cfg) is None  # unknown model: garbage in, nothing planned
    assert demand(msg_replace(s, requests=0), cfg) is None
    cfg.mesh.time_scale = 4.0  # a sim mesh 4x faster than wall time: 2 arrivals per wall s are 0.5 per engine s
    assert getattr(demand(s, cfg), "rate", None) == 0.5


def msg_replace(s: ModelDemandStats, **kw: object) -> ModelDemandStats:
    import msgspec

    return msgspec.structs.replace(s, **kw)  # type: ignore[arg-type]


def test_to_send_caps_the_moving_share() -> None:
    mv = [(f"w{i}", Role.PREFILL, Move(f"w{i}-0", "role", "a", "b", float(10 - i))) for i in range(6)]
    assert [m[0] for m in to_send(mv, 10, 0, 0.25)] == ["w5", "w4"]  # shortest first, 2 of 10
    assert [m[0] for m in to_send(mv, 10, 1, 0.25)] == ["w5"]  # one already moving
    assert to_send(mv, 10, 3, 0.25) == []
    assert len(to_send(mv, 2, 0, 0.1)) == 1  # at least one worker may move
    # w5 moved 30 s ago, w4 70 s ago: with a 60 s horizon w5 settles first, w4 may move again
    assert [m[0] for m in to_send(mv, 10, 0, 0.25, {"w5": 70.0, "w4": 30.0}, now=100.0, settle_s=60.0)] == ["w4", "w3"]


def test_plan_models_gives_role_moves_of_known_workers(cfg: config.ClusterConfig) -> None:
    """A real plan per model over the live workers: every move it asks for is a role switch of one of them."""
    stats = [ModelDemandStats(model="m", requests=600, rate=20.0, prompt_mean=4000, output_mean=400,
                              max_tokens_mean=400, prefix_hit=0.0)]
    ws = [worker("h-0", Role.PREFILL), worker("h-1", Role.PREFILL), worker("h-2", Role.PREFILL)]
    plans = plan_models(stats, ws, cfg, lambda g, d: plan(g, d, horizon_s=3600, check_duration_s=30, refine=0))
    assert set(plans) == {"m"}
    p = plans["m"]
    assert {a.server for a in p.assignments} == {"h-0-0", "h-1-0", "h-2-0"}
    moves = role_moves(p)
    # all-prefill serves nothing (no decode): the plan must move someone, and only by role
    assert moves and all(w in {"h-0", "h-1", "h-2"} and r != Role.PREFILL for w, r, _ in moves)
    assert plan_models(stats, [], cfg, lambda g, d: plan(g, d)) == {}


def test_role_moves_only_what_a_live_worker_can_do() -> None:
    from hetmesh.planner import Assignment, Plan

    a = [Assignment("w1-0", "w1", "nvidia-h100", 1, "m", Role.DECODE, "dp"),  # one device: dp is tp
         Assignment("w8-0", "w8", "nvidia-h100", 8, "m", Role.DECODE, "dp"),  # eight: a real layout change
         Assignment("w2-0", "w2", "nvidia-h100", 1, "n", Role.BOTH, "tp"),  # another model: a reload
         Assignment("w3-0", "w3", "nvidia-h100", 1, "m", Role.PREFILL, "tp")]
    mv = [Move("w1-0", "reload", "m/prefill/tp", "m/decode/dp", 6.0), Move("w8-0", "reload", "m/prefill/tp",
          "m/decode/dp", 9.0), Move("w2-0", "reload", "m/both/tp", "n/both/tp", 9.0),
          Move("w3-0", "role", "m/both/tp", "m/prefill/tp", 2.0)]
    p = Plan(assignments=a, moves=mv, chosen="x", predicted={}, candidates=[], served={}, headroom=0.0)
    assert [(w, r, m.change) for w, r, m in role_moves(p)] == [("w1", Role.DECODE, "role"),
                                                               ("w3", Role.PREFILL, "role")]


def test_hetmesh_status_shows_role_and_move() -> None:
    from rich.console import Console

    from hetmesh.cli.__main__ import table
    from hetmesh.protocol import SchedulerStatus

    st = SchedulerStatus(instance="s", policy="cost", workers=["a", "b", "c"], details=[
        worker("a", Role.BOTH, moving_to="prefill", draining=True), worker("b", Role.DECODE, draining=True),
        worker("c", Role.PREFILL)])
    con = Console(width=200, record=True)
    con.print(table(st))
    lines = {ln.split("│")[1].strip(): ln for ln in con.export_text().splitlines() if ln.count("│") > 3}
    assert "both -> prefill" in lines["a"] and "decode (draining)" in lines["b"]
    assert "prefill" in lines["c"] and "->" not in lines["c"] and "draining" not in lines["c"]


def test_merge_scheduler_replicas() -> None:
    from hetmesh.planner.live import merge

    a = [ModelDemandStats(model="m", requests=3, rate=0.3, prompt_mean=100, output_mean=10, max_tokens_mean=20,
                          prefix_hit=0.5, slo_attainment=1.0)]
    b = [ModelDemandStats(model="m", requests=1, rate=0.1, prompt_mean=300, output_mean=30, max_tokens_mean=40,
                          prefix_hit=0.0),
         ModelDemandStats(model="n", requests=0, rate=0.0, prompt_mean=0, output_mean=5, max_tokens_mean=0,
                          prefix_hit=0.0)]
    m, n = merge([a, b])
    assert (m.requests, round(m.rate, 9), m.prompt_mean, m.output_mean, m.max_tokens_mean) == (4, 0.4, 150, 15, 25)
    assert m.prefix_hit == 150 / 600 and m.slo_attainment == 1.0
    assert (n.requests, n.prompt_mean, n.slo_attainment) == (0, 0.0, None)
    assert merge([a]) == a


def test_forecast_last_and_trend() -> None:
    from hetmesh.planner.live import forecast

    a = [ModelDemandStats(model="m", requests=10, rate=1.0, prompt_mean=100, output_mean=10, max_tokens_mean=10,
                          prefix_hit=0.2)]
    b = [msg_replace(a[0], rate=2.0, prefix_hit=0.7), msg_replace(a[0], model="n", rate=3.0)]
    assert forecast([a, b], "last") == b and forecast([], "trend") == []
    m, n = forecast([a, b], "trend")
    assert (m.rate, m.prefix_hit, m.prompt_mean) == (3.0, 1.0, 100.0)  # 0.2 -> 0.7 -> 1.2, a share: 1
    assert n.rate == 6.0  # no arrivals in the first round, 3/s in the second
    assert forecast([b, [msg_replace(a[0], rate=0.5)]], "trend")[0].rate == 0.0  # 2 -> 0.5 -> -1: none
    with pytest.raises(ValueError):
        forecast([a, b], "crystal-ball")


def test_config_checks_the_forecast_option(tmp_path: Path) -> None:
    assert load_cluster(tmp_path, cluster(planner={"forecast": "trend"})).planner.forecast == "trend"
    with pytest.raises(ValueError, match=r"planner\.forecast"):
        load_cluster(tmp_path, cluster(planner={"forecast": "crystal-ball"}))


def test_window_counts_refused_requests_as_demand_and_misses() -> None:
    """Turned away at admission: still demand (the planner must see the load it cannot serve) and a miss."""
    w = DemandWindow(10.0, {"m": (1.0, 0.1)})
    w.submitted("a", "m", 1.0, prompt_tokens=100, max_tokens=8)
    w.finished("a", 1.5, 8)
    w.refused("m", 2.0, prompt_tokens=300, max_tokens=8)
    (m,) = w.report(3.0)
    assert (m.requests, m.rate, m.prompt_mean, m.output_mean, m.slo_attainment) == (2, 0.2, 200.0, 8.0, 0.5)
    assert w.report(13.0) == []  # both fell out of the window
