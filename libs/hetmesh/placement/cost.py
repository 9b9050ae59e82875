"""The cost-aware placement policy: predict each feasible placement, pick the best.

For a request it prices every aggregated placement (one `both` worker does prefill and decode)
and every disaggregated one (prefill on P, KV over the NICs, decode on D; a `both` worker may
take either phase) with the cost model:

    TTFT  = prefill backlog on P + prefill time on P (after P's prefix hit, with P's decode batch riding along)
    TPOT  = decode step time on D at its batch (running + queued + this one) / (1 - D's prefill share)
            + with admission on, the wait for a slot when that batch is over full, spread over its output tokens
    e2e   = TTFT + KV transfer (disaggregated) + (output - 1) * TPOT

The prefill backlog and each worker's prefill share are the policy's own bookkeeping of what
it placed (prefill seconds it predicted, drained in real time, read off `RequestInfo.arrival`).
On a data-parallel worker (any role) a prompt that finds a backlog is booked at its share of the steps
it fills with the prompts ahead of it (the batching core packs chunks under one token budget), not at
steps of its own: a short prompt alone pays a whole step's weight reads (over 8 devices a 1K-token
prompt alone costs 8x its share), and booking that made the backlog, hence admission's TTFT, 2-3x too
long on a busy pool. A prefill worker's running sequences are prefills (in the backlog), not decodes
riding along.
The share a decode is priced at is forecast over its own life at its SLO ((output - 1) x TPOT SLO):
prefills arrive in bursts, and a 12-token decode lives through the burst it lands in, not through the
30 s mean, so it reads the share at the ladder's shortest time constant covering its life (window,
window/3, ...; never below the window's);
batch sizes, memory and roles come from the `WorkerView`s. Objectives: "throughput" takes the
lowest e2e time plus the delay the placement puts on others (what the prefill's steps on P take
from every sequence it holds up there beyond the decode steps they would have run anyway: P's
running batch and the decodes queued on it, not the prefills this policy queued ahead of it; and
D's slower steps), preferring placements inside the SLOs (in a closed loop, the highest throughput;
the one that frees the cluster soonest otherwise);
"latency" takes the lowest TTFT among the placements that meet both SLOs (or the least
violating one).

With admission on, the policy also keeps the SLOs of the decodes it admitted (hetmesh.placement.guard): a
decode so short that one full prefill chunk beside it would break its TPOT SLO is guarded for its life, a
placement whose prefill would push guarded decodes past their SLO ranks after those that keep every SLO,
and admission looks for a placement that costs them fewer output tokens than the request may bring. The
share prices the prefill a decode should expect; the guard keeps the policy from placing the one prefill
that breaks a decode too short to average over. Longer decodes are left to the share: guarding them too
makes the prefill-strong chip hold decodes (the seed case's closed loop: -15% throughput, measured).

Every worker is priced at once with numpy (`step_seconds_many`, the scalar cost model's
arithmetic over arrays), so a placement over hundreds of workers stays well under a millisecond;
the policy's bookkeeping lives in arrays indexed by a slot per worker for the same reason.
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
from hetmesh.placement.admission import DEFAULT_HOLD_S, DEFAULT_MARGIN, admit, over_slo, quiet_s, refusal
from hetmesh.placement.fleet import PREFILL, Fleet
from hetmesh.placement.guard import DecodeGuard
from hetmesh.placement.state import Decision, RequestInfo, WorkerView

SHARE_RUNGS = 4  # the prefill share's time constants: window, window/3, window/9, window/27
MAX_CANDIDATES = 16  # options a Decision lists (best first) for the placement span


class _Priced(msgspec.Struct, frozen=True, kw_only=True):
    """One request priced on every worker (arrays indexed like the fleet's workers)."""

    now: float
    pre: np.ndarray  # workers that can prefill it
    dec: np.ndarray  # workers that can decode it
    agg: np.ndarray  # the `both` ones among pre
    cached: np.ndarray  # prompt tokens each worker holds
    ctx: int  # the context a decode step is priced at
    pf: np.ndarray  # prefill seconds on each worker (its steps, the decodes riding along included)
    booked: np.ndarray  # what it adds to the worker's backlog: pf, or less where it shares steps
    stolen: np.ndarray  # of which the decodes there would not have spent anyway
    ttft: np.ndarray  # backlog + prefill on each worker as P
    plain: np.ndarray  # decode step on each worker as D at its batch, no prefill beside it
    full_chunk: np.ndarray  # what one full prefill chunk there takes from the decodes beside it
    tpot: np.ndarray  # that step slowed by the worker's prefill share
    ext_p: np.ndarray  # seconds a prefill there takes from the sequences running or queued there
    ext_d: np.ndarray  # seconds this decode there adds to the others' steps
    fits: np.ndarray  # its KV fits on each worker as D


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
        self._links: dict[tuple[int, int], float] = {}  # (P, D) cost-model rows -> KV link bandwidth
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
        self._first_start = np.full(16, math.inf)  # starts[slot][0], so only due queues are walked
        self._queued = np.zeros(16)  # len(starts[slot])
        self._life = np.zeros(16)  # per worker: the mean seconds a decode placed there holds its slot
        self._starts: list[deque[float]] = []
        self._fleet = Fleet(self._cm_row, self._slot, lambda: self._coef)
        self._work = np.zeros((4, 0))  # step_seconds_many's prefill arguments, 5 steps per worker
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
    def observe(self, w: WorkerView, steps: Sequence[StepSample], now: float, instance: str = "") -> Efficiency | None:
        """A worker's engine steps (engine time `now`): its learned factors, when they moved enough to reprice
        it (the worker's own cost-model row from then on); None otherwise or with learning off."""
        if self.learner is None:
            return None
        key = (w.accelerator, w.model, w.devices, w.parallel)
        prior = self._cm_list[self._shape_row(key, w)]
        eff = self.learner.observe(w.worker_id, WorkerKey(*key), prior, steps, now, instance)
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

    def forget(self, worker_id: str) -> None:
        """A worker gone for good: its learned speed goes (its pool's stays, the prior of its successor)."""
        if self.learner is not None:
            self.learner.forget(worker_id)
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
                self._guard.ensure(len(self._last))
        return s

    def _link(self, p_row: int, d_row: int) -> float:
        """KV link bandwidth between two servers: it depends on their shapes only (cost-model rows)."""
        key = (p_row, d_row)
        bw = self._links.get(key)
        if bw is None:
            p, d = self._cm_list[p_row], self._cm_list[d_row]
            bw = self._links[key] = link_bandwidth(p.accel, p.devices, d.accel, d.devices)
        return bw

    # ---- the decision ----
    def _price(self, req: RequestInfo, workers: Sequence[WorkerView]) -> _Priced | None:
        """Every worker priced for `req`: TTFT on it as P, TPOT on it as D, and the delay each puts on others."""
        f = self._fleet
        f.sync(workers)
        pre, dec, agg_i = f.pools(req.model, req.exclude)
        if not len(pre) or not len(dec):
            return None
        now = req.arrival
        if self._t0 < 0:
            self._t0 = now
        prompt = req.prompt_len
        slots, sl, nw = f.slots, f.slot_index, len(f.ids)  # sl: slots as a view when it can be
        running, queue, max_batch, step_tokens, kv_total, kv_used, block_size = f.num.T
        # a prefill worker's running sequences are prefills (in its backlog already), not decodes beside them
        prefill_only = f.role == PREFILL
        running = np.where(prefill_only, 0.0, running)
        hit_blocks = np.zeros(nw)
        for wid, nb in req.cached_blocks.items():
            i = f.index.get(wid)
            if i is not None:
                hit_blocks[i] = nb
        cached = np.minimum(hit_blocks * req.block_size, max(prompt - 1, 0))  # RequestInfo.cached_tokens
        ctx = prompt + req.max_tokens // 2

        # Priced in one call, per worker: the prefill's first chunk (the chunks the batching core would run,
        # its decode batch riding along), and a decode step at its batch (running + queued + this one) and at
        # one fewer (the marginal cost of this sequence), and the running batch's decode step alone (what the
        # prefill's steps would have cost anyway). Prompts longer than a chunk price the rest after.
        chunk = np.maximum(step_tokens - running, 1.0)
        left = np.maximum(prompt - cached, 1.0)
        n_steps = np.ceil(left / chunk)
        n = np.minimum(left, chunk)
        b = running + queue + 1
        bb = np.minimum(b, max_batch)
        # Only a data-parallel worker is booked at its packed share (below): priced only if there is one
        pack = f.dp
        packing = bool(pack.any())
        blocks = 6 if packing else 5
        work = self._work
        if work.shape[1] != blocks * nw:
            work = self._work = np.zeros((4, blocks * nw))  # the decode steps' prefill columns stay 0
        work[0, :nw] = n
        work[1, :nw] = (n > 0) * 1.0
        work[2, :nw] = n * cached + n * (n + 1) // 2
        work[3, :nw] = cached
        work[0, 4 * nw : 5 * nw] = chunk  # and a full chunk of a fresh prompt beside the running batch
        work[1, 4 * nw : 5 * nw] = 1.0
        work[2, 4 * nw : 5 * nw] = chunk * (chunk + 1) // 2
        batch = [running, bb, bb - 1, running, running]
        if packing:  # and a step filled with copies of its first chunk: queued behind other prompts it shares
            # its steps (the batching core packs chunks under one token budget), so it takes that step / copies
            copies = chunk / np.maximum(n, 1.0)
            work[:, 5 * nw :] = work[:, :nw] * copies
            batch.append(running)
        batch_ = np.concatenate(batch)
        priced = step_seconds_many(f.tiled(blocks), work[0], work[1], work[2], work[3], batch_, batch_ * ctx)
        pf, step, fewer, alone = priced[:nw], priced[nw : 2 * nw], priced[2 * nw : 3 * nw], priced[3 * nw : 4 * nw]
        full_chunk = priced[4 * nw : 5 * nw] - alone
        packed = priced[5 * nw :] / copies if packing else None
        done = cached + n
        left = left - n
        coef = f.tiled(2) if packing else f.coef
        while np.count_nonzero(left):  # the rest of the prompt (a worker done with it adds nothing)
            n = np.minimum(left, chunk)
            on = (n > 0) * 1.0
            args = [n, on, n * done + n * (n + 1) // 2, done, running, running * ctx]
            if packing:  # its last, partial chunk shares a step too
                k = chunk / np.maximum(n, 1.0)
                args = [np.concatenate([a, a * k]) for a in args[:4]] + [np.concatenate([a, a]) for a in args[4:]]
            t = step_seconds_many(coef, *args)
            pf += t[:nw] * on
            if packed is not None:
                packed += t[nw:] / k * on
            done += n
            left -= n
        # Booked: on a data-parallel worker (any role), its packed share as far as the backlog ahead of it
        # fills its steps (a backlog of a full step or more: full steps; none: a step of its own): a short
        # prompt takes one of its engines, and its steps alone would book all of them (a `both` dp CPX
        # prefilling for a decoder refused 57% of a code trace it serves at 98%: measured). Elsewhere its own
        # steps: on a tp / ep worker the packed share under-predicted TTFT (seed R1 at 0.8x: 8% at the
        # median, the gated anchors -30% goodput; on tp `both` workers, the anchors -6%: measured), where its
        # own steps predict it within 3%.
        backlog = np.maximum(self._busy_until[sl] - now, 0.0)
        booked = pf
        if packed is not None:
            fill = np.minimum(backlog / np.maximum(priced[4 * nw : 5 * nw], 1e-9), 1.0)
            booked = np.where(pack, pf - (pf - np.minimum(packed, pf)) * fill, pf)
        ttft = backlog + pf
        # What the prefill takes from the decodes beside it (the prefill share's unit): its steps less the
        # plain decode steps they replace.
        stolen = np.maximum(pf - n_steps * alone, 0.0)

        # Decode, slowed by the worker's prefill share.
        waits = b > max_batch
        if np.count_nonzero(waits):
            step = np.where(waits, step * (b / max_batch), step)  # waits for a slot: b / max_batch rounds
        marginal = step - fewer
        marginal[bb <= 1] = 0.0
        share = self._share(now, sl, 0)
        _, tpot_slo = self._slo(req.model)
        rung = self._rung(max(req.max_tokens - 1, 1) * tpot_slo)  # the decode's life at its SLO
        if rung > 0:  # a short decode: the recent share, never below the long-run one
            share = np.maximum(share, self._share(now, sl, rung))
        slow = 1.0 - share
        # never slower than a step carrying a full chunk beside the batch: prefill cannot take more of a step
        tpot = np.minimum(step / slow, step + full_chunk)
        if np.count_nonzero(waits) and self._margin(req.model) > 0:
            # Keeping SLOs: it also waits until b - max_batch slots free (the queue before it, then its own), one
            # every life / max_batch seconds, and pays that wait in its own tokens: a short decode behind a
            # full batch pays it in a few (the rounds above only price the load; with admission off, serving
            # everything, the wait costs the cluster nothing and the rounds alone spread a saturated cluster).
            tpot = tpot + np.maximum(b - max_batch, 0.0) * self._life[sl] / max_batch / max(req.max_tokens - 1, 1)
        ext_d = (bb - 1) * max(req.max_tokens - 1, 0) * marginal / slow
        # Sequences a prefill here would hold up: the running batch and the decodes queued (for their KV or
        # a slot), not the prefills this policy queued ahead of it.
        for s in slots[self._first_start[sl] <= now].tolist():  # queued prefills that started by now
            starts = self._starts[s]
            while starts and starts[0] <= now:
                starts.popleft()
            self._first_start[s] = starts[0] if starts else math.inf
            self._queued[s] = len(starts)
        stalled = running + np.maximum(queue - self._queued[sl], 0.0)
        need = np.ceil((prompt + req.max_tokens) / np.maximum(block_size, 1))
        fits = (kv_total <= 0) | (need <= kv_total - kv_used) | (running == 0)
        return _Priced(now=now, pre=pre, dec=dec, agg=agg_i, cached=cached, ctx=ctx, pf=pf, booked=booked,
                       stolen=stolen, ttft=ttft,
                       plain=step, full_chunk=full_chunk, tpot=tpot, ext_p=stolen * stalled, ext_d=ext_d, fits=fits)

    def _idle(self, pr: _Priced, prefill: np.ndarray, n_out: int, ttft_slo: float, tpot_slo: float) -> float:
        """admission's idle reference: the best prefill alone, and a decode step alone in its batch, over SLO."""
        idle = float(pr.pf[prefill].min()) / ttft_slo
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
        pre, dec, agg_i, ttft, tpot = pr.pre, pr.dec, pr.agg, pr.ttft, pr.tpot
        # With admission on, the output tokens of the decodes placed on each worker that a prefill there would
        # push past their TPOT SLO (DecodeGuard); with it off the policy keeps no SLO but its own preference
        # and places by cost.
        harm_w = (self._guard.harmed(f.slots, np.maximum(self._busy_until[f.slot_index], pr.now), pr.stolen)
                  if margin > 0 else np.zeros(len(f.ids)))
        # Options: every `both` worker alone, then the top_k prefill x top_k decode pairs.
        ip = id_ = agg_i
        xfer = np.zeros(len(agg_i))
        if n_out > 1 or not len(agg_i):
            rows = f.row_list
            kv_bytes = req.prompt_len * self._cm_list[rows[pre[0]]].kv_bytes_per_token()
            # the fastest prefills among those within the TTFT SLO, then harming no guarded decode (as below)
            best_p = pre[np.lexsort((ttft[pre], harm_w[pre] > 0, ttft[pre] > ttft_slo))[: self.top_k]].tolist()
            best_d = dec[tpot[dec].argsort(kind="stable")[: self.top_k]].tolist()
            pairs = [(p, d) for p in best_p for d in best_d if p != d]
            if pairs:
                link = self._link
                pp, dd = zip(*pairs, strict=True)
                ip, id_ = np.concatenate([agg_i, pp]), np.concatenate([agg_i, dd])
                xfer = np.concatenate([xfer, [transfer_time(kv_bytes, link(rows[p], rows[d])) for p, d in pairs]])
        if not len(ip):
            return None
        o_ttft = ttft[ip]
        o_tpot = tpot[id_]
        o_e2e = o_ttft + xfer + (n_out - 1) * o_tpot
        miss = ~pr.fits[id_]
        harm = harm_w[ip]
        over = np.maximum((o_ttft + req.waited_s) / ttft_slo, o_tpot / tpot_slo if n_out > 1 else 0.0)
        if margin > 0:  # before anything is committed: a refused request leaves no bookkeeping behind
            # the best placement that does not cost guarded decodes as many tokens as it may bring, else the
            # best that fits, else the best
            out = next((m for m in (miss | (harm >= n_out), miss) if not m.all()), np.zeros_like(miss))
            j = int(np.argmin(np.where(out, np.inf, over)))
            if over[j] > margin and (no := self._refusal(req, pr, ip, int(ip[j]), float(over[j]), float(o_ttft[j]),
                                                         float(o_tpot[j]) if n_out > 1 else 0.0, margin)):
                return no
        if self.objective == "latency":
            order = np.lexsort((o_e2e, o_ttft, harm > 0, np.maximum(over, 1.0), miss))
        else:  # the cluster-seconds this request costs: its own time plus the delay it puts on others
            # within its SLOs first, then sparing the guarded decodes, then the cheapest
            order = np.lexsort((o_e2e + pr.ext_p[ip] + pr.ext_d[id_], harm > 0, over > 1.0, miss))
        k = int(order[0])
        p, d = int(ip[k]), int(id_[k])
        self._guarded(pr, int(f.slots[p]), int(f.slots[d]), p, d, n_out, pr.now + float(o_ttft[k] + xfer[k]), tpot_slo)
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
        tpot = float(pr.tpot[d]) if n_out > 1 else 0.0
        ttft_slo, tpot_slo = self._slo(req.model)
        over = over_slo(ttft + req.waited_s, tpot, n_out, ttft_slo, tpot_slo)
        if margin is None:
            margin = self._margin(req.model)
        if margin > 0 and over > margin and (no := self._refusal(req, pr, pr.pre, p, over, ttft, tpot, margin)):
            return no
        self._commit(int(self._fleet.slots[p]), float(pr.booked[p]), pr.now)
        return msgspec.structs.replace(decision, predicted_ttft_s=ttft, predicted_tpot_s=tpot)

    def _refusal(self, req: RequestInfo, pr: _Priced, prefills: np.ndarray, p: int, over: float, ttft: float,
                 tpot: float, margin: float) -> Decision | None:
        """Admission's rule for a placement over `margin` (prefill worker p; its predictions): None if the idle
        exception admits it, else the refusal. The idle reference (over `prefills`) and the arrivals at p are
        worked out only here, when it could refuse."""
        n_out = max(req.max_tokens, 1)
        ttft_slo, tpot_slo = self._slo(req.model)
        idle = self._idle(pr, prefills, n_out, ttft_slo, tpot_slo)
        busy = self._arrivals(pr.now, int(self._fleet.slots[p]), float(pr.pf[p]))
        if admit(over, margin, idle, busy):
            return None
        return refusal(ttft, tpot, over, margin, ttft_slo, idle, req.waited_s, self.admission_hold_s,
                       quiet_s(over, margin, idle, busy, self.window))

    def _guarded(self, pr: _Priced, slot_p: int, slot_d: int, p: int, d: int, n_out: int, start: float,
                 tpot_slo: float) -> None:
        """Commit the prefill on P (the decodes there absorb what it takes from them) and guard the decode on D
        from its first token on (DecodeGuard)."""
        self._guard.charge(slot_p, max(float(self._busy_until[slot_p]), pr.now), float(pr.stolen[p]))
        self._commit(slot_p, float(pr.booked[p]), pr.now)
        if n_out > 1:
            life = (n_out - 1) * float(pr.plain[d])
            # the slot's life, in the mean over the last max_batch or so decodes placed there
            old, mb = float(self._life[slot_d]), max(float(self._fleet.num[d, 2]), 1.0)
            self._life[slot_d] = life if old == 0.0 else old + (life - old) / mb
            queued = max(float(self._busy_until[slot_d]) - start, 0.0)  # prefill still queued on D by then
            slack = (n_out - 1) * tpot_slo - life - queued
            if slack < float(pr.full_chunk[d]):  # fragile: one prefill chunk beside it would break its SLO
                self._guard.add(slot_d, start, start + life + queued, n_out, slack, pr.now)

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
        decay = np.exp(-np.maximum(now - self._last[sl], 0.0) / tau)
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
        """Queue `booked` prefill seconds (`_Priced.booked`) on the worker behind what it holds."""
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
