"""The cost-aware placement policy: price every feasible placement with the cost model, pick the best.

Every aggregated placement (one `both` worker) and the best prefill x decode pairs are priced for TTFT
(backlog + prefill on P, and the wait for a slot behind P's full batch), TPOT (decode step on D slowed by its
prefill share; the slot wait spread over it where D decodes another's prefill) and e2e (TTFT + KV transfer +
(output - 1) x TPOT); pricing.py holds the arithmetic. "throughput" takes the lowest e2e plus the delay the
placement puts on others, "latency" the lowest TTFT, both preferring placements inside the SLOs. The backlog,
the prefill share and the decode guard are the policy's own bookkeeping of what it placed, in arrays indexed
by a slot per worker. Formulas and reasons: docs/costmodel.md (cost-aware policy).
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Mapping, Sequence

import msgspec
import numpy as np

from hetmesh.costmodel import (
    CostModel,
    Efficiency,
    link_bandwidth,
    load_efficiencies,
    server_model,
)
from hetmesh.costmodel.learn import Learner, StepSample, WorkerKey
from hetmesh.costmodel.model import COEFFICIENTS, step_seconds_many, transfer_time
from hetmesh.placement import pricing
from hetmesh.placement.admission import DEFAULT_HOLD_S, DEFAULT_MARGIN, admit, over_slo, quiet_s, refusal
from hetmesh.placement.fleet import Fleet
from hetmesh.placement.guard import DecodeGuard
from hetmesh.placement.pricing import Priced, first_k
from hetmesh.placement.state import Decision, RequestInfo, WorkerView
from hetmesh.protocol import Booking

SHARE_RUNGS = 4  # the prefill share's time constants: window, window/3, window/9, window/27
MAX_CANDIDATES = 16  # options a Decision lists (best first) for the placement span


class CostPolicy:
    name = "cost"

    def __init__(
        self,
        models: Mapping[str, str] | None = None,
        objective: str = "throughput",
        ttft_slo_s: float = 2.0,
        tpot_slo_s: float = 0.1,
        efficiencies: Mapping[str, Efficiency] | str | os.PathLike[str] | None = None,
        dtypes: Mapping[str, str] | None = None,
        share_window_s: float = 30.0,
        top_k: int = 4,
        slos: Mapping[str, tuple[float, float]] | None = None,
        admission_margin: float = DEFAULT_MARGIN,
        admission_margins: Mapping[str, float] | None = None,
        admission_hold_s: float = DEFAULT_HOLD_S,
        learn: bool = True,
    ) -> None:
        if objective not in ("throughput", "latency"):
            raise ValueError("objective must be 'throughput' or 'latency'")
        self.models = dict(models or {})
        self.dtypes = dict(dtypes or {})
        self.objective = objective
        self.ttft_slo = ttft_slo_s
        self.tpot_slo = tpot_slo_s
        self.slos = dict(slos or {})  # model -> its own (TTFT, TPOT) SLO seconds; others use the two above
        # SLO-aware admission (hetmesh.placement.admission): refuse when the best placement is over margin x
        # an SLO; 0 = off (default: the scheduler's). Per model in admission_margins, else admission_margin.
        self.admission_margin = admission_margin
        self.admission_margins = dict(admission_margins or {})
        self.admission_hold_s = admission_hold_s  # a refusal may be held and placed again after this long
        if isinstance(efficiencies, str | os.PathLike):
            efficiencies = load_efficiencies(efficiencies)
        self.effs: Mapping[str, Efficiency] = dict(efficiencies or {})
        self.window = share_window_s
        self.top_k = top_k
        # Each worker's speed learned from its engine's step times (None: price every worker at its prior)
        self.learner = Learner() if learn else None
        self._own: dict[str, tuple[tuple[str, str, int, str], int]] = {}  # worker id -> (its shape, its own row)
        self._cms: dict[tuple[str, str, int, str], int] = {}  # server shape -> row of _coef / _cm_list
        self._cm_list: list[CostModel] = []
        self._coef = np.zeros((0, len(COEFFICIENTS)))
        self._links: dict[tuple[str, int, str, int], float] = {}  # (P chip, devices, D chip, devices) -> KV link
        self._t0 = -1.0  # time of the first placement (the share estimator's warm-up)
        # What this policy placed on each worker (a slot per worker id): prefill seconds queued until
        # busy_until, the predicted start of each queued prefill, and a decaying prefill share (acc at last).
        self._slots: dict[str, int] = {}
        self._busy_until = np.zeros(16)
        # The prefill share at a ladder of time constants (window, window/3, ...): a decode reads the rung that
        # matches its own life, since bursts of prefill last seconds and a short decode sees the burst it lands in.
        self._taus = self.window / 3.0 ** np.arange(SHARE_RUNGS)
        self._acc = np.zeros((len(self._taus), 16))
        self._last = np.zeros(16)
        self._placed = np.zeros(16)  # prefills placed on each worker, decaying at the window (its arrival rate)
        self._gap = np.zeros(16)  # each worker's learned time to first token outside its engine's steps
        self._first_start = np.full(16, math.inf)  # starts[slot][0], so only due queues are walked
        self._queued = np.zeros(16)  # len(starts[slot])
        self._life = np.zeros(16)  # per worker: the mean seconds a decode placed there holds its slot
        self._starts: list[deque[float]] = []
        self._fleet = Fleet(self._cm_row, self._slot, lambda: self._coef)
        self._steps = pricing.StepPricer()
        self._guard = DecodeGuard()

    # ---- helpers ----
    def _cm_row(self, w: WorkerView) -> int:
        key = (w.accelerator, w.model, w.devices, w.parallel)
        own = self._own.get(w.worker_id)
        if own is not None and own[0] == key:
            return own[1]
        return self._shape_row(key, w)

    def _shape_row(self, key: tuple[str, str, int, str], w: WorkerView) -> int:
        row = self._cms.get(key)
        if row is None:
            cm = server_model(w.accelerator, self.models.get(w.model, w.model), devices=w.devices,
                              parallel=w.parallel, dtype=self.dtypes.get(w.model), efficiencies=self.effs)
            row = self._cms[key] = len(self._cm_list)
            self._cm_list.append(cm)
            self._coef = np.vstack([self._coef, np.array(cm.coefficients())])
        return row

    def _cm(self, w: WorkerView) -> CostModel:
        return self._cm_list[self._cm_row(w)]

    # ---- learning ----
    def observe(self, w: WorkerView, steps: Sequence[StepSample], now: float, instance: str = "",
                fit: bool = True) -> Efficiency | None:
        """A worker's engine steps (engine time `now`): its learned factors, when they moved enough to reprice
        it (the worker's own cost-model row from then on); None otherwise, with learning off, or while its steps
        wait for a later fit (`fit` False: Learner.observe)."""
        if self.learner is None:
            return None
        key = (w.accelerator, w.model, w.devices, w.parallel)
        prior = self._cm_list[self._shape_row(key, w)]
        eff = self.learner.observe(w.worker_id, WorkerKey(*key), prior, steps, now, instance, fit)
        if eff is None:
            return None
        cm = CostModel(prior.accel, prior.model, devices=prior.devices, parallel=prior.parallel, dtype=prior.dtype,
                       efficiency=eff)
        own = self._own.get(w.worker_id)
        if own is not None and own[0] == key:
            row = own[1]
            self._cm_list[row] = cm
            self._coef[row] = cm.coefficients()
        else:
            row = len(self._cm_list)
            self._cm_list.append(cm)
            self._coef = np.vstack([self._coef, np.array(cm.coefficients())])
            self._own[w.worker_id] = (key, row)
        self._fleet.recost(w.worker_id)
        return eff

    def observe_gaps(self, w: WorkerView, gaps: Sequence[float]) -> None:
        """A worker's first-token gaps (engine seconds outside its steps, per request): its TTFT is priced with
        their learned typical value on top of its steps from then on."""
        if self.learner is not None and gaps:
            self._gap[self._slot(w.worker_id)] = self.learner.observe_gaps(w.worker_id, gaps)

    def forget(self, worker_id: str) -> None:
        """A worker gone for good: its learned speed goes (its pool's stays, the prior of its successor)."""
        if self.learner is not None:
            self.learner.forget(worker_id)
        if worker_id in self._slots:
            self._gap[self._slots[worker_id]] = 0.0
        if self._own.pop(worker_id, None) is not None:
            self._fleet.recost(worker_id)

    def _slot(self, wid: str) -> int:
        s = self._slots.get(wid)
        if s is None:
            s = self._slots[wid] = len(self._starts)
            self._starts.append(deque())
            if s >= len(self._last):
                grow = len(self._last)
                self._busy_until, self._last = (np.concatenate([a, np.zeros(grow)]) for a in (self._busy_until, self._last))
                self._acc = np.concatenate([self._acc, np.zeros((len(self._taus), grow))], axis=1)
                self._first_start = np.concatenate([self._first_start, np.full(grow, math.inf)])
                self._queued = np.concatenate([self._queued, np.zeros(grow)])
                self._life = np.concatenate([self._life, np.zeros(grow)])
                self._placed = np.concatenate([self._placed, np.zeros(grow)])
                self._gap = np.concatenate([self._gap, np.zeros(grow)])
                self._guard.ensure(len(self._last))
        return s

    def _link(self, p_row: int, d_row: int) -> float:
        """KV link bandwidth between two servers: it depends on their chips and device counts only (not on a
        worker's own learned row)."""
        p, d = self._cm_list[p_row], self._cm_list[d_row]
        key = (p.accel.id, p.devices, d.accel.id, d.devices)
        bw = self._links.get(key)
        if bw is None:
            bw = self._links[key] = link_bandwidth(p.accel, p.devices, d.accel, d.devices)
        return bw

    # ---- the decision ----
    def _price(self, req: RequestInfo, workers: Sequence[WorkerView]) -> Priced | None:
        """Every worker priced for `req`: TTFT on it as P, TPOT on it as D, and the delay each puts on others."""
        f = self._fleet
        f.sync(workers)
        pre, dec, agg = f.pools(req.model, req.exclude)
        if not len(pre) or not len(dec):
            return None
        now = req.arrival
        if self._t0 < 0:
            self._t0 = now
        sl = f.slot_index  # the workers' bookkeeping slots (a view when it can be)
        ld = self._steps.load(f)
        p = pricing.prompt(req, f, ld)
        steps = self._steps(f, ld, p)
        prefill, packed = pricing.prefill_time(f, ld, p, steps)
        backlog = np.maximum(self._busy_until[sl] - now, 0.0)
        booked = pricing.booking(prefill, packed, backlog, steps, f.dp)
        # what the prefill takes from the decodes beside it (the prefill share's unit): its steps less the
        # plain decode steps they replace
        stolen = np.maximum(prefill - p.steps * steps.decode_alone, 0.0)
        d = pricing.decode_step(ld, steps)
        slow = 1.0 - self._decode_share(now, sl, req)
        # keeping SLOs, a sequence behind a full batch waits for a slot once: before its first token where it
        # prefills (and so where it runs whole), spread over its tokens where it decodes another's prefill
        wait = pricing.slot_wait(ld, self._life[sl]) if self._margin(req.model) > 0 else None
        tpot = pricing.tpot(d, slow)
        joined = pricing.joined(tpot, wait, req.max_tokens)
        ttft = backlog + prefill + self._gap[sl]
        if wait is not None:
            ttft = ttft + wait
        return Priced(now=now, pre=pre, dec=dec, agg=agg, cached=p.cached, ctx=p.ctx, prefill=prefill,
                      booked=booked, stolen=stolen, ttft=ttft, plain=d.plain,
                      full_chunk=d.full_chunk,
                      tpot=tpot, joined=joined, prefill_delay=stolen * pricing.stalled(ld, self._queued_prefills(now)),
                      decode_delay=pricing.decode_delay(ld, d, slow, req.max_tokens), fits=pricing.kv_fits(ld, req))

    def _decode_share(self, now: float, sl: np.ndarray | slice, req: RequestInfo) -> np.ndarray:
        """The prefill share a decode of `req` is priced at: over its life at its TPOT SLO (the ladder's rung
        covering it), never below the window's."""
        share = self._share(now, sl, 0)
        _, tpot_slo = self._slo(req.model)
        rung = self._rung(max(req.max_tokens - 1, 1) * tpot_slo)
        if rung > 0:
            share = np.maximum(share, self._share(now, sl, rung))
        return share

    def _queued_prefills(self, now: float) -> np.ndarray:
        """The prefills this policy queued on each worker that have not started by `now`."""
        f = self._fleet
        sl = f.slot_index
        for s in f.slots[self._first_start[sl] <= now].tolist():  # queues whose head started by now
            starts = self._starts[s]
            while starts and starts[0] <= now:
                starts.popleft()
            self._first_start[s] = starts[0] if starts else math.inf
            self._queued[s] = len(starts)
        return self._queued[sl]

    def _idle(self, pr: Priced, prefill: np.ndarray, n_out: int, ttft_slo: float, tpot_slo: float) -> float:
        """admission's idle reference: the best prefill alone (with its worker's first-token gap), and a decode
        step alone in its batch, over SLO."""
        idle = float((pr.prefill[prefill] + self._gap[self._fleet.slots[prefill]]).min()) / ttft_slo
        if n_out > 1:
            c = self._fleet.coef[:, pr.dec]
            one, z = np.ones(len(pr.dec)), np.zeros(len(pr.dec))
            idle = max(idle, float(step_seconds_many(c, z, z, z, z, one, one * pr.ctx).min()) / tpot_slo)
        return idle

    def place(self, req: RequestInfo, workers: Sequence[WorkerView]) -> Decision | None:
        pr = self._price(req, workers)
        if pr is None:
            return None
        f = self._fleet
        n_out = max(req.max_tokens, 1)
        ttft_slo, tpot_slo = self._slo(req.model)
        margin = self._margin(req.model)
        pre, dec, agg_i, ttft = pr.pre, pr.dec, pr.agg, pr.ttft
        # With admission on, the output tokens of the decodes placed on each worker that a prefill there would
        # push past their TPOT SLO (DecodeGuard); with it off the policy keeps no SLO but its own preference
        # and places by cost (None: no decode is guarded, nothing harmed).
        harm_w = (self._guard.harmed(f.slots, np.maximum(self._busy_until[f.slot_index], pr.now), pr.stolen)
                  if margin > 0 and self._guard.last_end > pr.now else None)
        # Options: every `both` worker alone, then the top_k prefill x top_k decode pairs.
        ip = id_ = agg_i
        xfer = np.zeros(len(agg_i))
        if n_out > 1 or not len(agg_i):
            rows = f.row_list
            kv_bytes = req.prompt_len * self._cm_list[rows[pre[0]]].kv_bytes_per_token()
            # the fastest prefills among those within the TTFT SLO, then harming no guarded decode (as below)
            t_pre = ttft[pre]
            late = t_pre > ttft_slo
            best_p = pre[first_k(t_pre, (late,) if harm_w is None else (harm_w[pre] > 0, late), self.top_k)].tolist()
            best_d = dec[first_k(pr.joined[dec], (), self.top_k)].tolist()
            pairs = [(p, d) for p in best_p for d in best_d if p != d]
            if pairs:
                link, moves = self._link, {}  # the KV transfer between two servers' rows
                for p, d in pairs:
                    if (key := (rows[p], rows[d])) not in moves:
                        moves[key] = transfer_time(kv_bytes, link(*key))
                pp, dd = zip(*pairs, strict=True)
                ip, id_ = np.concatenate([agg_i, pp]), np.concatenate([agg_i, dd])
                xfer = np.concatenate([xfer, [moves[rows[p], rows[d]] for p, d in pairs]])
        if not len(ip):
            return None
        o_ttft = ttft[ip]
        o_tpot = np.concatenate([pr.tpot[agg_i], pr.joined[id_[len(agg_i):]]])
        o_e2e = o_ttft + xfer + (n_out - 1) * o_tpot
        miss = ~pr.fits[id_]
        harm = None if harm_w is None else harm_w[ip]
        spared = () if harm is None else (harm > 0,)  # sparing the guarded decodes (nothing to spare: no key)
        over = np.maximum((o_ttft + req.waited_s if req.waited_s else o_ttft) / ttft_slo,
                          o_tpot / tpot_slo if n_out > 1 else 0.0)
        if req.slo_share != 1.0:
            over /= req.slo_share
        if margin > 0:  # before anything is committed: a refused request leaves no bookkeeping behind
            # the best placement that does not cost guarded decodes as many tokens as it may bring, else the
            # best that fits, else the best
            out = next((m for m in ((miss,) if harm is None else (miss | (harm >= n_out), miss)) if not m.all()),
                       np.zeros_like(miss))
            j = int(np.argmin(np.where(out, np.inf, over)))
            if over[j] > margin and (no := self._refusal(req, pr, ip, int(ip[j]), float(over[j]), float(o_ttft[j]),
                                                         float(o_tpot[j]) if n_out > 1 else 0.0, margin)):
                return no
        if self.objective == "latency":
            order = np.lexsort((o_e2e, o_ttft, *spared, np.maximum(over, 1.0), miss))
        else:  # the cluster-seconds this request costs: its own time plus the delay it puts on others
            # within its SLOs first, then sparing the guarded decodes, then the cheapest
            order = first_k(o_e2e + pr.prefill_delay[ip] + pr.decode_delay[id_], (*spared, over > 1.0, miss),
                            MAX_CANDIDATES)
        k = int(order[0])
        p, d = int(ip[k]), int(id_[k])
        booking = Booking(prefill_s=float(pr.booked[p]), stolen_s=float(pr.stolen[p]),
                          first_token_s=float(o_ttft[k] + xfer[k]), decode_step_s=float(pr.plain[d]),
                          tpot_s=float(pr.tpot[d]),
                          full_chunk_s=float(pr.full_chunk[d]), decode_batch=int(f.num[d, 2]), max_tokens=n_out,
                          tpot_slo_s=tpot_slo, placed_at=pr.now)
        self._book(booking, int(f.slots[p]), int(f.slots[d]), pr.now)
        agg = p == d
        ids = f.ids
        shown = order[:MAX_CANDIDATES]  # the best options, for the placement span
        return Decision(
            mode="aggregated" if agg else "disaggregated",
            decode_worker=ids[d],
            prefill_worker=None if agg else ids[p],
            expected_cached_tokens=int(pr.cached[p]),
            reason=f"cost/{self.objective}: e2e {o_e2e[k]:.3f}s",
            predicted_ttft_s=float(o_ttft[k]),
            predicted_tpot_s=float(o_tpot[k]) if n_out > 1 else 0.0,
            booking=booking,
            candidates=tuple(zip([ids[i] for i in ip[shown].tolist()], [ids[i] for i in id_[shown].tolist()],
                                 o_ttft[shown].tolist(), o_tpot[shown].tolist(), o_e2e[shown].tolist(), strict=True)),
        )

    def assess(self, req: RequestInfo, workers: Sequence[WorkerView], decision: Decision,
               margin: float | None = None) -> Decision:
        """SLO-aware admission for another policy's choice (hetmesh.placement.gate): `decision` with this
        policy's predictions, or a refusal when admission's rule refuses that very placement. An admitted
        placement is booked like one of ours (its prefill backlog), so the next predictions see it."""
        pr = self._price(req, workers)
        idx = self._fleet.index
        p, d = idx.get(decision.prefill_worker or decision.decode_worker), idx.get(decision.decode_worker)
        if pr is None or p is None or d is None:
            return decision  # nothing to judge it by
        n_out = max(req.max_tokens, 1)
        ttft = float(pr.ttft[p])
        tpot = float((pr.tpot if p == d else pr.joined)[d]) if n_out > 1 else 0.0
        ttft_slo, tpot_slo = self._slo(req.model)
        over = over_slo(ttft + req.waited_s, tpot, n_out, ttft_slo, tpot_slo) / req.slo_share
        if margin is None:
            margin = self._margin(req.model)
        if margin > 0 and over > margin and (no := self._refusal(req, pr, pr.pre, p, over, ttft, tpot, margin)):
            return no
        self._commit(int(self._fleet.slots[p]), float(pr.booked[p]), pr.now)
        return msgspec.structs.replace(decision, predicted_ttft_s=ttft, predicted_tpot_s=tpot,
                                       booking=Booking(prefill_s=float(pr.booked[p]), placed_at=pr.now))

    def booked(self, decision: Decision) -> None:
        """Another scheduler replica's placement, heard on the bus: booked here as that replica booked it, at the
        time it placed it (its prefill backlog, prefill share, guarded decode), so each replica prices what every
        replica placed."""
        b = decision.booking
        if b is None:
            return
        if self._t0 < 0:
            self._t0 = b.placed_at
        p = decision.prefill_worker or decision.decode_worker
        self._book(b, self._slot(p), self._slot(decision.decode_worker), b.placed_at)

    def withdrawn(self, decision: Decision, now: float) -> None:
        """A placement taken back before its prefill started (a replica's, when another replica's booking heard
        late took its room): its prefill leaves the worker's backlog, queue and share. What it charged the
        guarded decodes stays (they are priced no worse for it)."""
        b = decision.booking
        slot = self._slots.get(decision.prefill_worker or decision.decode_worker or "")
        if b is None or slot is None:
            return
        self._busy_until[slot] = max(float(self._busy_until[slot]) - b.prefill_s, now)
        starts = self._starts[slot]
        if starts and starts[-1] > now:  # one prefill fewer waiting: the queue's tail leaves
            starts.pop()
        self._first_start[slot] = starts[0] if starts else math.inf
        self._queued[slot] = len(starts)
        decay = np.exp(-max(float(self._last[slot]) - b.placed_at, 0.0) / self._taus)  # as it stands at _last
        self._acc[:, slot] = np.maximum(self._acc[:, slot] - b.prefill_s * decay, 0.0)
        self._placed[slot] = max(float(self._placed[slot]) - float(decay[0]), 0.0)

    def _refusal(self, req: RequestInfo, pr: Priced, prefills: np.ndarray, p: int, over: float, ttft: float,
                 tpot: float, margin: float) -> Decision | None:
        """Admission's rule for a placement over `margin` (prefill worker p; its predictions): None if the idle
        exception admits it, else the refusal. The idle reference (over `prefills`) and the arrivals at p are
        worked out only here, when it could refuse."""
        n_out = max(req.max_tokens, 1)
        ttft_slo, tpot_slo = self._slo(req.model)
        idle = self._idle(pr, prefills, n_out, ttft_slo, tpot_slo)
        busy = self._arrivals(pr.now, int(self._fleet.slots[p]), float(pr.prefill[p]))
        if admit(over, margin, idle, busy):
            return None
        return refusal(ttft, tpot, over, margin, ttft_slo, idle, req.waited_s, self.admission_hold_s,
                       quiet_s(over, margin, idle, busy, self.window))

    def _book(self, b: Booking, slot_p: int, slot_d: int, now: float) -> None:
        """Commit the prefill on P (the decodes there absorb what it takes from them) and guard the decode on D
        from its first token on (DecodeGuard)."""
        self._guard.charge(slot_p, max(float(self._busy_until[slot_p]), now), b.stolen_s)
        self._commit(slot_p, b.prefill_s, now)
        n_out = b.max_tokens
        if n_out > 1:
            start = now + b.first_token_s
            life = (n_out - 1) * b.decode_step_s
            # how long it holds its slot (its steps slowed by the prefills beside it), in the mean over the last
            # max_batch or so decodes placed there: what a sequence behind a full batch waits for
            held = (n_out - 1) * (b.tpot_s or b.decode_step_s)
            old, mb = float(self._life[slot_d]), max(float(b.decode_batch), 1.0)
            self._life[slot_d] = held if old == 0.0 else old + (held - old) / mb
            queued = max(float(self._busy_until[slot_d]) - start, 0.0)  # prefill still queued on D by then
            slack = (n_out - 1) * b.tpot_slo_s - life - queued
            if slack < b.full_chunk_s:  # fragile: one prefill chunk beside it would break its SLO
                self._guard.add(slot_d, start, start + life + queued, n_out, slack, now)

    def _slo(self, model: str) -> tuple[float, float]:
        """The model's (TTFT, TPOT) SLO seconds: its own, else the policy's."""
        return self.slos.get(model, (self.ttft_slo, self.tpot_slo))

    def _margin(self, model: str) -> float:
        """The model's admission margin: its own, else the policy's (0: admission off)."""
        return self.admission_margins.get(model, self.admission_margin)

    def _rung(self, life_s: float) -> int:
        """The ladder's shortest time constant at least `life_s` (0, the window, for a life beyond it)."""
        return max(int(np.searchsorted(-self._taus, -life_s, side="right")) - 1, 0)

    def _share(self, now: float, sl: np.ndarray | slice, rung: int) -> np.ndarray:
        """Each worker's prefill share (seconds of prefill placed per second) at time constant taus[rung]: an
        exponentially decaying sum over the span it has seen (shorter than tau in the first seconds)."""
        tau = float(self._taus[rung])
        decay = np.exp(np.minimum(self._last[sl] - now, 0.0) / tau)  # -max(now - last, 0) / tau
        return np.minimum(self._acc[rung, sl] * decay / self._span(now, tau), 0.95)

    def _arrivals(self, now: float, slot: int, seconds: float) -> float:
        """The prefills expected on a worker within `seconds`: the rate placed there, over the window (as the
        share's)."""
        decay = math.exp(-max(now - float(self._last[slot]), 0.0) / self.window)
        return float(self._placed[slot]) * decay / self._span(now, self.window) * seconds

    def _span(self, now: float, tau: float) -> float:
        """The seconds a sum decaying at `tau` has seen since the first placement (at least a second, or tau)."""
        return max(tau * (1.0 - math.exp(-max(now - self._t0, 1e-3) / tau)), min(1.0, tau))

    def _commit(self, slot: int, booked: float, now: float) -> None:
        """Queue `booked` prefill seconds (`Priced.booked`) on the worker behind what it holds."""
        start = max(float(self._busy_until[slot]), now)
        if not self._starts[slot]:
            self._first_start[slot] = start
        self._starts[slot].append(start)
        self._queued[slot] += 1
        self._busy_until[slot] = start + booked
        decay = np.exp(-max(now - float(self._last[slot]), 0.0) / self._taus)  # decay[0]: at the window
        self._acc[:, slot] = self._acc[:, slot] * decay + booked
        self._placed[slot] = self._placed[slot] * decay[0] + 1
        self._last[slot] = now
