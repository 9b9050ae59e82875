"""Discrete-event cluster simulator: the scheduler's own policies over N batching cores, in virtual time.

Each simulated worker is the batching core the live `sim` engine runs (hetmesh.batching):
the same admission, block-level KV memory with preemption, chunked prefill under one step
budget, and prefix cache; each step lasts `CostModel.step_seconds(step)`. Requests reach
workers through the very `Policy.place(RequestInfo, [WorkerView])` call the live scheduler
makes, with views built from the cores the way heartbeats are built from engines (no
staleness). A disaggregated request prefills on one worker, emits its first token there,
ships its KV over the servers' NICs (`link_bandwidth`, queued per NIC) and decodes on
another. The prefix index is the cores' own KV events, walked like the Redis index does.
"""

from __future__ import annotations

import gc
import heapq
from bisect import bisect_left
from collections.abc import Callable, Sequence

from msgspec.structs import replace

from hetmesh.batching import Core, Kind, Seq, Settings, Step, following
from hetmesh.costmodel import CostModel, link_bandwidth, server_model
from hetmesh.costmodel.learn import StepLog, StepSample
from hetmesh.costmodel.truth import Truth
from hetmesh.kvindex.blocks import leading_blocks
from hetmesh.placement import REFUSED, Policy, RequestInfo, WorkerView
from hetmesh.placement.admission import hold_wait_s, retry_wait_s
from hetmesh.sim.flow import SimFlow
from hetmesh.sim.results import RequestRecord, SimResult, WorkerStats
from hetmesh.sim.spec import SimConfig, WorkerSpec
from hetmesh.sim.traces import ClosedLoop, Trace, TraceRequest
from hetmesh.wiring import DEFAULT_TENANT, kv_blocks_for

_ARRIVAL, _KICK, _STEP_END, _KV_LANDED, _RETRY, _HOLD, _FLOW, _CALL = 0, 1, 2, 3, 4, 5, 6, 7
_FULL, _PREFILL, _DECODE = Kind  # module names: cheaper than member lookups
MAX_SPAN = 256  # plain decode steps one event may stand for


class _Req:
    __slots__ = ("arrival", "cached", "cost", "decision", "dw", "finish", "first", "hashes", "held", "mode", "model",
                 "n_in", "n_out", "pw", "rid", "sent", "tenant", "tries")

    def __init__(self, rid: int, tr: TraceRequest, arrival: float) -> None:
        self.rid = rid
        self.arrival = arrival
        self.n_in = tr.input_len
        self.n_out = tr.output_len
        self.hashes = tr.hash_ids
        self.model = tr.model
        self.cached = 0
        self.first = -1.0
        self.finish = -1.0
        self.mode = ""
        self.pw: _Worker | None = None
        self.dw: _Worker | None = None
        self.decision = None
        self.tries = 0  # refusals retried so far
        self.sent = arrival  # when its client sent it last (a retry sends it again)
        self.tenant = tr.tenant or DEFAULT_TENANT
        self.cost = 0.0  # flow control: what it costs its tenant's share
        self.held = False  # flow control has held it


class _Worker:
    __slots__ = ("busy", "busy_time", "cm", "core", "decode_tokens", "inbound", "index", "kicked", "log", "nic_free",
                 "prefill_tokens", "reported", "span", "spec", "step", "step_start", "steps", "truth", "ver")

    def __init__(self, spec: WorkerSpec, cm: CostModel, settings: Settings) -> None:
        self.spec = spec
        self.truth = spec.truth or Truth()
        # the step times it really has: its true factors where the spec says (the policy prices the prior)
        self.cm = cm if spec.truth is None or spec.truth.efficiency is None else CostModel(
            cm.accel, cm.model, devices=cm.devices, parallel=cm.parallel, dtype=cm.dtype,
            efficiency=spec.truth.efficiency)
        self.log = StepLog()
        self.reported = 0.0
        self.core = Core(settings, track_decodes=False)
        self.busy = False
        self.kicked = False
        self.step: Step | None = None
        self.step_start = 0.0
        self.busy_time = 0.0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.inbound = 0  # disaggregated requests whose KV is on its way here
        self.nic_free = 0.0
        self.index = 0  # in Simulator.workers
        self.span: list[float] | None = None  # a run of plain decode steps: each one's end time
        self.ver = 0  # of the pending STEP_END event
        self.steps: list[tuple[object, ...]] | None = None


