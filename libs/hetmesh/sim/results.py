"""What a simulation run returns: one record per served request, stats per worker (metrics.py sums them up)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    arrival: float
    first_token: float
    finish: float
    input_len: int
    output_len: int
    cached_tokens: int
    mode: str
    prefill_worker: str
    decode_worker: str
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    model: str = ""
    tenant: str = ""

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        return (self.finish - self.first_token) / (self.output_len - 1) if self.output_len > 1 else 0.0


@dataclass
class WorkerStats:
    worker_id: str
    pool: str
    accelerator: str
    role: str
    busy_s: float
    prefill_tokens: int
    decode_tokens: int
    preempted: int = 0
    devices: int = 1


@dataclass
class SimResult:
    records: list[RequestRecord]
    workers: list[WorkerStats]
    start: float
    end: float
    kv_transfer_bytes: int
    rejected: int
    policy: str
    steps: dict[str, list[tuple[object, ...]]] = field(default_factory=dict)  # with SimConfig.record_steps
    refused: int = 0  # of `rejected`: refused by admission
    rejected_models: dict[str, int] = field(default_factory=dict)  # `rejected` per model
    retried: int = 0  # refusals retried by their client (SimConfig.client_retries)
    held: int = 0  # refusals the scheduler held and placed again (Decision.hold_s)
    rejected_tenants: dict[str, int] = field(default_factory=dict)  # `rejected` per tenant
    flow: dict[str, Any] = field(default_factory=dict)  # flow control's TenantStats per tenant (SimConfig.tenants)
    policy_calls: int = 0  # placements asked of the policy (each a scheduler's placement's CPU)
