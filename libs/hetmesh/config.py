"""The one config loader: a cluster file (TOML) -> typed `ClusterConfig`.

Environment overrides (for containers and tests): HETMESH_NATS_URL, HETMESH_REDIS_URL,
HETMESH_TIME_SCALE, HETMESH_POLICY, HETMESH_EFFICIENCY, HETMESH_GATEWAY_HOST, HETMESH_KV_LISTEN_HOST,
HETMESH_KV_ADVERTISE_HOST, HETMESH_WORK_QUEUE_REPLICAS; secrets: HETMESH_NATS_USER,
HETMESH_NATS_PASSWORD, HETMESH_NATS_TOKEN, HETMESH_NATS_CREDS, HETMESH_REDIS_USERNAME,
HETMESH_REDIS_PASSWORD, HETMESH_KV_SECRET, and HETMESH_API_KEYS (comma-separated keys, hashed as they are read).
"""

from __future__ import annotations

import hashlib
import math
import os
import tomllib
from pathlib import Path
from typing import Any

import msgspec
from msgspec import Struct, field

from hetmesh.costmodel.model import PARALLEL
from hetmesh.placement.admission import DEFAULT_HOLD_S, DEFAULT_MARGIN
from hetmesh.placement.flow import LOOKAHEAD
from hetmesh.protocol import Role


class MeshConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    # empty: the launcher starts a nats-server on a free port. A NATS cluster: every node's URL, comma-separated
    # (nats://a:4222,nats://b:4222,nats://c:4222): a client moves to another node when its own goes away.
    nats_url: str = ""
    redis_url: str = ""  # empty: the launcher starts a redis-server on a free port
    time_scale: float = 1.0  # simulated engines run this many times faster than real time
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 2.0
    stall_timeout_s: float = 60.0  # gateway: no message for this long: a stream migrates or starts over, else a 504
    # scheduler: a worker that runs requests but has not taken or made a token for this long while its heartbeats
    # go on is wedged: its requests migrate (first tokens too) and it gets no more until it moves; 0: off;
    # unset: a third of stall_timeout_s (20 s). Keep it above the longest engine step.
    wedge_timeout_s: float | None = None
    max_attempts: int = 2  # gateway resubmits a request whose worker died before it streamed
    # ... and moves a request that has tokens to another worker at most this many times (then: an error)
    migration_limit: int = 3
    # NATS credentials and TLS, handed to nats-py (a URL's user:password@ works too).
    nats_user: str = ""
    nats_password: str = ""
    nats_token: str = ""
    nats_creds_file: str = ""  # a .creds file (JWT + nkey seed)
    nats_nkeys_seed_file: str = ""
    nats_tls_ca_file: str = ""  # any nats_tls_* set: TLS (a tls:// URL also turns it on)
    nats_tls_cert_file: str = ""
    nats_tls_key_file: str = ""
    # Redis credentials and TLS, handed to redis-py (rediss:// in the URL turns TLS on).
    redis_username: str = ""
    redis_password: str = ""
    redis_tls_ca_file: str = ""
    redis_tls_cert_file: str = ""
    redis_tls_key_file: str = ""

    @property
    def wedge_s(self) -> float:
        """The scheduler's wedge timeout (0: off)."""
        return self.stall_timeout_s / 3 if self.wedge_timeout_s is None else self.wedge_timeout_s


class GatewayConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8000
    # How long the gateway waits for the scheduler's answer. A request SLO-aware admission holds is answered
    # within half of it (scheduler.admission_hold_s): 20 s lets a hold span a TTFT SLO of up to 10 s.
    submit_timeout_s: float = 20.0
    # Admission: requests past this many in flight get 503 + Retry-After instead of a queue slot.
    max_inflight: int = 2048
    max_body_bytes: int = 4 << 20  # a bigger body gets 413 before it is read whole
    max_header_bytes: int = 64 << 10  # a bigger request line + headers get 431 while they arrive
    # Slow or silent clients (nginx's defaults). A keep-alive connection idle this long after a response is
    # closed: 75 s outlasts the idle timeouts of the load balancers and client pools in front (AWS ALB 60 s,
    # nginx upstream 60 s, httpx 5 s), so they, not the gateway, close an idle connection first and never
    # send on one the gateway is closing (uvicorn's 5 s would race them).
    keep_alive_timeout_s: float = 75.0
    # A request line + headers not all in this long after their first byte (a new connection: after its
    # accept) get 408; a new connection that sent nothing is closed. Clients send a head in one write.
    header_timeout_s: float = 60.0
    # A body that stalls this long between two reads gets 408 (a slow but moving upload is never cut).
    body_timeout_s: float = 60.0
    # No scheduler subscribed (restarting): a new request waits this long for one, then gets 503.
    scheduler_wait_s: float = 15.0
    retry_after_s: float = 1.0  # what Retry-After says when the mesh is overloaded

    @property
    def hold_limit_s(self) -> float:
        """How long SLO-aware admission may hold a request in all (the live scheduler and the simulator alike):
        half the submit timeout, so the client gets its 429 before the gateway stops waiting."""
        return 0.5 * self.submit_timeout_s


DRAIN_EXIT_S = 10.0  # after a worker's drain: handed-over requests' errors, the engine's close, the last flushes


class WorkerConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """`[worker]`: what every worker process shares."""

    # SIGTERM: running requests get this long to finish, the rest migrate, then the process exits 0.
    # The container platforms' grace periods (compose stop_grace_period, k8s terminationGracePeriodSeconds)
    # are set above it.
    drain_timeout_s: float = 10.0
    # How fast a worker loads a model's weights (its NVMe or network store), bytes/s: a ModelSwitch's reload takes
    # weights / this (the sim engine waits that long; the planner prices a model move with it).
    storage_bytes_per_s: float = 5e9

    @property
    def grace_period_s(self) -> int:
        """What a container platform should wait after SIGTERM before SIGKILL: the drain, then up to
        DRAIN_EXIT_S to hand the rest over and close (compose stop_grace_period, k8s
        terminationGracePeriodSeconds; tests/ops checks both against this)."""
        return math.ceil(self.drain_timeout_s + DRAIN_EXIT_S)


PLANNER_MODES = ("off", "advise", "act")


class PlannerConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """`[planner]`: the live planner service (hetmesh.planner) and the demand statistics it plans from."""

    mode: str = "off"  # off | advise (publish the proposal only) | act (send role switches to workers)
    interval_s: float = 30.0  # the scheduler publishes demand, and the planner re-plans, this often
    window_s: float = 300.0  # the demand the scheduler reports is over this long a sliding window
    horizon_s: float = 3600.0  # a move must pay for its switch cost within this long (the planner's hysteresis)
    max_moving_share: float = 0.25  # at most this share of the fleet switching at once (at least one worker)
    lease_ttl_s: float = 10.0  # the leader's NATS KV lease: another planner takes over this long after it dies
    # model: each model's own workers are planned apart (roles move, models stay); fleet: one plan over every
    # model with traffic and their workers, so a worker may also change model (a ModelSwitch: drain, reload).
    scope: str = "model"
    # The demand a round plans for: last (the scheduler's last window) | trend (the line through the last two
    # rounds' windows, one round on: a planner on `last` lags a steady ramp; hetmesh.planner.live.forecast).
    forecast: str = "last"


