"""The live planner's commands (pure): one plan over the whole fleet moves a worker to the model with the
traffic (a ModelSwitch priced as drain + weights / storage bandwidth); role moves stay RoleSwitches; a
multi-device worker's layout change is a ModelSwitch too; a stop is not sent."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetmesh import config
from hetmesh.costmodel import server_model
from hetmesh.planner import Assignment, Move, Plan, plan
from hetmesh.planner.commands import commands, model_moves, plan_fleet
from hetmesh.protocol import ModelDemandStats, Role, WorkerStatus
from tests.clusters import cluster_toml, group, load_cluster, model

CLUSTER = cluster_toml(
    scheduler={"ttft_slo_s": 2.0, "tpot_slo_s": 0.1},
    models=[model("a", spec="llama-3.1-8b"), model("b", spec="llama-3.1-8b"), model("idle", spec="llama-3.1-8b")],
    workers=[group("h", "a", "nvidia-h100", count=2), group("g", "b", "nvidia-h100"),
             group("q", "idle", "nvidia-h100")])


@pytest.fixture
def cfg(tmp_path: Path) -> config.ClusterConfig:
    return load_cluster(tmp_path, CLUSTER)


def worker(wid: str, model: str) -> WorkerStatus:
    return WorkerStatus(worker_id=wid, model=model, accelerator="nvidia-h100", role=Role.BOTH, engine="sim", devices=1,
                        queue_depth=0, running=0, max_batch=64, kv_blocks_used=0, kv_blocks_total=100,
                        heartbeat_age_s=0.0)


def stats(model: str, rate: float) -> ModelDemandStats:
    return ModelDemandStats(model=model, requests=int(rate * 20), rate=rate, prompt_mean=1000, output_mean=200,
                            max_tokens_mean=200, prefix_hit=0.0)


def test_fleet_plan_moves_a_worker_to_the_busy_model_priced_with_the_reload(cfg: config.ClusterConfig) -> None:
    ws = [worker("h-0", "a"), worker("h-1", "a"), worker("g-0", "b"), worker("q-0", "idle")]
    seen: list[tuple[list[str], list[str]]] = []

    def planner(groups: list, demands: list) -> Plan:
        seen.append(([g.name for g in groups], [d.name for d in demands]))
        return plan(groups, demands, horizon_s=3600, check_duration_s=20, storage_bytes_per_s=5e9)

    plans = plan_fleet([stats("a", 0.5), stats("b", 12.0)], ws, cfg, planner)
    # the models with traffic and all their workers in one plan; the idle model keeps its worker
    assert seen == [(["h-0", "h-1", "g-0"], ["a", "b"])]
    (p,) = plans.values()
    cmds = commands(p)
    to_b = [(c.worker_id, c.model, c.move) for c in cmds if c.model == "b"]
    assert to_b and all(w.startswith("h-") for w, _m, _mv in to_b)
    load_s = server_model("nvidia-h100", "llama-3.1-8b").weights_bytes() / 5e9
    assert all(mv.change == "reload" and mv.seconds >= load_s for _w, _m, mv in to_b)
    assert plan_fleet([stats("x-unknown", 3.0)], ws, cfg, planner) == {}  # nothing to plan


def _plan(moves: list[Move], after: list[Assignment]) -> Plan:
    return Plan(assignments=after, moves=moves, chosen="x", predicted={}, candidates=[], served={}, headroom=0.0)


def test_commands_role_model_and_layout_moves_but_no_stop() -> None:
    after = [Assignment("w1-0", "w1", "nvidia-h100", 1, "a", Role.PREFILL, "tp"),
             Assignment("w2-0", "w2", "nvidia-h100", 1, "b", Role.DECODE, "tp"),
             Assignment("w3-0", "w3", "nvidia-h200", 8, "b", Role.BOTH, "ep"),  # 8 devices, a/tp -> b/ep
             Assignment("w4-0", "w4", "nvidia-h200", 8, "b", Role.BOTH, "tp"),
             Assignment("w5-0", "w5", "nvidia-h100", 1, "", Role.BOTH, "tp"),
             Assignment("w6-0", "w6", "nvidia-h200", 8, "a", Role.PREFILL, "dp"),  # same model, tp -> dp
             Assignment("w7-0", "w7", "nvidia-h100", 1, "a", Role.DECODE, "dp")]  # one device: a role switch
    moves = [Move("w1-0", "role", "a/both/tp", "a/prefill/tp", 3.0),
             Move("w2-0", "reload", "a/both/tp", "b/decode/tp", 9.0),
             Move("w3-0", "reload", "a/both/tp", "b/both/ep", 40.0),
             Move("w4-0", "reload", "a/both/tp", "b/both/tp", 40.0),
             Move("w5-0", "stop", "a/both/tp", "idle", 3.0),
             Move("w6-0", "reload", "a/prefill/tp", "a/prefill/dp", 30.0),
             Move("w7-0", "reload", "a/both/tp", "a/decode/dp", 3.0)]
    got = [(c.worker_id, c.role, c.model, c.parallel, c.move.change) for c in commands(_plan(moves, after))]
    assert got == [("w1", Role.PREFILL, "", "", "role"), ("w7", Role.DECODE, "", "", "role"),
                   ("w2", Role.DECODE, "b", "tp", "reload"), ("w3", Role.BOTH, "b", "ep", "reload"),
                   ("w4", Role.BOTH, "b", "tp", "reload"), ("w6", Role.PREFILL, "a", "dp", "reload")]
    assert [c.worker_id for c in model_moves(_plan(moves, after))] == ["w2", "w3", "w4", "w6"]
