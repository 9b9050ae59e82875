"""The one config loader: a cluster file (TOML) -> typed `ClusterConfig`.

Environment overrides (for containers and tests): HETMESH_NATS_URL, HETMESH_REDIS_URL,
HETMESH_TIME_SCALE, HETMESH_POLICY, HETMESH_GATEWAY_HOST.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import msgspec
from msgspec import Struct, field

from hetmesh.protocol import Role


class MeshConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    nats_url: str = ""  # empty: the launcher starts a nats-server on a free port
    redis_url: str = ""  # empty: the launcher starts a redis-server on a free port
    time_scale: float = 1.0  # simulated engines run this many times faster than real time
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 2.0
    stall_timeout_s: float = 60.0  # gateway: no message for this long ends the request with an error
    max_attempts: int = 2  # gateway resubmits a request whose worker died before it streamed


class GatewayConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8000
    submit_timeout_s: float = 5.0


class SchedulerConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    policy: str = "prefix_aware"  # round_robin | least_loaded | prefix_aware | cost
    objective: str = "throughput"  # cost policy: throughput | latency
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    prefix_ttl_s: float = 600.0


class KvTransferConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    chunk_bytes: int = 1 << 20
    replicas: int = 1
    # Cap on bytes actually put on the wire per transfer: sim KV for a 671B model is tens of MB
    # per request; 0 means no cap (send the real size).
    max_wire_bytes: int = 0


class ModelConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str  # the name clients put in "model"
    spec: str = "tiny-llama"  # hetmesh.costmodel model catalog id, or a path to a HF config.json
    tokenizer: str = "byte"  # "byte" or a path to a tokenizer.json
    max_context: int = 4096
    block_size: int = 16
    dtype: str = "bf16"


class WorkerGroup(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str  # worker ids are <name>-<index>
    model: str
    accelerator: str  # hetmesh.costmodel accelerator catalog id, e.g. "amd-mi300x"
    role: Role = Role.BOTH
    count: int = 1
    devices: int = 1  # accelerators per worker (a server of 8 -> 8), split by `parallel`
    parallel: str = "tp"  # tp | ep | dp layout over the devices
    engine: str = "sim"  # sim | vllm
    max_batch: int = 64
    kv_blocks: int = 0  # 0: as many as fit in memory after weights (cost model)

    @property
    def vendor(self) -> str:
        return self.accelerator.split("-", 1)[0]

    def worker_ids(self) -> list[str]:
        return [f"{self.name}-{i}" for i in range(self.count)]


class ClusterConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    mesh: MeshConfig = field(default_factory=MeshConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer: KvTransferConfig = field(default_factory=KvTransferConfig)
    models: list[ModelConfig] = field(default_factory=list)
    workers: list[WorkerGroup] = field(default_factory=list)

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(f"model {name!r} is not in the cluster file")

    def group_of(self, worker_id: str) -> WorkerGroup:
        for g in self.workers:
            if worker_id in g.worker_ids():
                return g
        raise KeyError(f"worker {worker_id!r} is not in the cluster file")

    def validate(self) -> ClusterConfig:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError("model names must be unique")
        for g in self.workers:
            self.model(g.model)
            if g.count < 0 or g.devices < 1 or g.max_batch < 1:
                raise ValueError(f"worker group {g.name!r}: count >= 0, devices >= 1, max_batch >= 1")
        return self


DEFAULT_CLUSTER = Path(__file__).resolve().parents[2] / "ops" / "clusters" / "default.toml"


def load(path: str | os.PathLike[str] | None = None) -> ClusterConfig:
    """Read a cluster file (default: $HETMESH_CLUSTER or ops/clusters/default.toml), apply env overrides."""
    p = Path(path or os.environ.get("HETMESH_CLUSTER") or DEFAULT_CLUSTER)
    if not p.is_file():
        # DEFAULT_CLUSTER lives in the source tree; an installed wheel has no ops/ folder.
        raise FileNotFoundError(f"cluster file {p} not found: pass --cluster FILE or set HETMESH_CLUSTER")
    cfg = msgspec.convert(tomllib.loads(p.read_text()), ClusterConfig)
    env = os.environ
    if v := env.get("HETMESH_NATS_URL"):
        cfg.mesh.nats_url = v
    if v := env.get("HETMESH_REDIS_URL"):
        cfg.mesh.redis_url = v
    if v := env.get("HETMESH_TIME_SCALE"):
        cfg.mesh.time_scale = float(v)
    if v := env.get("HETMESH_POLICY"):
        cfg.scheduler.policy = v
    if v := env.get("HETMESH_GATEWAY_HOST"):
        cfg.gateway.host = v
    return cfg.validate()


def dumps(cfg: ClusterConfig) -> str:
    """TOML text of a config (the launcher writes the resolved config for its children)."""
    return msgspec.toml.encode(cfg).decode()
