"""What a simulation runs on: its workers (`WorkerSpec`, from a cluster file or `pool`) and the
simulator's own settings (`SimConfig`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hetmesh.config import ClusterConfig, FlowConfig, GatewayConfig, SchedulerConfig
from hetmesh.costmodel import Efficiency
from hetmesh.costmodel.learn import REPORT_S
from hetmesh.costmodel.model import DEFAULT_LINK_LATENCY_S
from hetmesh.costmodel.truth import Truth
from hetmesh.placement.flow import Tenant
from hetmesh.protocol import Role


@dataclass(frozen=True)
class WorkerSpec:
    """One simulated worker: what a cluster file's worker group says about it."""

    worker_id: str
    pool: str  # the worker group (all workers of a group are one pool)
    model: str  # served model name
    spec: str  # cost-model spec id / config path
    accelerator: str
    devices: int = 8
    role: Role = Role.BOTH
    max_batch: int = 64
    parallel: str = "tp"
    dtype: str | None = None
    kv_tokens: int = 0  # 0: what fits after weights
    block_size: int = 16
    step_tokens: int = 8192
    prefill_order: str = "fcfs"
    truth: Truth | None = None  # what it really runs at (None: its prior, as the scheduler prices it)


def workers_from_config(cfg: ClusterConfig) -> list[WorkerSpec]:
    out: list[WorkerSpec] = []
    for g in cfg.workers:
        m = cfg.model(g.model)
        for wid in g.worker_ids():
            out.append(WorkerSpec(worker_id=wid, pool=g.name, model=m.name, spec=m.spec, accelerator=g.accelerator,
                                  devices=g.devices, role=g.role, max_batch=g.max_batch, parallel=g.parallel,
                                  dtype=m.dtype, kv_tokens=g.kv_blocks * m.block_size, block_size=m.block_size,
                                  step_tokens=g.step_tokens, prefill_order=g.prefill_order,
                                  truth=Truth(slowdown=g.sim_slowdown, after_s=g.sim_slowdown_after_s)
                                  if g.sim_slowdown != 1.0 else None))
    return out


def pool(name: str, n: int, accelerator: str, role: Role | str = Role.BOTH, *, model: str = "deepseek-r1",
         spec: str | None = None, devices: int = 8, max_batch: int = 64, **kw: object) -> list[WorkerSpec]:
    """`n` identical workers named <name>-<i>."""
    return [WorkerSpec(worker_id=f"{name}-{i}", pool=name, model=model, spec=spec or model, accelerator=accelerator,
                       devices=devices, role=Role(role), max_batch=max_batch, **kw)  # type: ignore[arg-type]
            for i in range(n)]


@dataclass
class SimConfig:
    """The simulator's own settings (each worker's batching is its WorkerSpec's, as in the cluster file)."""

    link_latency_s: float = DEFAULT_LINK_LATENCY_S
    efficiencies: Mapping[str, Efficiency] = field(default_factory=dict)  # accelerator id -> factors
    prefix_caching: bool = True
    max_time_s: float = float("inf")  # stop the run at this virtual time
    record_steps: bool = False  # keep every worker's Step.signature() (fidelity tests)
    # A refused request's client retries it this many times, each after the refusal's Retry-After (at least
    # retry_floor_s, the scheduler's default): the official openai client retries a 429 twice by default.
    client_retries: int = 0
    retry_floor_s: float = SchedulerConfig().retry_after_s
    # A refusal the policy holds (Decision.hold_s) is placed again while the request has waited at most this
    # long in all, as the live scheduler does (hetmesh.placement.admission.hold_wait_s).
    hold_limit_s: float = GatewayConfig().hold_limit_s
    report_s: float = REPORT_S  # each worker reports its engine's steps to the policy this often
    # Flow control (hetmesh.placement.flow): these tenants share a full fleet (TraceRequest.tenant names one;
    # none: the default tenant); empty: off. Each may hold flow_max_held requests at once.
    tenants: tuple[Tenant, ...] = ()
    flow_max_held: int = FlowConfig().max_held
    flow_headroom: float = FlowConfig().headroom
    flow_lookahead: int = FlowConfig().lookahead
