"""The one wiring: a worker's cost model and batching settings, and the scheduler's policy, from the
cluster file. The worker, the scheduler and the simulator all build them here, so what the
simulator predicts is priced and batched the way the live mesh runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Any

from hetmesh.batching import Settings
from hetmesh.config import ClusterConfig, WorkerGroup
from hetmesh.costmodel import CostModel, Efficiency, load_efficiencies, server_model
from hetmesh.placement import Policy, make_policy

MAX_SIM_KV_BLOCKS = 1 << 22  # cap on the cost model's capacity: the sim cache only holds hashes, but bound it


@cache
def _table(path: str) -> Mapping[str, Efficiency]:
    return load_efficiencies(path)


def efficiencies(cfg: ClusterConfig) -> Mapping[str, Efficiency]:
    """The cluster file's efficiency factors ([costmodel] efficiency), or none (the shipped ones apply)."""
    return _table(cfg.costmodel.efficiency) if cfg.costmodel.efficiency else {}


def cost_model(cfg: ClusterConfig, group: WorkerGroup) -> CostModel:
    """A worker's cost model: its accelerator, devices and parallel layout, its model's spec and dtype."""
    m = cfg.model(group.model)
    return server_model(group.accelerator, m.spec, devices=group.devices, parallel=group.parallel, dtype=m.dtype,
                        efficiencies=efficiencies(cfg))


def kv_blocks_for(configured: int, block_size: int, cm: CostModel) -> int:
    """The configured KV blocks, or (0) what fits in memory after the weights."""
    if configured > 0:
        return configured
    return min(MAX_SIM_KV_BLOCKS, max(1, cm.max_kv_tokens() // block_size))


def settings(cfg: ClusterConfig, group: WorkerGroup, cm: CostModel) -> Settings:
    """The batching core's settings of a worker of `group`."""
    m = cfg.model(group.model)
    return Settings(max_batch=group.max_batch, kv_blocks=kv_blocks_for(group.kv_blocks, m.block_size, cm), block_size=m.block_size,
                    step_tokens=group.step_tokens, prefill_order=group.prefill_order)


def policy_options(cfg: ClusterConfig) -> dict[str, Any]:
    """The scheduler's policy options: for `cost`, the models' specs and dtypes, SLOs, objective and
    efficiencies; then the file's [scheduler.options] (checked by make_policy: an unknown one is an error)."""
    sc = cfg.scheduler
    kw: dict[str, Any] = {}
    if sc.policy == "cost":
        kw = {"models": {m.name: m.spec for m in cfg.models}, "dtypes": {m.name: m.dtype for m in cfg.models},
              "objective": sc.objective, "ttft_slo_s": sc.ttft_slo_s, "tpot_slo_s": sc.tpot_slo_s,
              "efficiencies": efficiencies(cfg)}
        if any(m.ttft_slo_s or m.tpot_slo_s for m in cfg.models):
            kw["slos"] = {m.name: cfg.slo(m.name) for m in cfg.models}
        kw["admission_margin"] = sc.admission_margin
        kw["admission_hold_s"] = sc.admission_hold_s
        if any(m.admission_margin >= 0 for m in cfg.models):
            kw["admission_margins"] = {m.name: cfg.admission_margin(m.name) for m in cfg.models}
    kw.update(sc.options)
    return kw


def policy(cfg: ClusterConfig) -> Policy:
    return make_policy(cfg.scheduler.policy, **policy_options(cfg))
