"""The scheduler's side of the online fit: each heartbeat's engine steps go to the policy's learner, and a
worker much slower than its peers of the same kind raises an alarm (an event and a metric) until it recovers."""

from __future__ import annotations

import time
from typing import Any

from hetmesh import metrics
from hetmesh.costmodel.learn import FitBudget, Learner
from hetmesh.placement import WorkerView
from hetmesh.protocol import Heartbeat

RECOVERED = 0.9  # an alarm clears below this fraction of the alarm ratio (no flapping at the threshold)


class Learning:
    def __init__(self, policy: Any, time_scale: float) -> None:
        self.observe = getattr(policy, "observe", None)
        self.observe_gaps = getattr(policy, "observe_gaps", None)
        self.learner: Learner | None = getattr(policy, "learner", None)
        self.time_scale = time_scale
        self.degraded: set[str] = set()
        self.budget = FitBudget()  # the fits' share of this process's CPU

    @property
    def on(self) -> bool:
        return self.learner is not None and self.observe is not None

    def heartbeat(self, hb: Heartbeat, view: WorkerView | None, now: float) -> str:
        """Fold in `hb`'s steps (`now`: the scheduler's monotonic clock); "degraded" / "recovered" when the
        worker's alarm changes, else ""."""
        if not self.on or view is None or not hb.steps:
            return ""
        assert self.observe is not None and self.learner is not None
        b = self.budget
        c0 = time.process_time()
        b.tick(c0, now)
        fit = b.ok or not self.learner.fitted(hb.worker_id)  # a worker's first fit is never put off
        if not fit:
            b.skipped += 1
        self.observe(view, hb.steps, now * self.time_scale, hb.instance, fit)
        if fit:
            b.spend(time.process_time() - c0)
        if hb.first_token_gaps and self.observe_gaps is not None:
            self.observe_gaps(view, hb.first_token_gaps)
        ratio = self.learner.degraded(hb.worker_id)
        if hb.worker_id not in self.degraded and ratio > self.learner.degraded_ratio:
            self.degraded.add(hb.worker_id)
            return "degraded"
        if hb.worker_id in self.degraded and ratio < RECOVERED * self.learner.degraded_ratio:
            self.degraded.discard(hb.worker_id)
            return "recovered"
        return ""

    def forget(self, worker_id: str) -> None:
        self.degraded.discard(worker_id)

    def status(self, worker_id: str) -> dict[str, Any]:
        """WorkerStatus's fields of the fit."""
        lr = self.learner
        if lr is None or worker_id not in lr.fits:
            return {}
        rep = lr.report(worker_id)
        return {"speed": lr.speed(worker_id), "speed_rel_std": lr.speed_rel_std(worker_id),
                "fitted_steps": int(rep.get("samples", 0)), "vs_peers": lr.degraded(worker_id),
                "degraded": worker_id in self.degraded,
                "efficiency": {k: rep[k] for k in ("compute", "memory", "overhead_s", "per_seq_s")},
                "cost_model": cm.model.name if (cm := lr.models.get(worker_id)) is not None else ""}

    def rows(self) -> list[metrics.Row]:
        lr = self.learner
        if lr is None:
            return []
        rows: list[metrics.Row] = []
        for wid in sorted(lr.fits):
            rep = lr.report(wid)
            labels = {"worker": wid}
            rows.append(("hetmesh_scheduler_worker_speed", "A worker's learned speed against its catalog prior on a "
                         "typical step (> 1: faster)", "gauge", labels, lr.speed(wid)))
            rows += [("hetmesh_scheduler_worker_efficiency", "A worker's learned efficiency factors",
                      "gauge", {**labels, "factor": k}, rep[k]) for k in ("compute", "memory", "overhead_s", "per_seq_s")]
            rows.append(("hetmesh_scheduler_worker_first_token_gap_seconds", "A worker's typical time to first "
                         "token outside its engine's steps (priced on top of them)", "gauge", labels,
                         lr.first_token_gap(wid)))
            rows.append(("hetmesh_scheduler_worker_fit_rel_std", "The largest relative std of a worker's fit",
                         "gauge", labels, rep["rel_std"]))
            rows.append(("hetmesh_scheduler_worker_fitted_steps", "Engine steps a worker's fit has used", "gauge",
                         labels, rep["samples"]))
            rows.append(("hetmesh_scheduler_worker_dropped_steps", "Absurd step reports dropped (not fitted)", "gauge",
                         labels, rep["dropped"]))
            rows.append(("hetmesh_scheduler_worker_vs_peers", "A worker's step time over its peers' of the same kind",
                         "gauge", labels, lr.degraded(wid)))
            rows.append(("hetmesh_scheduler_worker_degraded", "1 while a worker is much slower than its peers",
                         "gauge", labels, 1.0 if wid in self.degraded else 0.0))
        rows.append(("hetmesh_scheduler_step_reports_deferred", "Step reports kept for a later fit (the fits' CPU "
                     "budget was spent)", "counter", {}, float(self.budget.skipped)))
        rows.append(("hetmesh_scheduler_rejected_step_reports", "Step reports from a second process under a worker's "
                     "id", "gauge", {}, float(lr.rejected_reports)))
        return rows
