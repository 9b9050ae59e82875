"""Every message that crosses the mesh: msgspec Structs, JSON on the wire.

JSON (not msgpack) so that `nats sub 'hetmesh.>'` shows readable traffic. Request id and
trace context travel in NATS headers (see hetmesh.bus), not in the bodies.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from msgspec import Struct, field


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class Phase(StrEnum):
    FULL = "full"  # prefill and decode on one worker (aggregated)
    PREFILL = "prefill"  # prefill, first token, then ship the KV to the decode worker
    DECODE = "decode"  # wait for the KV to land, then decode


class SamplingParams(Struct, frozen=True, kw_only=True):
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # OpenAI / vLLM sampling options; every default means "off", so engines that lack one see its default.
    top_k: int = 0  # 0: off (vLLM's -1)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # None: none; k: each sampled token's logprob and the top k
    structured: StructuredOutput | None = None  # constrained decoding (vLLM's structured outputs)
    skip_special_tokens: bool = True  # False: a tool-call parser needs its special tokens in the text


class StructuredOutput(Struct, frozen=True, kw_only=True):
    """What the output must match: one of these (vLLM's StructuredOutputsParams)."""

    json_schema: str = ""  # a JSON Schema, as JSON text
    json_object: bool = False  # any JSON object


class TokenLogprob(Struct, frozen=True, array_like=True):
    """One generated token's logprob and the `top` most likely alternatives (id, logprob) at its step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class InferenceRequest(Struct, kw_only=True):
    """What the gateway hands the scheduler: already tokenized and block-hashed."""

    request_id: str
    model: str
    prompt_tokens: list[int]
    block_hashes: list[int]  # chained hashes of the full blocks (hetmesh.kvindex.blocks)
    sampling: SamplingParams
    reply_subject: str  # where the workers stream TokenChunk / RequestError
    arrival_ts: float  # gateway wall clock, seconds
    attempt: int = 0
    exclude_workers: list[str] = field(default_factory=list)  # e.g. the worker that died on attempt 0
    # Migration: the last `continued` of prompt_tokens are completion tokens the gateway already has (an
    # earlier attempt's worker died or drained); the worker goes on after them, numbering its chunks from
    # `continued`, with sampling.max_tokens already reduced by them and the sampler's stream advanced past them.
    continued: int = 0
    priority: int = 0  # vLLM's request priority: the engine's queue serves lower values first
    tenant: str = ""  # flow control's tenant (from the API key or the tenant header); "": the default tenant
    # Seconds its client already waited on earlier tries that the mesh refused (a retry of a 429 / 503): its TTFT
    # runs from its first send, and admission judges it so (hetmesh.gateway.retries).
    waited_s: float = 0.0
    # Placed again after a scheduler withdrew an earlier placement of it (hetmesh.placement.withdrawal): this
    # placement stays where it lands, so withdrawals never chase each other.
    moved: bool = False


class Placement(Struct, frozen=True, kw_only=True):
    mode: Literal["aggregated", "disaggregated"]
    decode_worker: str  # the aggregated worker, or the decode side of a split
    prefill_worker: str | None = None
    expected_cached_tokens: int = 0
    policy: str = ""
    reason: str = ""
    # The cost model's prediction for this placement (engine seconds); None from policies without one.
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    # Disaggregated, direct data plane: the decode worker's KV port (from its heartbeats), so the prefill
    # worker streams the KV there at once instead of asking kv-transfer first. Empty: ask kv-transfer.
    decode_kv_endpoint: str = ""


class WorkerStatus(Struct, kw_only=True):
    """One worker as the scheduler sees it (its last heartbeat plus work placed since)."""

    worker_id: str
    model: str
    accelerator: str
    role: Role
    engine: str
    devices: int
    queue_depth: int
    running: int
    max_batch: int
    kv_blocks_used: int
    kv_blocks_total: int
    heartbeat_age_s: float
    tokens_generated: int = 0
    kv_endpoint: str = ""  # its KV port (direct data plane); empty: it takes no direct KV
    draining: bool = False
    moving_to: str = ""  # the role it is switching to (the planner's RoleSwitch or ModelSwitch); empty: not moving
    moving_model: str = ""  # the model it is switching to (ModelSwitch: drain, reload); empty: it keeps its model
    parallel: str = "tp"  # its layout over its devices now (tp | ep | dp; a ModelSwitch may change it)
    wedged: bool = False  # running requests, heartbeats on, no token in or out for mesh.wedge_timeout_s: placed on no more
    # Its speed learned from its engine's steps, against the catalog prior (> 1: faster; 1.0 until it reports),
    # the fit's relative std of that typical step's time, the steps it was fitted on, and its step time over its peers' (degraded
    # past the scheduler's alarm ratio)
    speed: float = 1.0
    speed_rel_std: float = 0.0
    fitted_steps: int = 0
    vs_peers: float = 1.0
    degraded: bool = False
    # The learned factors themselves (compute, memory, overhead_s, per_seq_s; empty until it reports) and the model
    # name its cost model keys efficiency files by ("<accelerator>/<cost_model>"): what `hetmesh calibrate` saves
    efficiency: dict[str, float] = field(default_factory=dict)
    cost_model: str = ""


class SchedulerStatus(Struct, kw_only=True):
    """Scheduler -> gateway's /ready and `hetmesh status`: it is subscribed and these workers are in its view."""

    instance: str
    policy: str
    workers: list[str]
    details: list[WorkerStatus] = field(default_factory=list)
    in_flight: int = 0
    tenants: dict[str, dict[str, float]] = field(default_factory=dict)  # flow control's per-tenant figures


class ErrorInfo(Struct, frozen=True, kw_only=True):
    """OpenAI-shaped error body parts; `status` is the HTTP status the gateway returns."""

    message: str
    type: str = "server_error"
    code: str | None = None
    param: str | None = None
    status: int = 500
    retry_after_s: float | None = None  # overload / rate limit: the gateway's Retry-After


class SubmitReply(Struct, kw_only=True):
    request_id: str
    placement: Placement | None = None
    error: ErrorInfo | None = None


class WorkItem(Struct, kw_only=True):
    """Scheduler -> worker, on the worker's direct work subject."""

    request: InferenceRequest
    phase: Phase
    placement: Placement


class Usage(Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


# Worker -> gateway on the request's reply subject. A tagged union so one decoder reads all.
class TokenChunk(Struct, tag="tokens", kw_only=True):
    request_id: str
    worker_id: str
    index: int  # position of token_ids[0] in the completion; lets the gateway drop duplicates
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    usage: Usage | None = None  # on the last chunk
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for logprobs


class RequestError(Struct, tag="error", kw_only=True):
    request_id: str
    error: ErrorInfo
    retryable: bool = False  # nothing was streamed yet: the gateway may resubmit


class WorkerLost(Struct, tag="lost", kw_only=True):
    """Scheduler -> gateway: a worker holding this request stopped heartbeating."""

    request_id: str
    worker_id: str


class Working(Struct, tag="working", kw_only=True):
    """Worker -> gateway, every quarter of mesh.stall_timeout_s while it holds a request that has no token from
    it yet (queued, prefilling, waiting for its KV) and its engine moves: a prefill longer than the stall
    timeout is not taken for a stall. An engine that stops moving stops these too."""

    request_id: str
    worker_id: str


ResponseEvent = TokenChunk | RequestError | WorkerLost | Working


class Cancel(Struct, kw_only=True):
    request_id: str
    reason: str = "client_disconnected"
    # Set: only this worker drops the request (a worker counted lost and back: what it held was failed over, and
    # its new attempt, elsewhere, goes on); the request itself is not over. Empty: every worker drops it.
    worker_id: str = ""
    # Set (with worker_id): that worker drops only its item of this phase and attempt, not the request: a
    # P/D placement withdrawn because another placement of the attempt streams it (hetmesh.workqueue.withdrawals),
    # whose FULL the same worker may hold. None: whatever it holds of the request.
    phase: Phase | None = None
    attempt: int = 0


class Resume(Struct, kw_only=True):
    """Gateway -> all workers: this attempt's stream has a hole (the bus went away while tokens were on
    it); whoever published chunks to `reply_subject` publishes those from `from_index` on again."""

    reply_subject: str
    from_index: int


class Finished(Struct, kw_only=True):
    """Worker -> scheduler when a request leaves the worker, so in-flight bookkeeping ends."""

    request_id: str
    worker_id: str
    finish_reason: str
    completion_tokens: int = 0
    ts: float = 0.0  # the worker's clock, comparable with its Heartbeat.ts
    attempt: int = 0  # set where finish_reason is "withdrawn": which attempt's placement went


# Per-request records nobody waits on travel batched: one JSON array per few ms per service.
FinishedBatch = list[Finished]


class Booking(Struct, frozen=True, kw_only=True):
    """What a cost-policy placement adds to the policy's own bookkeeping (CostPolicy.booked), in numbers another
    scheduler replica can book the same way."""

    prefill_s: float = 0.0  # prefill seconds queued on the prefill worker
    stolen_s: float = 0.0  # of which the decodes beside it there lose
    first_token_s: float = 0.0  # from placing to its first token on the decode worker (TTFT and KV transfer)
    decode_step_s: float = 0.0  # its decode step there, no prefill beside it
    tpot_s: float = 0.0  # its predicted step there, slowed by the prefill share (0: decode_step_s)
    full_chunk_s: float = 0.0  # what one full prefill chunk beside it adds to that step
    decode_batch: int = 1  # the decode worker's max_batch
    max_tokens: int = 1
    tpot_slo_s: float = 0.0
    placed_at: float = 0.0  # the policy's clock when placed (RequestInfo.arrival: the gateways' clock)


class Booked(Struct, kw_only=True):
    """Scheduler -> every scheduler: a placement it made. The others count it on its workers until their next
    heartbeats and book it in their policy (CostPolicy.booked), so no replica prices the fleet as if its own
    placements were the only ones."""

    scheduler: str  # the placing scheduler's instance (a scheduler skips its own)
    request_id: str
    decode_worker: str
    prefill_worker: str | None = None
    booking: Booking | None = None  # Decision.booking
    # When it was placed (the placing scheduler's wall clock): with `scheduler`, the order every scheduler
    # agrees on for two placements on one worker (hetmesh.placement.withdrawal)
    placed_at: float = 0.0
    withdrawn: bool = False  # taken back: un-book it (its request is placed again, maybe by another scheduler)


BookedBatch = list[Booked]


class StepSample(Struct, frozen=True, array_like=True):
    """One engine step's totals and its wall seconds (in engine time): compact on the bus as an array."""

    prefill_tokens: int
    prefill_seqs: int
    prefill_pairs: float
    prefill_cached: int
    n_decode: int
    decode_context: int
    seconds: float

    @classmethod
    def of(cls, step: object, seconds: float) -> StepSample:
        """From anything with hetmesh.batching.Step's totals."""
        s = step
        return cls(s.prefill_tokens, s.prefill_seqs, float(s.prefill_pairs), s.prefill_cached,  # type: ignore[attr-defined]
                   s.n_decode, s.decode_context, float(seconds))  # type: ignore[attr-defined]


class Heartbeat(Struct, kw_only=True):
    worker_id: str
    model: str
    accelerator: str  # catalog id, e.g. "amd-mi300x"
    vendor: str
    devices: int  # accelerators behind this worker (one server = 8)
    role: Role
    engine: str
    work_subject: str  # this worker's direct work subject
    queue_depth: int  # waiting, not yet running
    running: int  # in the running batch
    max_batch: int
    kv_blocks_total: int
    kv_blocks_used: int
    block_size: int
    ts: float
    tokens_generated: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    aborted: int = 0
    kv_endpoint: str = ""  # host:port of this worker's KV port (hetmesh.kvstream); empty: it takes no direct KV
    parallel: str = "tp"  # tp | ep | dp layout over the devices (the cost policy prices it)
    step_tokens: int = 8192  # the engine's per-step token budget (prefill chunk size)
    draining: bool = False  # shutting down: finishing what it holds, taking no new work (not lost)
    moving_to: str = ""  # switching to this role (with draining: no work of the old role is placed here)
    # ... and to this model (a ModelSwitch: engine released and reloaded). `model` stays the old one until the
    # move is over; the first heartbeat after it says the new model, and neither moving field.
    moving_model: str = ""
    ready_in_s: float = 0.0  # moving: about how long until it serves again (wall seconds; 0: not moving)
    # This run of the worker process (new at every start): a worker back under the same id faster than the
    # heartbeat timeout holds none of what its last run held, and only this tells the scheduler so.
    instance: str = ""
    # This run's heartbeats numbered from 1: a heartbeat that arrives after a later one of the same run (delayed
    # on the bus, e.g. a partitioned worker's flushed late) is stale and dropped. 0: not numbered (older workers).
    seq: int = 0
    # A bounded sample of its engine's steps since the last heartbeat (totals and engine seconds, an array each):
    # what the scheduler learns this worker's speed from (hetmesh.costmodel.learn)
    steps: list[StepSample] = field(default_factory=list)
    # Per request served since the last report, its time to first token outside the engine's steps (engine
    # seconds: hand-off, input and output processing): what the scheduler adds to its priced TTFT here.
    first_token_gaps: list[float] = field(default_factory=list)


class KvEvent(Struct, kw_only=True):
    """Worker -> kv index: prefix blocks stored in / evicted from the worker's cache."""

    worker_id: str
    model: str
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False  # the worker dropped its whole cache (e.g. restart)
    ts: float = 0.0


class KvResync(Struct, kw_only=True):
    """Scheduler -> every worker: republish your whole prefix cache (the index was lost, e.g. Redis restarted)."""

    reason: str = ""


class KvTransferRequest(Struct, kw_only=True):
    """Prefill worker -> kv-transfer: move this request's KV to the decode worker."""

    transfer_id: str
    request_id: str
    model: str
    src_worker: str
    dst_worker: str
    num_tokens: int
    nbytes: int
    chunk_bytes: int
    first_token_ids: list[int]  # what prefill generated; decode continues after them
    first_text: str = ""
    cached_tokens: int = 0  # prefill side's prefix-cache hit, for the decode side's final Usage
    # Set: a notice, not a question. The source already streams to this KV port (it came with the placement);
    # kv-transfer only opens its record, which the source's KvTransferDone closes.
    endpoint: str = ""
    # vLLM's hand-over: the prefill output's kv_transfer_params (its KV connector's), given as they are to the
    # decode request. Ours name the shards in the bytes; NixlConnector's name the blocks the decode side reads.
    kv_transfer_params: dict[str, Any] | None = None


class KvTransferAccept(Struct, kw_only=True):
    transfer_id: str
    data_subject: str = ""  # relay: where the source publishes the raw chunks
    endpoint: str = ""  # direct: the decode worker's KV port, stream the bytes there (hetmesh.kvstream)


class KvTransferDone(Struct, kw_only=True):
    """Prefill worker -> kv-transfer, after a direct stream: how it went (for kv-transfer's records)."""

    transfer_id: str
    request_id: str
    nbytes: int
    duration_s: float
    ok: bool = True
    error: str | None = None


class KvLanded(Struct, kw_only=True):
    """kv-transfer -> decode worker: every byte arrived; decoding may start."""

    transfer_id: str
    request_id: str
    src_worker: str
    nbytes: int
    chunks: int
    duration_s: float
    first_token_ids: list[int]
    first_text: str = ""
    ok: bool = True
    error: str | None = None
    cached_tokens: int = 0  # copied from KvTransferRequest
    direct: bool = False  # the bytes came by the KV stream and already sit in the engine's sink
    kv_transfer_params: dict[str, Any] | None = None  # copied from KvTransferRequest

    @classmethod
    def of(cls, req: KvTransferRequest, *, nbytes: int = 0, chunks: int = 0, duration_s: float = 0.0,
           ok: bool = True, error: str | None = None, direct: bool = False) -> KvLanded:
        """How transfer `req` ended, with the first tokens it carries for the decode side."""
        return cls(transfer_id=req.transfer_id, request_id=req.request_id, src_worker=req.src_worker, nbytes=nbytes,
                   chunks=chunks, duration_s=duration_s, first_token_ids=req.first_token_ids,
                   first_text=req.first_text, ok=ok, error=error, cached_tokens=req.cached_tokens, direct=direct,
                   kv_transfer_params=req.kv_transfer_params)


class ServiceEvent(Struct, kw_only=True):
    """A service's own record of what it did with a request; `nats sub 'hetmesh.event.>'` shows them."""

    service: str
    instance: str
    request_id: str
    kind: str  # e.g. "placed", "prefill_done", "kv_landed", "decode_done", "aborted"
    ts: float
    detail: dict[str, str | int | float | bool | None] = field(default_factory=dict)


EventBatch = list[ServiceEvent]  # the body of every `hetmesh.event.<service>` message


class ModelDemandStats(Struct, frozen=True, kw_only=True):
    """One model's demand over the scheduler's last window (hetmesh.planner.live.DemandWindow)."""

    model: str
    requests: int  # submitted in the window
    rate: float  # arrivals per second
    prompt_mean: float  # prompt tokens
    output_mean: float  # completion tokens of the requests that finished in the window (0: none did)
    max_tokens_mean: float  # what the requests asked for: the output estimate before any finished
    prefix_hit: float  # share of prompt tokens the placement expected in a prefix cache
    slo_attainment: float | None = None  # share of finished requests within their SLOs; None: not measured


class TurnedAway(Struct, frozen=True, kw_only=True):
    """Gateway -> scheduler on `hetmesh.sched.turned_away`: a request refused before it reached a scheduler
    (no live worker serves its model). Demand all the same: without it a planner would never bring a
    worker back to a model that has none."""

    model: str
    prompt_tokens: int
    max_tokens: int
    code: str


class DemandReport(Struct, frozen=True, kw_only=True):
    """Scheduler -> planner on `hetmesh.sched.demand` every planner.interval_s."""

    instance: str
    window_s: float
    ts: float
    models: list[ModelDemandStats] = field(default_factory=list)


class RoleSwitch(Struct, frozen=True, kw_only=True, tag="role_switch"):
    """Planner -> one worker on `hetmesh.worker.command.<worker_id>`: serve `role` from now on (no reload)."""

    worker_id: str
    role: Role
    planner: str  # the instance that holds the lease
    reason: str = ""


class ModelSwitch(Struct, frozen=True, kw_only=True, tag="model_switch"):
    """Planner -> one worker on `hetmesh.worker.command.<worker_id>`: serve `model` in `role` (and `parallel`, the
    layout over its devices) from now on. The worker drains (finishes or hands over what it holds), releases
    its engine, loads the model's in that layout, rejoins. A layout change of the same model is a reload too."""

    worker_id: str
    model: str
    role: Role
    planner: str  # the instance that holds the lease
    reason: str = ""
    seconds: float = 0.0  # the planner's estimate of the move (drain + weights / storage bandwidth)
    parallel: str = ""  # tp | ep | dp after the move; empty: keep the worker's


WorkerCommand = RoleSwitch | ModelSwitch  # the body of every `hetmesh.worker.command.<worker_id>` message


class ProposedMove(Struct, frozen=True, kw_only=True):
    worker_id: str
    change: str  # role | reload | stop (hetmesh.planner.Move.change)
    before: str
    after: str
    seconds: float  # out of service this long


class PlanProposal(Struct, frozen=True, kw_only=True):
    """The leading planner's proposal on `hetmesh.planner.plan`: today's layout, the proposed one, the moves."""

    planner: str
    mode: str  # advise | act
    ts: float
    chosen: str  # the planner's candidate name ("current": stay)
    current: dict[str, str] = field(default_factory=dict)  # worker -> model/role
    proposed: dict[str, str] = field(default_factory=dict)
    moves: list[ProposedMove] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)  # workers a command went to (act mode, within the cap)
    predicted_goodput_tok_s: float = 0.0
    current_goodput_tok_s: float = 0.0
