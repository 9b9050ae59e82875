"""The one wiring: a worker's cost model and batching settings, and the scheduler's policy, from the
cluster file. The worker, the scheduler and the simulator all build them here, so what the
simulator predicts is priced and batched the way the live mesh runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

from hetmesh.batching import Settings
from hetmesh.config import ClusterConfig, WorkerGroup
from hetmesh.costmodel import CostModel, Efficiency, load_efficiencies, server_model
from hetmesh.placement import Policy, make_policy
from hetmesh.placement.flow import LOOKAHEAD, FlowQueue, Tenant, engine_seconds

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


DEFAULT_TENANT = "default"  # requests that name no tenant


def flow_queue(tenants: Sequence[Tenant], max_held: int, retry_floor_s: float, reserve: float = 0.0,
               lookahead: int = LOOKAHEAD) -> FlowQueue:
    """The flow queue the scheduler and the simulator hold requests in: the given tenants, and the `default`
    tenant (weight 1, last band) for requests that name none, unless one of them is called that. `reserve`:
    the share of its SLOs a request leaves free for the tenants it would crowd out (flow.headroom;
    `FlowQueue.headroom`)."""
    ts = list(tenants)
    if all(t.name != DEFAULT_TENANT for t in ts):
        ts.append(Tenant(DEFAULT_TENANT, 1.0, max((t.band for t in ts), default=0)))
    return FlowQueue(ts, max_held=max_held, retry_floor_s=retry_floor_s, reserve=reserve, lookahead=lookahead)


def tenants(cfg: ClusterConfig) -> list[Tenant]:
    """The cluster file's [[tenants]], their priority bands as indices of flow.bands (0: served first)."""
    bands = {b: i for i, b in enumerate(cfg.flow.bands)}
    return [Tenant(t.name, t.weight, bands[t.priority]) for t in cfg.tenants]


def flow(cfg: ClusterConfig) -> FlowQueue | None:
    """The scheduler's flow queue; None without [[tenants]] (flow control off). It runs on the engines' clock
    (wall x mesh.time_scale), so its Retry-After floor is scheduler.retry_after_s of wall time."""
    if not cfg.tenants:
        return None
    return flow_queue(tenants(cfg), cfg.flow.max_held, cfg.scheduler.retry_after_s * cfg.mesh.time_scale,
                      cfg.flow.headroom, cfg.flow.lookahead)


def pricer(cm: CostModel, max_batch: int) -> Callable[[int, int, int], float]:
    """A request's cost in engine seconds on a worker of cost model `cm`: (prompt tokens, cached tokens, output
    tokens) -> its prefill alone, plus its output at a full batch's per-token share of a decode step."""
    per_token = cm.prefill_time(4096) / 4096  # long enough that the step's fixed overhead is spread thin
    batch = max(max_batch, 1)

    def price(prompt: int, cached: int, output: int) -> float:
        ctx = prompt + max(output, 1) // 2
        step = cm.decode_step_time(batch, batch * max(ctx, 1)) / batch
        return engine_seconds(per_token, step, max(prompt - cached, 0), output)

    return price


def cluster_pricer(cfg: ClusterConfig, model: str) -> Callable[[int, int, int], float] | None:
    """`pricer` for the first worker group of `model` (None: no group serves it)."""
    for g in cfg.workers:
        if g.model == model:
            return pricer(cost_model(cfg, g), g.max_batch)
    return None
