"""Discrete-event cluster simulator: the scheduler's own policies against cost-model workers.

Virtual time only. Each simulated worker is a continuous-batching engine (the vLLM / SGLang
shape): every step runs all decoding sequences plus prefill chunks up to a token budget, and
lasts what `CostModel.step_time_totals` says. Requests reach workers through the very
`Policy.place(RequestInfo, [WorkerView])` call the live scheduler makes; the simulator builds
the `WorkerView`s from its worker state instead of from heartbeats (no staleness). A
disaggregated request prefills on one worker, emits its first token there, ships its KV over
the servers' NICs (`link_bandwidth`, queued per NIC) and decodes on another.

KV memory: an aggregated request reserves prompt + output tokens when its prefill starts, a
decode-side request when it is admitted to the batch (no preemption). Prefix caches are LRU
sets of trace block ids per worker, bounded by the worker's KV capacity, with a global
block -> workers index standing in for the Redis prefix index.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from hetmesh.config import ClusterConfig
from hetmesh.costmodel import CostModel, Efficiency, accelerator, link_bandwidth, model_spec
from hetmesh.costmodel.model import DEFAULT_LINK_LATENCY_S
from hetmesh.placement import Policy, RequestInfo, WorkerView
from hetmesh.protocol import Role
from hetmesh.sim.traces import ClosedLoop, Trace, TraceRequest

_ARRIVAL, _STEP_END, _KV_LANDED = 0, 1, 2


@dataclass(frozen=True)
class WorkerSpec:
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


def workers_from_config(cfg: ClusterConfig) -> list[WorkerSpec]:
    out: list[WorkerSpec] = []
    for g in cfg.workers:
        m = cfg.model(g.model)
        for wid in g.worker_ids():
            out.append(WorkerSpec(worker_id=wid, pool=g.name, model=m.name, spec=m.spec, accelerator=g.accelerator,
                                  devices=g.devices, role=g.role, max_batch=g.max_batch, parallel=g.parallel,
                                  dtype=m.dtype, kv_tokens=g.kv_blocks * m.block_size, block_size=m.block_size))
    return out


def pool(name: str, n: int, accelerator: str, role: Role | str = Role.BOTH, *, model: str = "deepseek-r1",
         spec: str | None = None, devices: int = 8, max_batch: int = 64, **kw: object) -> list[WorkerSpec]:
    """`n` identical workers named <name>-<i>."""
    return [WorkerSpec(worker_id=f"{name}-{i}", pool=name, model=model, spec=spec or model, accelerator=accelerator,
                       devices=devices, role=Role(role), max_batch=max_batch, **kw)  # type: ignore[arg-type]
            for i in range(n)]


@dataclass
class SimConfig:
    chunk_tokens: int = 8192  # prefill tokens + decode tokens per step (max_num_batched_tokens)
    # which queued prompt a worker starts next: "fcfs", or "shortest" (fewest uncached prompt tokens;
    # prompts already started keep going first, they hold memory)
    prefill_order: str = "fcfs"
    link_latency_s: float = DEFAULT_LINK_LATENCY_S
    efficiencies: Mapping[str, Efficiency] = field(default_factory=dict)  # accelerator id -> factors
    prefix_caching: bool = True
    max_time_s: float = float("inf")  # stop the run at this virtual time


class _Req:
    __slots__ = ("arrival", "cached", "decision", "dw", "finish", "first", "hashes", "kv_at_d", "kv_at_p", "mode",
                 "n_in", "n_out", "pdone", "pw", "rid")

    def __init__(self, rid: int, tr: TraceRequest, arrival: float) -> None:
        self.rid = rid
        self.arrival = arrival
        self.n_in = tr.input_len
        self.n_out = tr.output_len
        self.hashes = tr.hash_ids
        self.cached = 0
        self.pdone = 0  # prompt tokens in KV so far (cached + computed)
        self.first = -1.0
        self.finish = -1.0
        self.mode = ""
        self.pw: _Worker | None = None
        self.dw: _Worker | None = None
        self.decision = None
        self.kv_at_p = 0
        self.kv_at_d = 0


class _Worker:
    __slots__ = ("busy", "busy_time", "cache", "cache_cap", "cm", "ctx_sum", "decode_tokens", "inbound", "kv_cap",
                 "kv_used", "n_prefilling", "nic_free", "pending", "prefill_tokens", "running", "spec", "step_no",
                 "step_parts", "step_start", "version", "view", "waiting")

    def __init__(self, spec: WorkerSpec, cm: CostModel) -> None:
        self.spec = spec
        self.cm = cm
        self.kv_cap = spec.kv_tokens or cm.max_kv_tokens()
        self.kv_used = 0
        self.waiting: deque[_Req] = deque()  # prefill queue
        self.pending: deque[_Req] = deque()  # KV landed, waiting for a decode slot
        self.running: list[tuple[int, int, _Req]] = []  # heap of (finishing step, rid, req)
        self.ctx_sum = 0
        self.n_prefilling = 0
        self.step_no = 0
        self.busy = False
        self.step_parts: list[tuple[_Req, int]] = []
        self.step_start = 0.0
        self.busy_time = 0.0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.inbound = 0
        self.nic_free = 0.0
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.cache_cap = 0
        self.version = 0
        self.view: WorkerView | None = None


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


@dataclass
class SimResult:
    records: list[RequestRecord]
    workers: list[WorkerStats]
    start: float
    end: float
    kv_transfer_bytes: int
    rejected: int
    policy: str


class Simulator:
    def __init__(self, workers: Sequence[WorkerSpec], policy: Policy, config: SimConfig | None = None) -> None:
        self.cfg = config or SimConfig()
        if self.cfg.prefill_order not in ("fcfs", "shortest"):
            raise ValueError(f"prefill_order must be 'fcfs' or 'shortest', not {self.cfg.prefill_order!r}")
        self._shortest = self.cfg.prefill_order == "shortest"
        self.policy = policy
        cms: dict[tuple, CostModel] = {}
        self.workers: list[_Worker] = []
        for s in workers:
            key = (s.accelerator, s.spec, s.devices, s.parallel, s.dtype)
            if key not in cms:
                cms[key] = CostModel(accelerator(s.accelerator), model_spec(s.spec), devices=s.devices,
                                     parallel=s.parallel, dtype=s.dtype,
                                     efficiency=self.cfg.efficiencies.get(s.accelerator))
            self.workers.append(_Worker(s, cms[key]))
        self.by_id = {w.spec.worker_id: w for w in self.workers}
        self._links: dict[tuple[str, str], float] = {}
        self._holders: dict[int, set[str]] = {}
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self.now = 0.0
        self.records: list[RequestRecord] = []
        self.kv_bytes = 0
        self.rejected = 0

    # ---- event plumbing ----
    def _push(self, t: float, kind: int, obj: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, obj))

    # ---- the policy's view of the cluster ----
    def _views(self) -> list[WorkerView]:
        out = []
        for w in self.workers:
            if w.view is None:
                s = w.spec
                w.view = WorkerView(worker_id=s.worker_id, model=s.model, accelerator=s.accelerator,
                                    vendor=s.accelerator.split("-", 1)[0], devices=s.devices, role=s.role,
                                    queue_depth=len(w.waiting) - w.n_prefilling + len(w.pending) + w.inbound,
                                    running=len(w.running) + w.n_prefilling, max_batch=s.max_batch,
                                    kv_blocks_total=w.kv_cap // s.block_size,
                                    kv_blocks_used=w.kv_used // s.block_size, block_size=s.block_size)
            out.append(w.view)
        return out

    def _cached_blocks(self, hashes: tuple[int, ...]) -> dict[str, int]:
        """Leading blocks each worker holds (the prefix index lookup)."""
        if not hashes or not self.cfg.prefix_caching:
            return {}
        holders = self._holders
        live = holders.get(hashes[0])
        if not live:
            return {}
        live = set(live)
        out: dict[str, int] = {}
        for i in range(1, len(hashes)):
            nxt = holders.get(hashes[i])
            keep = live & nxt if nxt else set()
            for w in live - keep:
                out[w] = i
            live = keep
            if not live:
                break
        for w in live:
            out[w] = len(hashes)
        return out

    def _cache_insert(self, w: _Worker, hashes: tuple[int, ...]) -> None:
        if not hashes or not self.cfg.prefix_caching:
            return
        cache, holders, wid = w.cache, self._holders, w.spec.worker_id
        for h in hashes:
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
                holders.setdefault(h, set()).add(wid)
        while len(cache) > w.cache_cap:
            h, _ = cache.popitem(last=False)
            s = holders.get(h)
            if s is not None:
                s.discard(wid)
                if not s:
                    del holders[h]

    # ---- request lifecycle ----
    def _arrive(self, req: _Req, block_tokens: int) -> None:
        cached = self._cached_blocks(req.hashes)
        info = RequestInfo(request_id=str(req.rid), model=self._model, prompt_len=req.n_in, max_tokens=req.n_out, cached_blocks=cached,
                           block_size=block_tokens, arrival=self.now)
        d = self.policy.place(info, self._views())
        if d is None:
            self.rejected += 1
            self._done(req, rejected=True)
            return
        req.decision = d
        dw = self.by_id[d.decode_worker]
        pw = self.by_id[d.prefill_worker] if d.prefill_worker else dw
        req.mode = "aggregated" if pw is dw else "disaggregated"
        req.pw, req.dw = pw, dw
        req.cached = info.cached_tokens(pw.spec.worker_id)
        req.pdone = req.cached
        pw.waiting.append(req)
        pw.view = None
        if req.mode == "disaggregated":
            dw.inbound += 1
            dw.view = None
        if not pw.busy:
            self._start_step(pw)

    def _start_step(self, w: _Worker) -> None:
        s = w.spec
        w.view = None
        # decode admissions: KV that has landed, while batch slots and memory last
        pending = w.pending
        while pending and len(w.running) + w.n_prefilling < s.max_batch:
            r = pending[0]
            need = r.n_in + r.n_out
            if w.kv_used + need > w.kv_cap and w.running:
                break
            pending.popleft()
            w.kv_used += need
            r.kv_at_d = need
            heapq.heappush(w.running, (w.step_no + r.n_out - 1, r.rid, r))
            w.ctx_sum += r.n_in + 1
            self._cache_insert(w, r.hashes)
        n_dec = len(w.running)
        budget = self.cfg.chunk_tokens - n_dec
        parts: list[tuple[_Req, int]] = []
        pf_new = pf_pairs = pf_cached = 0
        queue: Sequence[_Req] = w.waiting
        if self._shortest and len(w.waiting) > 1:
            queue = sorted(w.waiting, key=lambda r: (r.kv_at_p == 0, r.n_in - r.pdone))
        for r in queue:
            if budget <= 0:
                break
            if r.kv_at_p == 0:  # not started: admit to memory and batch
                need = r.n_in + (r.n_out if r.mode == "aggregated" else 0)
                if n_dec + w.n_prefilling >= s.max_batch or (w.kv_used + need > w.kv_cap and (w.running or parts)):
                    break
                w.kv_used += need
                r.kv_at_p = need
                w.n_prefilling += 1
            new = min(r.n_in - r.pdone, budget)  # >= 1: a cache hit never covers the last prompt token
            budget -= new
            parts.append((r, new))
            pf_new += new
            pf_pairs += new * r.pdone + new * (new + 1) // 2
            pf_cached += r.pdone
        if not parts and not n_dec:
            w.busy = False
            return
        dt = w.cm.step_time_totals(pf_new, len(parts), pf_pairs, pf_cached, n_dec, w.ctx_sum)
        w.busy = True
        w.step_parts = parts
        w.step_start = self.now
        w.prefill_tokens += pf_new
        w.decode_tokens += n_dec
        self._push(self.now + dt, _STEP_END, w)

    def _end_step(self, w: _Worker) -> None:
        now = self.now
        w.busy_time += now - w.step_start
        w.view = None
        w.step_no += 1
        running = w.running
        w.ctx_sum += len(running)
        while running and running[0][0] <= w.step_no:
            _, _, r = heapq.heappop(running)
            w.ctx_sum -= r.n_in + r.n_out
            w.kv_used -= r.kv_at_d
            r.finish = now
            self._done(r)
        for r, new in w.step_parts:
            r.pdone += new
            if r.pdone < r.n_in:
                continue
            if w.waiting[0] is r:
                w.waiting.popleft()
            else:
                w.waiting.remove(r)
            w.n_prefilling -= 1
            r.first = now
            self._cache_insert(w, r.hashes)
            if r.n_out <= 1:
                w.kv_used -= r.kv_at_p
                r.finish = now
                if r.mode == "disaggregated":
                    assert r.dw is not None
                    r.dw.inbound -= 1
                    r.dw.view = None
                self._done(r)
            elif r.mode == "aggregated":
                r.kv_at_d, r.kv_at_p = r.kv_at_p, 0
                heapq.heappush(running, (w.step_no + r.n_out - 1, r.rid, r))
                w.ctx_sum += r.n_in + 1
            else:
                self._ship_kv(w, r)
        w.step_parts = []
        self._start_step(w)

    def _ship_kv(self, src: _Worker, r: _Req) -> None:
        dst = r.dw
        assert dst is not None
        key = (src.spec.worker_id, dst.spec.worker_id)
        bw = self._links.get(key)
        if bw is None:
            bw = self._links[key] = link_bandwidth(src.cm.accel, src.spec.devices, dst.cm.accel, dst.spec.devices)
        nbytes = r.n_in * src.cm.kv_bytes_per_token()
        self.kv_bytes += nbytes
        start = max(self.now, src.nic_free, dst.nic_free)
        end = start + self.cfg.link_latency_s + nbytes / bw
        src.nic_free = dst.nic_free = end
        self._push(end, _KV_LANDED, r)

    def _landed(self, r: _Req) -> None:
        p, d = r.pw, r.dw
        assert p is not None and d is not None
        p.kv_used -= r.kv_at_p
        r.kv_at_p = 0
        p.view = None
        d.inbound -= 1
        d.pending.append(r)
        d.view = None
        if not d.busy:
            self._start_step(d)
        if not p.busy:  # memory freed may unblock a waiting prefill
            self._start_step(p)

    def _done(self, r: _Req, rejected: bool = False) -> None:
        if not rejected:
            d = r.decision
            self.records.append(RequestRecord(
                r.arrival, r.first, r.finish, r.n_in, r.n_out, r.cached, r.mode,
                r.pw.spec.worker_id if r.pw else "", r.dw.spec.worker_id if r.dw else "",
                getattr(d, "predicted_ttft_s", None), getattr(d, "predicted_tpot_s", None)))
            if r.dw is not None and r.dw is not r.pw:
                r.dw.view = None
        self._finished += 1
        if self._source is not None:
            nxt = self._source.next(self.now)
            if nxt is not None:
                self._push(self.now, _ARRIVAL, nxt)

    # ---- driver ----
    def run(self, trace: Trace | ClosedLoop, progress: Callable[[int, int], None] | None = None) -> SimResult:
        models = {w.spec.model for w in self.workers}
        if len(models) != 1:
            raise ValueError(f"the simulator replays a one-model trace; workers serve {sorted(models)}")
        self._model = models.pop()
        block_tokens = trace.block_tokens
        for w in self.workers:
            w.cache_cap = max(w.kv_cap // block_tokens, 1)
        self._finished = 0
        self._source: ClosedLoop | None = None
        if isinstance(trace, ClosedLoop):
            self._source = trace
            total = trace.total
            for _ in range(trace.concurrency):
                tr = trace.next(0.0)
                if tr is not None:
                    self._push(0.0, _ARRIVAL, tr)
            opened = iter(())
        else:
            total = len(trace)
            opened = iter(trace.requests)
            first = next(opened, None)
            if first is not None:
                self._push(first.arrival, _ARRIVAL, first)
        rid = 0
        events = self._events
        pop = heapq.heappop
        tick = max(total // 200, 1)
        t_start = events[0][0] if events else 0.0
        while events:
            t, _, kind, obj = pop(events)
            if t > self.cfg.max_time_s:
                break
            self.now = t
            if kind == _STEP_END:
                self._end_step(obj)  # type: ignore[arg-type]
            elif kind == _ARRIVAL:
                tr: TraceRequest = obj  # type: ignore[assignment]
                if self._source is None:
                    nxt = next(opened, None)
                    if nxt is not None:
                        self._push(nxt.arrival, _ARRIVAL, nxt)
                self._arrive(_Req(rid, tr, t), block_tokens)
                rid += 1
                if progress is not None and rid % tick == 0:
                    progress(self._finished, total)
            else:
                self._landed(obj)  # type: ignore[arg-type]
        if progress is not None:
            progress(self._finished, total)
        end = max((r.finish for r in self.records), default=self.now)
        stats = [WorkerStats(w.spec.worker_id, w.spec.pool, w.spec.accelerator, str(w.spec.role), w.busy_time,
                             w.prefill_tokens, w.decode_tokens) for w in self.workers]
        return SimResult(self.records, stats, t_start, end, self.kv_bytes, self.rejected,
                         getattr(self.policy, "name", type(self.policy).__name__))
