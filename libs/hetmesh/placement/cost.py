"""The cost-aware placement policy: predict each feasible placement, pick the best.

For a request it prices every aggregated placement (one `both` worker does prefill and decode)
and every disaggregated one (prefill on P, KV over the NICs, decode on D; a `both` worker may
take either phase) with the cost model:

    TTFT  = prefill backlog on P + prefill time on P (after P's prefix hit, with P's decode batch riding along)
    TPOT  = decode step time on D at its batch (running + queued + this one) / (1 - D's prefill share)
    e2e   = TTFT + KV transfer (disaggregated) + (output - 1) * TPOT

The prefill backlog and each worker's prefill share are the policy's own bookkeeping of what
it placed (prefill seconds it predicted, drained in real time, read off `RequestInfo.arrival`);
batch sizes, memory and roles come from the `WorkerView`s. Objectives: "throughput" takes the
lowest e2e time plus the delay the placement puts on others (the prefill time on P for every
sequence it holds up there: P's running batch and the decodes queued on it, not the prefills
this policy queued ahead of it; and D's slower steps), preferring placements inside the SLOs
(in a closed loop, the highest throughput; the one that frees the cluster soonest otherwise);
"latency" takes the lowest TTFT among the placements that meet both SLOs (or the least
violating one).
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Mapping, Sequence

from hetmesh.costmodel import (
    CostModel,
    Efficiency,
    accelerator,
    link_bandwidth,
    load_efficiencies,
    server_model,
)
from hetmesh.costmodel.model import transfer_time
from hetmesh.placement.state import Decision, RequestInfo, WorkerView
from hetmesh.protocol import Role

_INF = float("inf")


class _Book:
    """What this policy placed on one worker: prefill seconds queued, when each queued prefill is
    due to start, and a decaying prefill share."""

    __slots__ = ("acc", "busy_until", "last", "starts")

    def __init__(self) -> None:
        self.busy_until = 0.0
        self.starts: deque[float] = deque()  # predicted start of each prefill placed here, in order
        self.acc = 0.0  # prefill seconds placed, exponentially decayed over the share window
        self.last = 0.0


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
    ) -> None:
        if objective not in ("throughput", "latency"):
            raise ValueError("objective must be 'throughput' or 'latency'")
        self.models = dict(models or {})
        self.dtypes = dict(dtypes or {})
        self.objective = objective
        self.ttft_slo = ttft_slo_s
        self.tpot_slo = tpot_slo_s
        if isinstance(efficiencies, str | os.PathLike):
            efficiencies = load_efficiencies(efficiencies)
        self.effs: Mapping[str, Efficiency] = dict(efficiencies or {})
        self.window = share_window_s
        self.top_k = top_k
        self._cms: dict[tuple[str, str, int, str], CostModel] = {}
        self._books: dict[str, _Book] = {}
        self._links: dict[tuple[str, int, str, int], float] = {}
        self._t0 = -1.0  # time of the first placement (the share estimator's warm-up)

    # ---- helpers ----
    def _cm(self, w: WorkerView) -> CostModel:
        key = (w.accelerator, w.model, w.devices, w.parallel)
        cm = self._cms.get(key)
        if cm is None:
            cm = self._cms[key] = server_model(w.accelerator, self.models.get(w.model, w.model), devices=w.devices,
                                               parallel=w.parallel, dtype=self.dtypes.get(w.model),
                                               efficiencies=self.effs)
        return cm

    def _book(self, wid: str) -> _Book:
        b = self._books.get(wid)
        if b is None:
            b = self._books[wid] = _Book()
        return b

    def _share(self, wid: str, now: float) -> float:
        """Fraction of wall time `wid` spends in prefill steps: the decayed prefill seconds placed
        there over the decayed window (bias-corrected while less than a window has passed)."""
        b = self._books.get(wid)
        if b is None or self._t0 < 0:
            return 0.0
        span = self.window * (1.0 - math.exp(-max(now - self._t0, 1e-3) / self.window))
        return min(b.acc * math.exp(-max(now - b.last, 0.0) / self.window) / max(span, 1.0), 0.95)

    def _stalled(self, w: WorkerView, now: float) -> int:
        """Sequences a prefill placed on w now would hold up: its running batch and the decodes queued
        there (waiting for their KV or a slot). The prefills queued ahead of it, which this policy
        placed and which a new prefill does not delay, are not counted."""
        b = self._books.get(w.worker_id)
        queued_prefills = 0
        if b is not None:
            while b.starts and b.starts[0] <= now:
                b.starts.popleft()
            queued_prefills = len(b.starts)
        return w.running + max(w.queue_depth - queued_prefills, 0)

    def _link(self, p: WorkerView, d: WorkerView) -> float:
        key = (p.accelerator, p.devices, d.accelerator, d.devices)
        bw = self._links.get(key)
        if bw is None:
            bw = self._links[key] = link_bandwidth(accelerator(p.accelerator), p.devices,
                                                   accelerator(d.accelerator), d.devices)
        return bw

    def _prefill(self, req: RequestInfo, w: WorkerView, now: float, memo: dict[tuple, float]
                 ) -> tuple[float, float, int]:
        """(TTFT on w, prefill seconds, cached tokens). `memo`: this request's prices by worker shape (a pool's
        workers often share one), which keeps a placement over hundreds of workers cheap."""
        cm = self._cm(w)
        cached = req.cached_tokens(w.worker_id)
        riding = w.running  # decodes sharing the prefill steps
        key = (id(cm), cached, riding, w.step_tokens)
        pf = memo.get(key)
        if pf is None:
            # The chunks the batching core would run, each a step beside the decodes riding along.
            left = max(req.prompt_len - cached, 1)
            done = cached
            chunk = max(w.step_tokens - riding, 1)
            ctx = riding * (req.prompt_len + req.max_tokens // 2)
            pf = 0.0
            while left > 0:
                n = min(left, chunk)
                pf += cm.step_time_totals(n, 1, n * done + n * (n + 1) // 2, done, riding, ctx)
                done += n
                left -= n
            memo[key] = pf
        backlog = max(self._book(w.worker_id).busy_until - now, 0.0)
        return backlog + pf, pf, cached

    def _tpot(self, req: RequestInfo, w: WorkerView, now: float, memo: dict[tuple, tuple[float, float]]
              ) -> tuple[float, float]:
        """(TPOT on w, seconds of delay this sequence adds to the others decoding there)."""
        cm = self._cm(w)
        b = w.running + w.queue_depth + 1
        bb = min(b, w.max_batch)
        key = (id(cm), b, w.max_batch)
        hit = memo.get(key)
        if hit is None:
            ctx = req.prompt_len + req.max_tokens // 2
            step = cm.step_time_totals(0, 0, 0, 0, bb, bb * ctx)
            if b > w.max_batch:  # waits for a slot: roughly b / max_batch rounds of the batch
                step *= b / w.max_batch
            marginal = step - cm.step_time_totals(0, 0, 0, 0, bb - 1, (bb - 1) * ctx) if bb > 1 else 0.0
            hit = memo[key] = (step, marginal)
        step, marginal = hit
        slow = 1.0 - self._share(w.worker_id, now)
        return step / slow, (bb - 1) * max(req.max_tokens - 1, 0) * marginal / slow

    @staticmethod
    def _fits(req: RequestInfo, w: WorkerView) -> bool:
        if w.kv_blocks_total <= 0:
            return True
        need = -(-(req.prompt_len + req.max_tokens) // max(w.block_size, 1))
        return need <= w.kv_blocks_total - w.kv_blocks_used or w.running == 0

    # ---- the decision ----
    def place(self, req: RequestInfo, workers: Sequence[WorkerView]) -> Decision | None:
        cands = [w for w in workers if w.model == req.model and w.worker_id not in req.exclude]
        pre = [w for w in cands if w.serves(Role.PREFILL)]
        dec = [w for w in cands if w.serves(Role.DECODE)]
        if not pre or not dec:
            return None
        now = req.arrival
        if self._t0 < 0:
            self._t0 = now
        n_out = max(req.max_tokens, 1)
        pf_memo: dict[tuple, float] = {}
        tpot_memo: dict[tuple, tuple[float, float]] = {}
        pf_of = {w.worker_id: self._prefill(req, w, now, pf_memo) for w in pre}
        tpot_ext = {w.worker_id: self._tpot(req, w, now, tpot_memo) for w in dec}
        tpot_of = {k: v[0] for k, v in tpot_ext.items()}
        fits = {w.worker_id: self._fits(req, w) for w in dec}
        stalled = {w.worker_id: self._stalled(w, now) for w in pre}
        # (e2e, ttft, tpot, P, D, delay imposed on others: decodes stalled behind the prefill on P
        # plus the slower steps of D's batch)
        options: list[tuple[float, float, float, WorkerView, WorkerView, float]] = []
        for w in pre:
            if w.role == Role.BOTH and w.worker_id in tpot_of:
                ttft = pf_of[w.worker_id][0]
                tpot = tpot_of[w.worker_id]
                ext = pf_of[w.worker_id][1] * stalled[w.worker_id] + tpot_ext[w.worker_id][1]
                options.append((ttft + (n_out - 1) * tpot, ttft, tpot, w, w, ext))
        if n_out > 1 or not options:
            kv_bytes = req.prompt_len * self._cm(pre[0]).kv_bytes_per_token()
            best_p = sorted(pre, key=lambda w: pf_of[w.worker_id][0])[: self.top_k]
            best_d = sorted(dec, key=lambda w: tpot_of[w.worker_id])[: self.top_k]
            for p in best_p:
                for d in best_d:
                    if p.worker_id == d.worker_id:
                        continue
                    ttft = pf_of[p.worker_id][0]
                    tpot = tpot_of[d.worker_id]
                    xfer = transfer_time(kv_bytes, self._link(p, d))
                    ext = pf_of[p.worker_id][1] * stalled[p.worker_id] + tpot_ext[d.worker_id][1]
                    options.append((ttft + xfer + (n_out - 1) * tpot, ttft, tpot, p, d, ext))
        if not options:
            return None
        choice = min(options, key=lambda o: self._score(o, fits, n_out))
        e2e, ttft, tpot, p, d, _ = choice
        self._commit(p.worker_id, pf_of[p.worker_id][1], now)
        agg = p.worker_id == d.worker_id
        return Decision(
            mode="aggregated" if agg else "disaggregated",
            decode_worker=d.worker_id,
            prefill_worker=None if agg else p.worker_id,
            expected_cached_tokens=pf_of[p.worker_id][2],
            reason=f"cost/{self.objective}: e2e {e2e:.3f}s",
            predicted_ttft_s=ttft,
            predicted_tpot_s=tpot if n_out > 1 else 0.0,
            candidates=tuple((o[3].worker_id, o[4].worker_id, o[1], o[2], o[0]) for o in options),
        )

    def _score(self, o: tuple[float, float, float, WorkerView, WorkerView, float], fits: Mapping[str, bool],
               n_out: int) -> tuple[float, ...]:
        e2e, ttft, tpot, _, d, ext = o
        miss = 0 if fits.get(d.worker_id, True) else 1
        over = max(ttft / self.ttft_slo, (tpot / self.tpot_slo) if n_out > 1 else 0.0)
        if self.objective == "latency":
            return (miss, max(over, 1.0), ttft, e2e)
        # throughput: the cluster-seconds this request costs, its own time plus the delay it puts on others
        return (miss, 0.0 if over <= 1.0 else 1.0, e2e + ext)

    def _commit(self, wid: str, pf: float, now: float) -> None:
        b = self._book(wid)
        b.starts.append(max(b.busy_until, now))
        b.busy_until = max(b.busy_until, now) + pf
        b.acc = b.acc * math.exp(-max(now - b.last, 0.0) / self.window) + pf
        b.last = now