class Simulator:
    def __init__(self, workers: Sequence[WorkerSpec], policy: Policy, config: SimConfig | None = None) -> None:
        self.cfg = config or SimConfig()
        self.policy = policy
        self._specs = list(workers)
        self.workers: list[_Worker] = []
        self.by_id: dict[str, _Worker] = {}
        self._links: dict[tuple[str, str], float] = {}
        self._holders: dict[int, set[str]] = {}
        self._dirty: set[_Worker] = set()  # cores with KV events not yet in the index
        self._stale: set[_Worker] = set()  # workers whose view is out of date
        self._view_list: list[WorkerView] = []
        self._events: list[tuple[float, bool, int, int, object]] = []
        self._seq = 0
        self.now = 0.0
        self.records: list[RequestRecord] = []
        self.reqs: dict[int, _Req] = {}
        self.kv_bytes = 0
        self.rejected_models: dict[str, int] = {}  # requests not served, per model; of them
        self.refused = 0  # refused by the policy's admission (hetmesh.placement.admission), retries exhausted
        self.retried = 0  # refusals a client retried after Retry-After (SimConfig.client_retries)
        self.policy_calls = 0  # placements asked of the policy: first tries, retries, holds and pumps alike
        self.held = 0  # refusals held and placed again (Decision.hold_s)
        self.rejected_tenants: dict[str, int] = {}  # requests not served, per tenant
        self.flow: SimFlow | None = None  # flow control (SimConfig.tenants)
        # Each worker's engine steps go to a policy that learns from them, every report_s (its heartbeat)
        self._observe = getattr(policy, "observe", None) if getattr(policy, "learner", None) is not None else None
        # A policy that learns from observed latencies hears of each first token (TTFT) and finished request
        self._first = getattr(policy, "request_first_token", None)
        self._done = getattr(policy, "request_done", None)

    def _build(self, hash_tokens: int) -> None:
        cms: dict[tuple, CostModel] = {}
        for s in self._specs:
            key = (s.accelerator, s.spec, s.devices, s.parallel, s.dtype)
            if key not in cms:
                cms[key] = server_model(s.accelerator, s.spec, devices=s.devices, parallel=s.parallel, dtype=s.dtype,
                                        efficiencies=self.cfg.efficiencies)
            cm = cms[key]
            if hash_tokens % s.block_size:
                raise ValueError(f"worker {s.worker_id}: the trace's hash blocks ({hash_tokens} tokens) must be a "
                                 f"multiple of its block_size ({s.block_size})")
            settings = Settings(max_batch=s.max_batch, kv_blocks=kv_blocks_for(s.kv_tokens // s.block_size,
                                                                                s.block_size, cm),
                                block_size=s.block_size, step_tokens=s.step_tokens, prefill_order=s.prefill_order,
                                hash_blocks=hash_tokens // s.block_size, prefix_caching=self.cfg.prefix_caching)
            w = _Worker(s, cm, settings)
            w.index = len(self.workers)
            if self.cfg.record_steps:
                w.steps = []
            self.workers.append(w)
            self.by_id[s.worker_id] = w
        self._view_list = [WorkerView(worker_id=s.worker_id, model=s.model, accelerator=s.accelerator,
                                      vendor=s.accelerator.split("-", 1)[0], devices=s.devices, role=s.role,
                                      queue_depth=0, running=0, max_batch=s.max_batch,
                                      kv_blocks_total=w.core.s.kv_blocks, kv_blocks_used=0, block_size=s.block_size,
                                      parallel=s.parallel, step_tokens=s.step_tokens)
                           for w in self.workers for s in (w.spec,)]
        self._stale = set(self.workers)  # refreshed at first use
        if self.cfg.tenants:
            self.flow = SimFlow(self, self.policy)

    # ---- event plumbing ----
    def _push(self, t: float, kind: int, obj: object) -> None:
        # Arrivals of an instant go before everything else of it, so a kicked worker sees them all.
        self._seq += 1
        heapq.heappush(self._events, (t, kind != _ARRIVAL, self._seq, kind, obj))

    # ---- the policy's view of the cluster: what a heartbeat would say ----
    def _views(self) -> list[WorkerView]:
        """One list, kept: only workers whose state moved since the last placement get a new view (the policy
        tells changed workers by the view object)."""
        views = self._view_list
        for w in self._stale:  # only the load moves
            c, i = w.core, w.index
            views[i] = replace(views[i], queue_depth=c.n_waiting + w.inbound, running=len(c.running),
                               kv_blocks_used=c.cache.used)
        self._stale.clear()
        return views

    def _cached_blocks(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks each worker holds (the prefix index lookup), after the cores' pending KV events."""
        if not hashes or not self.cfg.prefix_caching:
            return {}
        holders = self._holders
        for w in self._dirty:
            wid = w.spec.worker_id
            for h, stored in w.core.cache.take().items():
                hs = holders.get(h)
                if stored:
                    if hs is None:
                        holders[h] = {wid}
                    else:
                        hs.add(wid)
                elif hs is not None:
                    hs.discard(wid)
                    if not hs:
                        del holders[h]
        self._dirty.clear()
        return leading_blocks(hashes, holders.get)

    # ---- request lifecycle ----
    def _arrive(self, req: _Req, block_tokens: int, held: bool = False) -> None:
        self.reqs[req.rid] = req
        if not held:
            req.sent = self.now
        fl = self.flow
        if fl is not None and not held and fl.arrive(req, req.model or self._model):
            return  # waits in the flow queue behind requests that go first
        # Its wait so far counts from its first send: the gateway tells admission how long a client retrying a
        # refusal has waited (hetmesh.gateway.retries), so a retry too late for its SLO is not served late.
        info = RequestInfo(request_id=str(req.rid), model=req.model or self._model, prompt_len=req.n_in,
                           max_tokens=req.n_out, cached_blocks=self._cached_blocks(req.hashes), block_size=block_tokens,
                           arrival=self.now, waited_s=self.now - req.arrival)
        self.policy_calls += 1
        d = self.policy.place(info, self._views())
        if fl is not None and d is not None and d.mode == REFUSED:
            fl.refused(req, d, info.model)  # held in the flow queue, or refused with its tenant's Retry-After
            return
        if d is not None and d.mode == REFUSED and (
                hold := hold_wait_s(d, self.now - req.sent, self.cfg.hold_limit_s)) is not None:
            # Held by the scheduler and placed again (the client waits on its submit, its clock running).
            self.held += 1
            self._push(self.now + hold, _HOLD, req)
            return
        if d is not None and d.mode == REFUSED and req.tries < self.cfg.client_retries:
            # Retried as the openai client retries a 429: after Retry-After, the same request, its clock running.
            req.tries += 1
            self.retried += 1
            self._push(self.now + retry_wait_s(d, self.cfg.retry_floor_s), _RETRY, req)
            return
        if d is None or d.mode == REFUSED:  # no worker, or SLO-aware admission refused it
            self.refused += d is not None
            # A refused closed-loop client backs off for the wait it was refused for, as Retry-After tells it.
            self._reject(req, (d.predicted_ttft_s or 0.0) if d is not None else 0.0)
            return
        req.decision = d
        if fl is not None:
            fl.placed(req)
        dw = self.by_id[d.decode_worker]
        pw = self.by_id[d.prefill_worker] if d.prefill_worker else dw
        req.mode = "aggregated" if pw is dw else "disaggregated"
        req.pw, req.dw = pw, dw
        kind = _FULL if pw is dw else _PREFILL
        try:
            pw.core.add(Seq(req.rid, kind, req.n_in, req.hashes, req.n_out if kind == _FULL else 1))
            if pw is not dw:
                need = dw.core.blocks_needed(req.n_in, _DECODE, req.n_out)
                if need > dw.core.s.kv_blocks:
                    pw.core.abort(req.rid)
                    raise ValueError("too long for the decode worker")
        except ValueError:
            self._reject(req)
            return
        if pw is not dw:
            dw.inbound += 1
            self._stale.add(dw)
        self._wake(pw)

    def _reject(self, req: _Req, backoff: float = 0.0) -> None:
        model = req.model or self._model
        self.rejected_models[model] = self.rejected_models.get(model, 0) + 1
        self.rejected_tenants[req.tenant] = self.rejected_tenants.get(req.tenant, 0) + 1
        del self.reqs[req.rid]
        self._next(backoff)

    def _wake(self, w: _Worker) -> None:
        """New work for w: it starts a step once every event of this instant is in (as the live engine's loop
        runs after the submits that woke it). A run of plain decode steps under way ends with the step
        running now, so the next step admits the newcomer as step-by-step it would."""
        self._stale.add(w)
        if not w.busy and not w.kicked:
            w.kicked = True
            self._push(self.now, _KICK, w)
        elif w.span is not None and len(w.span) > 1:
            i = bisect_left(w.span, self.now)
            if i < len(w.span) - 1:
                w.span = w.span[: i + 1]
                w.ver += 1
                self._push(w.span[i], _STEP_END, (w, w.ver))

    def _start_step(self, w: _Worker) -> None:
        w.kicked = False
        self._stale.add(w)
        core = w.core
        step = core.schedule(self.now)
        while step.ended:
            for s in step.ended:  # DECODEs whose first token already ended them
                self._finished(self.reqs[s.rid])
            if step.prefills or step.n_decode:
                break
            step = core.schedule(self.now)
        if core.cache.dirty:
            self._dirty.add(w)
        if not step.prefills and not step.n_decode:
            w.busy = False
            return
        if w.steps is not None:
            w.steps.append(step.signature())
        fac = w.truth.factor(self.now)
        dt = w.cm.step_seconds(step) * fac
        end = self.now + dt
        if self._observe is not None:
            w.log.add(StepSample.of(step, dt))
        # Plain decode steps ahead (nothing queued, no ends, blocks to spare) run as one event; their end
        # times are kept, so a request that arrives meanwhile cuts the run at the step it lands in.
        k = core.quiet(step, MAX_SPAN)
        if k:
            span = [end]
            nxt, n, seconds = following(step, 1), step.n_decode, w.cm.step_seconds
            for _ in range(k):  # one scratch step, its context grown by the batch each time (`following`)
                end += seconds(nxt) * fac
                span.append(end)
                nxt.decode_context += n
            w.span = span
        else:
            w.span = None
        w.busy = True
        w.step = step
        w.step_start = self.now
        w.ver += 1
        self._push(end, _STEP_END, (w, w.ver))

    def _end_step(self, w: _Worker) -> None:
        now = self.now
        w.busy_time += now - w.step_start
        step = w.step
        assert step is not None
        span = w.span
        k = len(span) - 1 if span is not None else 0
        w.span = None
        out = w.core.skip(step, k)
        w.prefill_tokens += step.prefill_tokens
        w.decode_tokens += step.n_decode * (k + 1)
        if k and w.steps is not None:
            w.steps.extend(following(step, j).signature() for j in range(1, k + 1))
        if self._observe is not None:
            if k:  # the span's last step, as its heartbeat would report it
                w.log.add(StepSample.of(following(step, k), span[k] - span[k - 1]))
            if now - w.reported >= self.cfg.report_s:
                w.reported = now
                self._observe(self._view_list[w.index], w.log.drain(), now)
        reqs = self.reqs
        for s in out.sampled:
            r = reqs[s.rid]
            if r.first < 0:
                r.first = now
                r.cached = s.cached_tokens
                if self._first is not None:
                    self._first(str(r.rid), now - r.arrival, now)
        for s in out.finished:
            r = reqs[s.rid]
            if s.kind != _PREFILL:
                self._finished(r)
            elif r.n_out <= 1:  # nothing left to decode: no KV to ship
                dw = r.dw
                assert dw is not None
                dw.inbound -= 1
                self._stale.add(dw)
                self._finished(r)
            else:
                self._ship_kv(w, r)
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
        d = r.dw
        assert d is not None
        d.inbound -= 1
        d.core.add(Seq(r.rid, _DECODE, r.n_in, r.hashes, r.n_out, n_first=1))
        self._wake(d)

    def _finished(self, r: _Req) -> None:
        r.finish = self.now
        d = r.decision
        pw, dw = r.pw, r.dw
        self.records.append(RequestRecord(
            r.arrival, r.first, r.finish, r.n_in, r.n_out, r.cached, r.mode,
            pw.spec.worker_id if pw else "", dw.spec.worker_id if dw else "",
            getattr(d, "predicted_ttft_s", None), getattr(d, "predicted_tpot_s", None), r.model or self._model,
            r.tenant))
        if self._done is not None:
            rec = self.records[-1]
            self._done(str(r.rid), rec.prefill_worker, rec.decode_worker, rec.ttft,
                       rec.tpot if r.n_out > 1 else None, self.now)
        if dw is not None:
            self._stale.add(dw)
        del self.reqs[r.rid]
        if self.flow is not None:
            self.flow.finished(r)
        self._next()

    # ---- what flow control (SimFlow) calls ----
    def place_held(self, req: _Req) -> None:
        self._arrive(req, self._block_tokens, held=True)

    def pump_at(self, t: float) -> None:
        self._push(t, _FLOW, None)

    def call_at(self, t: float, fn: Callable[[], None]) -> None:  # an event of an extension (sim.replicas)
        self._push(t, _CALL, fn)

    def retry(self, req: _Req, after: float) -> None:
        self._push(self.now + after, _RETRY, req)

    def reject(self, req: _Req, backoff: float) -> None:
        self._reject(req, backoff)

    def _next(self, delay: float = 0.0) -> None:
        self._finished_n += 1
        if self._source is not None:
            nxt = self._source.next(self.now + delay)
            if nxt is not None:
                self._push(self.now + delay, _ARRIVAL, nxt)

    # ---- driver ----
    def run(self, trace: Trace | ClosedLoop, progress: Callable[[int, int], None] | None = None) -> SimResult:
        # A run allocates millions of short-lived objects that hold no reference cycles (events, steps,
        # sequences): the cyclic collector would only walk them, and every long-lived one, again and again.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run(trace, progress)
        finally:
            if collecting:
                gc.enable()

    def _run(self, trace: Trace | ClosedLoop, progress: Callable[[int, int], None] | None) -> SimResult:
        models = {s.model for s in self._specs}
        # A request without a model asks for the one model the workers serve.
        self._model = next(iter(models)) if len(models) == 1 else ""
        if not self._model and (isinstance(trace, ClosedLoop) or not all(r.model for r in trace.requests)):
            raise ValueError(f"workers serve {sorted(models)}: every trace request must name its model")
        block_tokens = self._block_tokens = trace.block_tokens
        self._build(block_tokens)
        self._finished_n = 0
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
            t, _, _, kind, obj = pop(events)
            if t > self.cfg.max_time_s:
                break
            self.now = t
            if kind == _STEP_END:
                w, ver = obj  # type: ignore[misc]
                if ver == w.ver:  # not a run of steps cut short since
                    self._end_step(w)
            elif kind == _ARRIVAL:
                tr: TraceRequest = obj  # type: ignore[assignment]
                if self._source is None:
                    nxt = next(opened, None)
                    if nxt is not None:
                        self._push(nxt.arrival, _ARRIVAL, nxt)
                self._arrive(_Req(rid, tr, t), block_tokens)
                rid += 1
                if progress is not None and rid % tick == 0:
                    progress(self._finished_n, total)
            elif kind == _KICK:
                w: _Worker = obj  # type: ignore[assignment]
                if not w.busy:
                    self._start_step(w)
            elif kind == _RETRY:
                self._arrive(obj, block_tokens)  # type: ignore[arg-type]
            elif kind == _HOLD:
                self._arrive(obj, block_tokens, held=True)  # type: ignore[arg-type]
            elif kind == _FLOW:
                self.flow.pump()  # type: ignore[union-attr]
            elif kind == _CALL:
                obj()  # type: ignore[operator]
            else:
                self._landed(obj)  # type: ignore[arg-type]
        if progress is not None:
            progress(self._finished_n, total)
        end = max((r.finish for r in self.records), default=self.now)
        stats = [WorkerStats(w.spec.worker_id, w.spec.pool, w.spec.accelerator, str(w.spec.role), w.busy_time,
                             w.prefill_tokens, w.decode_tokens, w.core.stats.preempted, w.spec.devices)
                 for w in self.workers]
        steps = {w.spec.worker_id: w.steps for w in self.workers if w.steps is not None}
        return SimResult(self.records, stats, t_start, end, self.kv_bytes, sum(self.rejected_models.values()),
                         getattr(self.policy, "name", type(self.policy).__name__), steps, self.refused,
                         self.rejected_models, self.retried, self.held, self.rejected_tenants,
                         {t: self.flow.q.stats(t) for t in self.flow.q.tenants} if self.flow else {},
                         self.policy_calls)