class ApiKey(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    sha256: str  # hex SHA-256 of the key; the key itself is never stored (`python -m hetmesh.gateway --hash-key`)
    rpm: int = 0  # requests per minute, 0: the auth section's default
    tpm: int = 0  # tokens (prompt + completion) per minute, 0: the auth section's default


class AuthConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """No keys at all: the API is open. Any key: every /v1 request needs `Authorization: Bearer <key>`."""

    keys: list[ApiKey] = field(default_factory=list)
    default_rpm: int = 0  # 0: unlimited
    default_tpm: int = 0
    # true: every gateway replica draws on one set of buckets per key, in the cluster's Redis;
    # false (or no Redis configured): each gateway process limits on its own
    shared_limits: bool = True


class TenantConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """`[[tenants]]`: who shares the fleet when it is full (hetmesh.placement.flow). Any tenant turns flow control on."""

    name: str
    weight: float = 1.0  # its share of a full fleet against the other tenants of its band (> 0)
    priority: str = "default"  # its band, one of flow.bands: a higher band is served first, strictly
    keys: list[str] = field(default_factory=list)  # names of [[auth.keys]] entries that are this tenant's
    rpm: int = 0  # requests per minute for the whole tenant (all its keys), 0: unlimited
    tpm: int = 0  # tokens (prompt + completion) per minute for the whole tenant, 0: unlimited


class FlowConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """`[flow]`: flow control's settings (on when the cluster file has `[[tenants]]`)."""

    bands: list[str] = field(default_factory=lambda: ["default"])  # priority bands, highest first
    # Where auth is off, a request names its tenant in this header (an unknown one gets 400); no header: the
    # tenant `default`, weight 1, in the last band, unless [[tenants]] has one of that name.
    header: str = "x-hetmesh-tenant"
    max_held: int = 256  # requests one tenant may have held at once; past it, 429 + Retry-After
    # The share of its TTFT and TPOT SLOs a request leaves free while a higher band, or a tenant of its band owed
    # room, is active (the room their next arrivals land in). A held request waits until the latest start that
    # meets its TTFT SLO (the SLO less its own prefill), then 429 + Retry-After.
    headroom: float = 0.5
    # In a pump, a tenant whose held request the fleet refuses has this many of its next requests (earliest
    # deadline first) tried before its turn ends: more fills the fleet more fully at overload. Each held request
    # is tried at most once until room may have freed (a finish, or each admission hold period).
    lookahead: int = LOOKAHEAD


class SchedulerConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    policy: str = "prefix_aware"  # round_robin | least_loaded | prefix_aware | cost
    objective: str = "throughput"  # cost policy: throughput | latency
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    prefix_ttl_s: float = 600.0
    # More options of the chosen policy (e.g. cost: share_window_s, top_k); an unknown one is refused.
    options: dict[str, Any] = field(default_factory=dict)
    # Admission: a model's pool takes at most (max_batch * (1 + queue_factor)) requests per worker;
    # past that a submit is refused (503 + Retry-After) instead of queueing without bound.
    queue_factor: float = 4.0
    retry_after_s: float = 1.0
    # SLO-aware admission (cost policy; hetmesh.placement.admission): refuse (429 + Retry-After) a request whose
    # best placement is predicted over this many times its TTFT or TPOT SLO; 0: off. A model may set its own.
    # On by default (hetmesh.placement.admission.DEFAULT_MARGIN, the simulator's too).
    admission_margin: float = DEFAULT_MARGIN
    # Before it refuses, hold the request and place it again every this many seconds while its TTFT SLO is still
    # within reach, for at most the gateway's hold_limit_s (half its submit_timeout_s); 0: refuse at once.
    admission_hold_s: float = DEFAULT_HOLD_S


class CostModelConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """`[costmodel]`: what every worker's cost model and the cost policy share (hetmesh.wiring)."""

    efficiency: str = ""  # efficiency factors JSON (hetmesh.costmodel.save_efficiencies); empty: the shipped ones


class KvTransferConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    # "direct": the prefill worker streams the KV over TCP straight into the decode worker's KV port
    # (hetmesh.kvstream), kv-transfer only coordinating; "nats": kv-transfer relays it as NATS chunks,
    # for workers that can reach the bus but not each other.
    data_plane: str = "direct"
    listen_host: str = "127.0.0.1"  # decode workers' KV port; 0.0.0.0 in containers
    listen_port: int = 0  # 0: any free port (it travels in the heartbeats)
    advertise_host: str = ""  # what prefill workers dial; empty: listen_host, or this host's address on 0.0.0.0
    stream_idle_timeout_s: float = 10.0  # a KV stream with no progress for this long fails
    # Shared by every worker: a KV port takes only streams tagged with it (HMAC of the header).
    # Empty: any peer that reaches the port may stream KV into it. Better from $HETMESH_KV_SECRET.
    secret: str = ""
    chunk_bytes: int = 1 << 20  # relay
    replicas: int = 1
    # Cap on bytes actually put on the wire per transfer: sim KV for a 671B model is tens of MB
    # per request; 0 means no cap (send the real size).
    max_wire_bytes: int = 0


class WorkQueueConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """`[work_queue]`: the JetStream work-queue stream every WorkItem goes through (`hetmesh.workqueue`)."""

    # file (default): queued WorkItems, the stream and its consumers survive a nats-server restart, which is
    # what the queue is for. memory: a little less CPU per item (benchmarks/jetstream_cost.py) and no disk, but a
    # restart loses what was queued (the services re-create the stream and consumers when they reconnect).
    storage: str = "file"
    # Copies of the stream and of the planner's KV buckets on a clustered JetStream (3 on a 3-node NATS cluster:
    # any one node may die); at most the number of nodes listed in mesh.nats_url.
    replicas: int = 1
    # Bounds: a full stream refuses new items (the submit gets 503) instead of dropping queued ones.
    max_msgs: int = 100_000
    max_bytes: int = 1 << 30
    max_age_s: float = 600.0  # older items are void anyway: their gateway stalled out (stall_timeout_s)
    duplicate_window_s: float = 120.0  # a re-publish with the same Nats-Msg-Id within this is stored once
    ack_wait_s: float = 30.0  # an item delivered but not acked within this is delivered again ...
    max_deliver: int = 5  # ... at most this many times in all
    # scheduler: re-publish (same dedup id) across a bus gap for this long; it spans a nats-server restart and,
    # on a NATS cluster, the stream's new leader election after its node died (seconds: nats-server's raft
    # elects after 4-9 s of silence). Keep it below gateway.submit_timeout_s.
    publish_timeout_s: float = 15.0


class ModelConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    name: str  # the name clients put in "model"
    spec: str = "tiny-llama"  # hetmesh.costmodel model catalog id, or a path to a HF config.json
    tokenizer: str = "byte"  # "byte" or a path to a tokenizer.json
    max_context: int = 4096
    block_size: int = 16
    dtype: str = "bf16"
    path: str = ""  # a Hugging Face model folder (weights, config.json, tokenizer), for real engines (vllm)
    # vllm engine, structured outputs (response_format json, forced tool calls): true keeps the JSON compact
    # (vLLM's disable_any_whitespace): a weak model may otherwise spend every token on the free whitespace the
    # grammar allows; false: vLLM's default.
    compact_json: bool = True
    # vLLM's tool-call parser for the model's family (hermes, llama3_json, mistral, ...): tool_choice "auto"
    # is parsed with it in the gateway (vLLM must be installed there); empty: "auto" is refused.
    tool_parser: str = ""
    # This model's SLOs (0: the scheduler section's) and its weight in the planner's objective.
    ttft_slo_s: float = 0.0
    tpot_slo_s: float = 0.0
    priority: float = 1.0
    admission_margin: float = -1.0  # SLO-aware admission for this model: < 0 the scheduler's, 0 off


class VllmWorkerConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    """`[workers.vllm]`: how a worker group with engine = "vllm" builds its AsyncLLM."""

    kv_connector: str = "hetmesh"  # hetmesh (KV bytes through kv-transfer, any platform) | nixl (GPU RDMA) | ""
    kv_cache_gib: int = 1  # CPU KV cache (VLLM_CPU_KVCACHE_SPACE)
    cpu_reserved_cores: int = 1  # CPU: cores vLLM's OpenMP threads leave to the mesh (VLLM_CPU_NUM_OF_RESERVED_CPU)
    gpu_memory_utilization: float = 0.9
    max_model_len: int = 0  # 0: the model's max_context
    enforce_eager: bool = True
    dtype: str = ""  # vLLM dtype name; empty: from the model's dtype (bf16 -> bfloat16, ...)


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
    step_tokens: int = 8192  # one engine step's token budget (vLLM's max_num_batched_tokens)
    prefill_order: str = "fcfs"  # sim engine: which queued prompt starts next, fcfs | shortest
    # sim engine: its steps really take this many times the cost model's (a wrong prior, a degraded chip) ...
    sim_slowdown: float = 1.0
    sim_slowdown_after_s: float = 0.0  # ... from this many engine seconds after it starts
    vllm: VllmWorkerConfig = field(default_factory=VllmWorkerConfig)

    @property
    def vendor(self) -> str:
        return self.accelerator.split("-", 1)[0]

    def layouts(self) -> tuple[str, ...]:
        """The parallel layouts this group's engine can run over its devices: the vllm engine runs tensor
        parallel only over several (vLLM's expert and data parallel are not wired here)."""
        return ("tp",) if self.engine == "vllm" and self.devices > 1 else PARALLEL

    def layout_problem(self) -> str:
        """Why this group's engine cannot run its parallel layout ("" when it can)."""
        if self.parallel not in self.layouts():
            can = " | ".join(f'"{p}"' for p in self.layouts())
            return (f"worker group {self.name!r}: engine {self.engine} runs parallel = {can} over its {self.devices} "
                    f"devices, not {self.parallel!r}")
        return ""

    def worker_ids(self) -> list[str]:
        return [f"{self.name}-{i}" for i in range(self.count)]


class ClusterConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    mesh: MeshConfig = field(default_factory=MeshConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    costmodel: CostModelConfig = field(default_factory=CostModelConfig)
    kv_transfer: KvTransferConfig = field(default_factory=KvTransferConfig)
    work_queue: WorkQueueConfig = field(default_factory=WorkQueueConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    tenants: list[TenantConfig] = field(default_factory=list)
    models: list[ModelConfig] = field(default_factory=list)
    workers: list[WorkerGroup] = field(default_factory=list)
    # $ per device-hour by accelerator id, over the catalog's list prices (hetmesh.costmodel accelerators.csv)
    prices: dict[str, float] = field(default_factory=dict)

    def slo(self, model: str) -> tuple[float, float]:
        """(TTFT, TPOT) SLO seconds of `model`: its own where set, else the scheduler section's."""
        m = self.model(model)
        return m.ttft_slo_s or self.scheduler.ttft_slo_s, m.tpot_slo_s or self.scheduler.tpot_slo_s

    def admission_margin(self, model: str) -> float:
        """The SLO-aware admission margin of `model` (0: off): its own where set, else the scheduler's."""
        m = self.model(model)
        return m.admission_margin if m.admission_margin >= 0 else self.scheduler.admission_margin

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
        for m in self.models:
            if min(m.ttft_slo_s, m.tpot_slo_s) < 0 or m.priority <= 0:
                raise ValueError(f"model {m.name!r}: SLOs >= 0 (0: the scheduler's), priority > 0")
        if self.prices:
            from hetmesh.costmodel.catalog import accelerators  # data only, no cycle

            known = accelerators()
            for acc, usd in self.prices.items():
                if acc not in known or usd < 0:
                    raise ValueError(f"prices: {acc!r} = {usd}: need a catalog accelerator id ({sorted(known)}) "
                                     "and $/device-hour >= 0")
        for k in self.auth.keys:
            if len(k.sha256) != 64 or any(c not in "0123456789abcdef" for c in k.sha256.lower()):
                raise ValueError(f"auth key {k.name!r}: sha256 must be 64 hex digits (the key's SHA-256)")
        gw = self.gateway
        if not min(gw.keep_alive_timeout_s, gw.header_timeout_s, gw.body_timeout_s) > 0:
            raise ValueError("gateway.keep_alive_timeout_s, header_timeout_s and body_timeout_s must be > 0")
        self._validate_tenants()
        if self.scheduler.admission_margin < 0 or self.scheduler.admission_hold_s < 0:
            raise ValueError("scheduler.admission_margin and scheduler.admission_hold_s must be >= 0 (0: off)")
        if self.mesh.wedge_timeout_s is not None and not 0 <= self.mesh.wedge_timeout_s < self.mesh.stall_timeout_s:
            raise ValueError(f"mesh.wedge_timeout_s must be >= 0 (0: off) and below mesh.stall_timeout_s "
                             f"({self.mesh.stall_timeout_s:g}), or the gateway gives up on a stream first")
        if self.mesh.migration_limit < 0 or self.worker.drain_timeout_s < 0:
            raise ValueError("mesh.migration_limit and worker.drain_timeout_s must be >= 0")
        if self.worker.storage_bytes_per_s <= 0:
            raise ValueError("worker.storage_bytes_per_s must be > 0")
        if self.kv_transfer.data_plane not in ("direct", "nats"):
            raise ValueError(f"kv_transfer.data_plane must be direct or nats, not {self.kv_transfer.data_plane!r}")
        pl = self.planner
        if pl.mode not in PLANNER_MODES or min(pl.interval_s, pl.window_s, pl.horizon_s, pl.lease_ttl_s) <= 0 \
                or not 0 < pl.max_moving_share <= 1:
            raise ValueError(f"planner: mode is one of {PLANNER_MODES}, interval_s, window_s, horizon_s, lease_ttl_s > 0, "
                             "0 < max_moving_share <= 1")
        if pl.scope not in ("model", "fleet"):
            raise ValueError(f"planner.scope must be model or fleet, not {pl.scope!r}")
        if pl.forecast not in ("last", "trend"):
            raise ValueError(f"planner.forecast must be last or trend, not {pl.forecast!r}")
        wq = self.work_queue
        if wq.storage not in ("file", "memory"):
            raise ValueError(f"work_queue.storage must be file or memory, not {wq.storage!r}")
        if min(wq.replicas, wq.max_msgs, wq.max_bytes, wq.max_deliver) < 1 or min(wq.max_age_s, wq.ack_wait_s) <= 0:
            raise ValueError("work_queue: replicas, max_msgs, max_bytes, max_deliver >= 1; max_age_s, ack_wait_s > 0")
        if not 0 < wq.duplicate_window_s <= wq.max_age_s:
            raise ValueError("work_queue: 0 < duplicate_window_s <= max_age_s")
        # (no URL yet: the deployment's environment or the launcher gives it; JetStream refuses too many then)
        if self.mesh.nats_url and wq.replicas > (nodes := len(nats_servers(self.mesh.nats_url))):
            raise ValueError(f"work_queue.replicas = {wq.replicas} but mesh.nats_url lists {nodes} NATS node(s): "
                             "JetStream keeps each copy on another node; list every node's URL, comma-separated")
        for g in self.workers:
            self.model(g.model)
            if g.count < 0 or g.devices < 1 or g.max_batch < 1:
                raise ValueError(f"worker group {g.name!r}: count >= 0, devices >= 1, max_batch >= 1")
            if g.step_tokens < g.max_batch:
                raise ValueError(f"worker group {g.name!r}: step_tokens must be >= max_batch")
            if g.parallel not in PARALLEL or g.prefill_order not in ("fcfs", "shortest"):
                raise ValueError(f"worker group {g.name!r}: parallel is tp | ep | dp, prefill_order fcfs | shortest")
            if not g.sim_slowdown > 0 or g.sim_slowdown_after_s < 0 or (g.sim_slowdown != 1.0 and g.engine != "sim"):
                raise ValueError(f"worker group {g.name!r}: sim_slowdown must be > 0 and sim_slowdown_after_s >= 0, "
                                 "and only the sim engine takes them")
            if why := g.layout_problem():
                raise ValueError(why)
        if self.scheduler.options:  # checked here so every service refuses the file, not just the scheduler
            from hetmesh.placement.policies import check_options  # imports the protocol, not this module

            check_options(self.scheduler.policy, self.scheduler.options)
        return self


    def _validate_tenants(self) -> None:
        fl = self.flow
        if not fl.bands or len(set(fl.bands)) != len(fl.bands) or fl.max_held < 1 or not fl.header or fl.lookahead < 0:
            raise ValueError("flow: bands must be non-empty and unique, max_held >= 1, header non-empty, lookahead >= 0")
        if not 0.0 <= fl.headroom < 1.0:
            raise ValueError(f"flow.headroom must be in [0, 1) (a share of the SLOs), not {fl.headroom}")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"tenants: names must be non-empty and unique, not {names}")
        keys = {k.name for k in self.auth.keys}
        owner: dict[str, str] = {}
        for t in self.tenants:
            if not t.weight > 0 or not math.isfinite(t.weight):
                raise ValueError(f"tenant {t.name!r}: weight must be > 0, not {t.weight}")
            if t.priority not in fl.bands:
                raise ValueError(f"tenant {t.name!r}: priority {t.priority!r} is not a band of flow.bands {fl.bands}")
            if t.rpm < 0 or t.tpm < 0:
                raise ValueError(f"tenant {t.name!r}: rpm and tpm must be >= 0 (0: unlimited)")
            for k in t.keys:
                if k not in keys:
                    raise ValueError(f"tenant {t.name!r}: key {k!r} is not an [[auth.keys]] name ({sorted(keys)})")
                if k in owner:
                    raise ValueError(f"key {k!r} belongs to tenants {owner[k]!r} and {t.name!r}: one tenant a key")
                owner[k] = t.name


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
    if v := env.get("HETMESH_WORK_QUEUE_REPLICAS"):  # a deployment's NATS cluster, whatever the cluster file says
        cfg.work_queue.replicas = int(v)
    if v := env.get("HETMESH_TIME_SCALE"):
        cfg.mesh.time_scale = float(v)
    if v := env.get("HETMESH_POLICY"):
        cfg.scheduler.policy = v
    if v := env.get("HETMESH_EFFICIENCY"):
        cfg.costmodel.efficiency = v
    if v := env.get("HETMESH_GATEWAY_HOST"):
        cfg.gateway.host = v
    if v := env.get("HETMESH_KV_LISTEN_HOST"):
        cfg.kv_transfer.listen_host = v
    if v := env.get("HETMESH_KV_ADVERTISE_HOST"):
        cfg.kv_transfer.advertise_host = v
    if v := env.get("HETMESH_KV_SECRET"):
        cfg.kv_transfer.secret = v
    for var, attr in (("HETMESH_NATS_USER", "nats_user"), ("HETMESH_NATS_PASSWORD", "nats_password"),
                      ("HETMESH_NATS_TOKEN", "nats_token"), ("HETMESH_NATS_CREDS", "nats_creds_file"),
                      ("HETMESH_REDIS_USERNAME", "redis_username"), ("HETMESH_REDIS_PASSWORD", "redis_password")):
        if v := env.get(var):
            setattr(cfg.mesh, attr, v)
    if v := env.get("HETMESH_API_KEYS"):
        keys = [k.strip() for k in v.split(",") if k.strip()]
        cfg.auth.keys += [ApiKey(name=f"env-{i}", sha256=hash_key(k)) for i, k in enumerate(keys)]
    return cfg.validate()


def hash_key(key: str) -> str:
    """How an API key is stored: API keys are long random strings, so a plain SHA-256 suffices."""
    return hashlib.sha256(key.encode()).hexdigest()


def nats_servers(url: str) -> list[str]:
    """The node URLs of a `mesh.nats_url` (one, or a cluster's comma-separated)."""
    return [u.strip() for u in url.split(",") if u.strip()]


def nats_options(mesh: MeshConfig) -> dict[str, object]:
    """nats.connect() keyword arguments for the configured credentials and TLS."""
    opts: dict[str, object] = {}
    if mesh.nats_user:
        opts["user"] = mesh.nats_user
        opts["password"] = mesh.nats_password
    if mesh.nats_token:
        opts["token"] = mesh.nats_token
    if mesh.nats_creds_file:
        opts["user_credentials"] = mesh.nats_creds_file
    if mesh.nats_nkeys_seed_file:
        opts["nkeys_seed"] = mesh.nats_nkeys_seed_file
    if mesh.nats_tls_ca_file or mesh.nats_tls_cert_file:
        import ssl

        ctx = ssl.create_default_context(cafile=mesh.nats_tls_ca_file or None)
        if mesh.nats_tls_cert_file:
            ctx.load_cert_chain(mesh.nats_tls_cert_file, mesh.nats_tls_key_file or None)
        opts["tls"] = ctx
    return opts


def redis_connection(mesh: MeshConfig) -> tuple[str, dict[str, object]]:
    """The Redis URL and redis.asyncio.from_url() keyword arguments for the configured credentials and
    TLS (TLS files turn a redis:// URL into rediss://: redis-py takes ssl_* only on TLS connections)."""
    url = mesh.redis_url
    opts: dict[str, object] = {}
    if mesh.redis_username:
        opts["username"] = mesh.redis_username
    if mesh.redis_password:
        opts["password"] = mesh.redis_password
    for attr, kw in (("redis_tls_ca_file", "ssl_ca_certs"), ("redis_tls_cert_file", "ssl_certfile"),
                     ("redis_tls_key_file", "ssl_keyfile")):
        if v := getattr(mesh, attr):
            opts[kw] = v
    if any(k.startswith("ssl_") for k in opts) and url.startswith("redis://"):
        url = "rediss://" + url[len("redis://"):]
    return url, opts
