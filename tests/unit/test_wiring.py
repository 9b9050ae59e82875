"""One wiring: the worker's cost model and engine settings, and the scheduler's policy, from the cluster file."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.clusters import cluster_toml, group, load_cluster, model
from tests.unit.test_config_and_subjects import assert_rejected

from hetmesh import config, engines, wiring
from hetmesh.costmodel import Efficiency, save_efficiencies
from hetmesh.engines.simulated import SimEngine
from hetmesh.placement import ClusterState, RequestInfo, make_policy
from hetmesh.placement.cost import CostPolicy
from hetmesh.protocol import Heartbeat, Role


def _toml(ep: dict[str, object] | None = None, **tables: dict[str, object]) -> str:
    """DeepSeek-R1 on an EP prefill group of MI300X servers and a TP decode group of MI308X servers, the cost
    policy; `ep`: changes to the prefill group, `tables`: more of the file (e.g. costmodel={...})."""
    return cluster_toml(
        **{"scheduler": {"policy": "cost"}, **tables},
        models=[model("r1", spec="deepseek-r1", dtype="fp8", block_size=64)],
        workers=[group("ep", "r1", "amd-mi300x", **{"devices": 8, "parallel": "ep", "step_tokens": 2048,
                                                      "role": "prefill", **(ep or {})}),
                 group("tp", "r1", "amd-mi308x", devices=8, role="decode")])


def _cfg(tmp_path: Path, **tables: dict[str, object]) -> config.ClusterConfig:
    return load_cluster(tmp_path, _toml(**tables))


def _heartbeat(cfg: config.ClusterConfig, g: config.WorkerGroup) -> Heartbeat:
    """What the worker shell publishes about its layout (services/hetmesh/worker)."""
    return Heartbeat(worker_id=f"{g.name}-0", model=g.model, accelerator=g.accelerator, vendor=g.vendor,
                     devices=g.devices, role=g.role, engine="sim", work_subject="x", queue_depth=0, running=0,
                     max_batch=g.max_batch, kv_blocks_total=10_000, kv_blocks_used=0, block_size=64, ts=0.0,
                     parallel=g.parallel, step_tokens=g.step_tokens)


def test_the_policy_prices_each_worker_with_the_workers_own_cost_model(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    ep, tp = cfg.workers
    policy = wiring.policy(cfg)
    assert isinstance(policy, CostPolicy)
    state = ClusterState(5.0)
    for g in cfg.workers:
        state.observe(_heartbeat(cfg, g), 0.0)
    views = {v.worker_id: v for v in state.views()}
    assert views["ep-0"].parallel == "ep" and views["ep-0"].step_tokens == 2048  # carried by the heartbeat
    for g in (ep, tp):
        worker = wiring.cost_model(cfg, g)
        priced = policy._cm(views[f"{g.name}-0"])
        assert (priced.parallel, priced.dtype, priced.eff) == (worker.parallel, worker.dtype, worker.eff)
        assert priced.prefill_time(4096) == worker.prefill_time(4096)
    # EP and TP price differently, so a heartbeat without the layout would have priced the wrong server.
    as_tp = wiring.cost_model(cfg, config.WorkerGroup(**{**{f: getattr(ep, f) for f in ep.__struct_fields__},
                                                        "parallel": "tp"}))
    assert as_tp.prefill_time(4096) != wiring.cost_model(cfg, ep).prefill_time(4096)
    # The prefill prediction counts the worker's own step budget: 8192 tokens are four 2048-token steps.
    d = policy.place(RequestInfo(request_id="r", model="r1", prompt_len=8192, max_tokens=64, arrival=1.0),
                     list(views.values()))
    assert d is not None and d.prefill_worker == "ep-0"
    one_step = wiring.cost_model(cfg, ep).prefill_time(8192)
    assert d.predicted_ttft_s is not None and d.predicted_ttft_s != pytest.approx(one_step, rel=1e-6)


def test_the_engine_runs_the_groups_settings(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    ep = cfg.workers[0]
    cm = wiring.cost_model(cfg, ep)
    e = engines.create(cfg, ep, cm)
    assert isinstance(e, SimEngine)
    s = e.settings
    assert (s.step_tokens, s.block_size, s.max_batch) == (2048, 64, ep.max_batch)
    assert s.kv_blocks == cm.max_kv_tokens() // 64


def test_the_cluster_files_efficiencies_reach_workers_and_policy(tmp_path: Path) -> None:
    eff = tmp_path / "eff.json"
    save_efficiencies(eff, {"amd-mi300x/deepseek-r1": Efficiency(compute=0.123, memory=0.456)})
    cfg = _cfg(tmp_path, costmodel={"efficiency": str(eff)})
    ep = cfg.workers[0]
    assert wiring.cost_model(cfg, ep).eff.compute == 0.123
    assert wiring.policy_options(cfg)["efficiencies"]["amd-mi300x/deepseek-r1"].memory == 0.456
    assert wiring.cost_model(cfg, cfg.workers[1]).eff.compute != 0.123  # the mi308x keeps the shipped factors


def test_an_unknown_policy_option_is_an_error_that_names_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="chunk_tokens"):
        make_policy("cost", chunk_tokens=2048)  # the old name of the step budget: refused, not dropped
    with pytest.raises(ValueError, match="'top_k'"):
        make_policy("round_robin", top_k=2)
    assert isinstance(make_policy("cost", top_k=2, share_window_s=5.0), CostPolicy)
    assert_rejected(tmp_path, _toml(scheduler={"policy": "cost", "options": {"share_windw_s": 5}}), ValueError,
                    "share_windw_s")
    cfg = _cfg(tmp_path)
    cfg.scheduler.options = {"top_k": 2}
    assert wiring.policy(cfg).top_k == 2  # type: ignore[attr-defined]


def test_worker_groups_check_their_batching(tmp_path: Path) -> None:
    assert_rejected(tmp_path, _toml({"step_tokens": 8}), ValueError, "step_tokens")
    assert_rejected(tmp_path, _toml({"parallel": "pp"}), ValueError, "parallel")
    assert Role.PREFILL == _cfg(tmp_path).workers[0].role
