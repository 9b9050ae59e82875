"""Online fit of a worker's efficiency factors to the step times its engine reports. Pure.

The state is theta = (1/compute, 1/memory, overhead_s, per_seq_s). Given theta, a step's time is linear
in it: each kernel kind (dense, expert, attention) contributes its compute or its memory time, whichever
bounds it, so t - comm = h . theta with h = (compute s of the compute-bound kinds, memory s of the
memory-bound ones, 1, sequences), all at 100% efficiency (`CostModel.features`). A Kalman filter tracks
theta: a random walk between reports (drift: a throttled or shared chip) and a measurement noise
proportional to the step time (step times vary relatively). Each report is one batch update in
information form, linearised at the current estimate twice (the bound kind of a kernel may flip).
Residuals are Huber-weighted, so a GC pause or a preemption moves the fit by a bounded amount; absurd
samples (not finite, <= 0, or 100x off the prediction) are dropped and counted.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from hetmesh.costmodel.efficiency import Efficiency
from hetmesh.costmodel.model import CostModel
from hetmesh.protocol import StepSample

PARAMS = ("inv_compute", "inv_memory", "overhead_s", "per_seq_s")
_LO = np.array([1 / 1.5, 1 / 1.5, 0.0, 0.0])  # the bounds of a valid Efficiency ...
_HI = np.array([1e5, 1e5, 10.0, 1.0])  # up to 1e5x below peak, as offline calibration (a CPU under a GPU label)
_FLOOR = np.array([0.0, 0.0, 1e-3, 5e-5])  # the prior's std is relative, but never below these (s)
ABSURD = 100.0  # a sample this many times off the prediction (either way) is dropped, not fitted
# A worker's steps reach the fit this often (a bounded sample of all of them, on its heartbeat; the simulator
# the same): drift is tracked within seconds, and the fit's cost grows with the fleet, not with requests.
REPORT_S = 2.0
GAP_MIN = 8  # first-token gaps a worker reports before its typical gap is priced
GAP_MAX_S = 60.0  # a first-token gap this long is not the engine's hand-off: dropped
IMPOSTOR_S = 5.0  # engine seconds a run owns its worker id after its last report


class StepLog:
    """A bounded buffer of an engine's steps between two reports: at most `cap`, spread evenly over the steps
    taken (every k-th once full), and the count of the rest. The worker drains it into each heartbeat."""

    def __init__(self, cap: int = 64) -> None:
        self.cap = cap
        self._buf: list[StepSample] = []
        self._seen = 0
        self._stride = 1

    def add(self, sample: StepSample) -> None:
        self._seen += 1
        if (self._seen - 1) % self._stride:
            return
        self._buf.append(sample)
        if len(self._buf) >= 2 * self.cap:  # keep every other one from now on
            self._buf = self._buf[::2]
            self._stride *= 2

    def drain(self) -> list[StepSample]:
        out = self._buf[-self.cap:] if len(self._buf) > self.cap else self._buf
        self._buf, self._seen, self._stride = [], 0, 1
        return out


def features(cm: CostModel, samples: Sequence[StepSample]) -> np.ndarray:
    """(n, 8) per-step (dense_c, dense_m, expert_c, expert_m, attn_c, attn_m, comm, seqs) at 100% efficiency."""
    n = len(samples)
    out = np.empty((n, 8))
    if not n:
        return out
    a = np.array([msgspec.structs.astuple(s) for s in samples], dtype=float)
    seqs = a[:, 1] + a[:, 4]
    cols = cm.features(a[:, 0] + a[:, 4], seqs, a[:, 2], a[:, 5], a[:, 3] + a[:, 5], seqs)  # the scalar formulas
    for j, c in enumerate(cols):
        out[:, j] = c
    return out


def _design(f: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """Each step's h at `theta`: which of compute or memory bounds each kernel kind picks its column."""
    c, m = f[:, 0:6:2], f[:, 1:6:2]
    comp = c * theta[0] >= m * theta[1]
    h = np.ones((len(f), 4))
    h[:, 0] = np.where(comp, c, 0.0).sum(axis=1)
    h[:, 1] = np.where(comp, 0.0, m).sum(axis=1)
    h[:, 3] = f[:, 7]
    return h


def predict(f: np.ndarray, theta: np.ndarray) -> np.ndarray:
    return _design(f, theta) @ theta + f[:, 6]


def theta_of(e: Efficiency) -> np.ndarray:
    return np.array([1.0 / e.compute, 1.0 / e.memory, e.overhead_s, e.per_seq_s])


def efficiency_of(theta: np.ndarray) -> Efficiency:
    t = np.clip(theta, _LO, _HI)
    return Efficiency(compute=float(1.0 / t[0]), memory=float(1.0 / t[1]), overhead_s=float(t[2]),
                      per_seq_s=float(t[3]))


@dataclass(frozen=True)
class FitSettings:
    prior_rel_std: float = 1.0  # the catalog prior's std, relative to each factor
    drift_rel_per_s: float = 0.05  # random walk of each factor per sqrt(second) of engine time, relative
    noise_rel: float = 0.1  # a step's time varies by this much (relative std) around the model
    huber: float = 3.0  # residuals beyond this many std are down-weighted (Huber)


class Fit:
    """One Kalman filter over theta, started from a prior."""

    def __init__(self, prior: Efficiency, settings: FitSettings = FitSettings(), cov: np.ndarray | None = None,
                 theta: np.ndarray | None = None) -> None:
        self.s = settings
        self.prior = theta_of(prior)
        self.scale = np.maximum(np.abs(self.prior), _FLOOR)
        self.theta = self.prior.copy() if theta is None else theta.copy()
        self.cov = np.diag((settings.prior_rel_std * self.scale) ** 2) if cov is None else cov.copy()
        self.t = math.nan  # engine time of the last update
        self.samples = 0
        self.dropped = 0
        self.downweighted = 0

    def copy_as_prior(self, floor_rel: float = 0.2) -> Fit:
        """A new worker's start from this (pooled) fit: its estimate, its spread widened to at least floor_rel."""
        cov = self.cov.copy()
        np.fill_diagonal(cov, np.maximum(np.diag(cov), (floor_rel * np.maximum(np.abs(self.theta), _FLOOR)) ** 2))
        f = Fit(efficiency_of(self.prior), self.s, cov=cov, theta=self.theta)
        return f

    @property
    def efficiency(self) -> Efficiency:
        return efficiency_of(self.theta)

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(np.maximum(np.diag(self.cov), 0.0))

    def update(self, f: np.ndarray, seconds: np.ndarray, now: float) -> int:
        """Fold in steps (features `f`, measured `seconds`) reported at engine time `now`; returns how many were
        used (the rest were absurd and are counted in `dropped`)."""
        if not math.isnan(self.t) and now > self.t:
            q = (self.s.drift_rel_per_s * self.scale) ** 2 * (now - self.t)
            self.cov = self.cov + np.diag(q)
        if math.isnan(self.t) or now > self.t:
            self.t = now
        ok = np.isfinite(seconds) & (seconds > 0) & np.isfinite(f).all(axis=1)
        f, y_all = f[ok], seconds[ok]
        h = _design(f, self.theta)
        ratio = y_all / np.maximum(h @ self.theta + f[:, 6], 1e-12)
        sane = (ratio < ABSURD) & (ratio > 1.0 / ABSURD)
        self.dropped += len(seconds) - int(sane.sum())
        if not sane.any():
            return 0
        if not sane.all():
            f, y_all, h = f[sane], y_all[sane], h[sane]
        y = y_all - f[:, 6]
        r_var = (self.s.noise_rel * y_all) ** 2
        p_inv = np.linalg.inv(self.cov)
        prior_theta = self.theta
        prior_info = p_inv @ prior_theta
        for again in (True, False):  # relinearise once where the bound kind of a kernel flipped with theta
            resid = y - h @ prior_theta
            spread = r_var + ((h @ self.cov) * h).sum(axis=1)
            z = np.abs(resid) / np.sqrt(spread)
            w = np.where(z > self.s.huber, self.s.huber / np.maximum(z, 1e-12), 1.0)
            wr = w / r_var
            hw = h * wr[:, None]
            cov = np.linalg.inv(p_inv + hw.T @ h)
            theta = np.clip(cov @ (prior_info + hw.T @ y), _LO, _HI)
            if again:
                h2 = _design(f, theta)
                if np.array_equal(h2, h):
                    break
                h = h2
        self.theta, self.cov = theta, 0.5 * (cov + cov.T)
        self.samples += len(y)
        self.downweighted += int((w < 1.0).sum())
        return len(y)


class FitBudget:
    """The CPU the fits may take: `share` of what the rest of the process takes, and `floor` of a core besides
    (an idle scheduler still learns); unspent credit is kept up to `burst_s`. A token bucket in CPU seconds: the
    fits' cost grows with the fleet (every worker reports), the placements' with the requests, and this keeps the
    first a bounded fraction of the second. The caller measures both clocks and passes them in."""

    def __init__(self, share: float = 0.06, floor: float = 0.002, burst_s: float = 0.05) -> None:
        if share < 0 or floor < 0 or burst_s <= 0:
            raise ValueError(f"FitBudget: share {share} and floor {floor} must be >= 0, burst_s {burst_s} > 0")
        self.share, self.floor, self.burst_s = share, floor, burst_s
        self.credit = burst_s
        self._cpu = self._wall = math.nan
        self._spent = 0.0
        self.skipped = 0  # reports kept for a later fit for want of credit

    def tick(self, cpu_s: float, wall_s: float) -> None:
        """Earn credit for the process CPU (`cpu_s`, a running total) and wall time (`wall_s`) since last tick."""
        if not math.isnan(self._cpu):
            other = max(cpu_s - self._cpu - self._spent, 0.0)
            gain = self.share * other + self.floor * max(wall_s - self._wall, 0.0)
            self.credit = min(self.credit + gain, self.burst_s)
        self._cpu, self._wall, self._spent = cpu_s, wall_s, 0.0

    @property
    def ok(self) -> bool:
        return self.credit > 0.0

    def spend(self, cpu_s: float) -> None:
        """Charge a fit. The debt is bounded by `burst_s`: a storm of first fits (a fleet joining, never put
        off) holds the others back for a moment, not for as long as it took."""
        self.credit = max(self.credit - cpu_s, -self.burst_s)
        self._spent += cpu_s


class WorkerKey(msgspec.Struct, frozen=True):
    """The pool a worker's fit is shared with: one kind of server serving one model."""

    accelerator: str
    model: str
    devices: int
    parallel: str


class Learner:
    """Per-worker fits; what the workers of a server kind learned is a new worker's prior (`pool`). `observe` returns the
    worker's new efficiency when it moved by more than `republish_rel` on any factor since last returned."""

    def __init__(self, settings: FitSettings = FitSettings(), republish_rel: float = 0.02,
                 degraded_ratio: float = 1.5, cap: int = 64) -> None:
        self.s = settings
        self.cap = cap  # steps in one fit at most: what waits beyond is thinned evenly
        self.republish_rel = republish_rel
        self.degraded_ratio = degraded_ratio
        self.fits: dict[str, Fit] = {}
        self.key_of: dict[str, WorkerKey] = {}
        self.models: dict[str, CostModel] = {}  # worker id -> the prior cost model the features come from
        # A typical step's features per worker, and its time at the worker's current fit (once it has reported):
        # what speed, spread and the degraded alarm compare, kept up to date as reports arrive.
        self._typical: dict[str, np.ndarray] = {}
        self.typical_s: dict[str, float] = {}
        self._published: dict[str, np.ndarray] = {}
        self._runs: dict[str, tuple[str, float]] = {}  # worker id -> (the run reporting under it, when)
        self._pending: dict[str, list[StepSample]] = {}  # steps kept for the worker's next fit
        self._gaps: dict[str, deque[float]] = {}  # the newest first-token gaps of each worker
        # Per pool, a snapshot of its workers' typical step times, sorted, and when it was taken: what the
        # degraded alarm compares against (re-taken at most every REPORT_S / 2, so an alarm costs a bisection).
        self._peers: dict[WorkerKey, tuple[float, dict[str, float], list[float]]] = {}
        self._now = -math.inf
        self.rejected_reports = 0  # reports of a second process under a worker's id
        self.dropped_gaps = 0  # first-token gaps not finite, negative or over GAP_MAX_S

    def observe(self, worker_id: str, key: WorkerKey, cm: CostModel, samples: Iterable[StepSample],
                now: float, instance: str = "", fit: bool = True) -> Efficiency | None:
        """Fold in a report of `worker_id` (of kind `key`, run `instance`) at engine time `now`; with `fit`
        False its steps wait for the next report that is fitted (the fit's CPU is budgeted). A report from
        another run than the one reporting within IMPOSTOR_S is dropped (two processes under one id)."""
        samples, defer = list(samples), not fit
        run, last_t = self._runs.get(worker_id, ("", -math.inf))
        if instance and run and instance != run and now - last_t < IMPOSTOR_S:
            self.rejected_reports += 1
            return None
        if instance:
            self._runs[worker_id] = (instance, now)
        self._now = max(self._now, now)
        if self.key_of.get(worker_id, key) != key:
            self.forget(worker_id)  # a new model or layout (a re-plan): start again from its pool
        fit = self.fits.get(worker_id)
        if fit is None:
            fit = self.fits[worker_id] = self.pool(key, cm.eff).copy_as_prior()
            self.key_of[worker_id] = key
            self.models[worker_id] = cm
            self._typical[worker_id] = _reference(cm)
        if not samples:
            return None
        if defer:
            self._pending[worker_id] = _thin(self._pending.get(worker_id, []) + samples, self.cap)
            return None
        samples = _thin(self._pending.pop(worker_id, []) + samples, self.cap)
        f = features(self.models[worker_id], samples)
        secs = np.array([s.seconds for s in samples], dtype=float)
        if not fit.update(f, secs, now):
            return None
        self.typical_s[worker_id] = float(predict(self._typical[worker_id], fit.theta)[0])
        last = self._published.get(worker_id)
        if last is not None and (np.abs(fit.theta - last) <= self.republish_rel * np.abs(last)).all():
            return None
        self._published[worker_id] = fit.theta.copy()
        return fit.efficiency

    def pool(self, key: WorkerKey, prior: Efficiency) -> Fit:
        """What the workers of one kind have learned, as a fit: their mean estimate, with their own spread and
        the spread between them; the catalog prior while none of them has reported."""
        peers = [f for w, f in self.fits.items() if self.key_of.get(w) == key and f.samples]
        if not peers:
            return Fit(prior, self.s)
        thetas = np.array([f.theta for f in peers])
        cov = np.mean([f.cov for f in peers], axis=0) + (np.cov(thetas.T) if len(peers) > 1 else 0.0)
        return Fit(prior, self.s, cov=cov, theta=thetas.mean(axis=0))

    def forget(self, worker_id: str) -> None:
        self.fits.pop(worker_id, None)
        self.key_of.pop(worker_id, None)
        self.models.pop(worker_id, None)
        self._typical.pop(worker_id, None)
        self.typical_s.pop(worker_id, None)
        self._published.pop(worker_id, None)
        self._pending.pop(worker_id, None)
        self._gaps.pop(worker_id, None)

    def observe_gaps(self, worker_id: str, gaps: Iterable[float]) -> float:
        """Fold in a worker's first-token gaps: per request, its time to first token outside the engine's steps
        (hand-off, input and output processing; engine seconds). Returns the worker's typical gap, the median of
        its newest `cap` (robust to a request held up by a GC pause); absurd values are dropped and counted."""
        kept = self._gaps.setdefault(worker_id, deque(maxlen=self.cap))
        for g in gaps:
            if math.isfinite(g) and 0.0 <= g < GAP_MAX_S:
                kept.append(g)
            else:
                self.dropped_gaps += 1
        return self.first_token_gap(worker_id)

    def first_token_gap(self, worker_id: str) -> float:
        """The median of the worker's newest gaps; 0.0 until it has GAP_MIN (a worker's first requests meet
        cold caches and imports)."""
        kept = self._gaps.get(worker_id)
        return float(np.median(kept)) if kept is not None and len(kept) >= GAP_MIN else 0.0

    def fitted(self, worker_id: str) -> bool:
        """Whether the worker's own steps have been fitted yet."""
        fit = self.fits.get(worker_id)
        return fit is not None and fit.samples > 0

    def efficiency(self, worker_id: str) -> Efficiency | None:
        fit = self.fits.get(worker_id)
        return fit.efficiency if fit is not None and fit.samples else None

    def speed(self, worker_id: str) -> float:
        """How fast the worker runs against its catalog prior on a typical step (> 1: faster), 1.0 when unknown."""
        mine = self.typical_s.get(worker_id)
        if mine is None:
            return 1.0
        return float(predict(self._typical[worker_id], self.fits[worker_id].prior)[0]) / mine

    def speed_rel_std(self, worker_id: str) -> float:
        """The fit's relative std of the worker's typical step time (what `speed` rests on), 0.0 when unknown."""
        mine = self.typical_s.get(worker_id)
        if mine is None:
            return 0.0
        fit = self.fits[worker_id]
        h = _design(self._typical[worker_id], fit.theta)[0]
        return math.sqrt(max(float(h @ fit.cov @ h), 0.0)) / mine

    def degraded(self, worker_id: str) -> float:
        """The worker's typical step time over the median of its peers' of the same kind (> degraded_ratio:
        alarm), 1.0 if unknown. Peers of one kind share the typical step's features, so their times compare."""
        mine, key = self.typical_s.get(worker_id), self.key_of.get(worker_id)
        if mine is None or key is None:
            return 1.0
        snap = self._peers.get(key)
        if snap is None or worker_id not in snap[1] or self._now - snap[0] >= REPORT_S / 2:
            times = {w: t for w, t in self.typical_s.items() if self.key_of[w] == key}
            snap = self._peers[key] = (self._now, times, sorted(times.values()))
        theirs = _median_without(snap[2], snap[1][worker_id])
        return mine / theirs if theirs > 0 else 1.0

    def report(self, worker_id: str) -> dict[str, float]:
        fit = self.fits.get(worker_id)
        if fit is None:
            return {}
        e = fit.efficiency
        rel = fit.std / np.maximum(np.abs(fit.theta), _FLOOR)
        return {"compute": e.compute, "memory": e.memory, "overhead_s": e.overhead_s, "per_seq_s": e.per_seq_s,
                "rel_std": float(rel.max()), "samples": float(fit.samples), "dropped": float(fit.dropped)}


def _median_without(v: list[float], x: float) -> float:
    """The median of sorted `v` with one `x` (in it) left out; 0.0 when nothing is left."""
    m = len(v) - 1
    if m <= 0:
        return 0.0
    i = bisect.bisect_left(v, x)

    def at(k: int) -> float:
        return v[k] if k < i else v[k + 1]

    return at(m // 2) if m % 2 else 0.5 * (at(m // 2 - 1) + at(m // 2))


def _thin(samples: list[StepSample], cap: int) -> list[StepSample]:
    """At most `cap` of `samples`, evenly spread (the newest kept)."""
    n = len(samples)
    if n <= cap:
        return samples
    return [samples[n - 1 - (i * (n - 1)) // (cap - 1)] for i in range(cap - 1, -1, -1)] if cap > 1 else samples[-1:]


def _reference(cm: CostModel) -> np.ndarray:
    """A typical mixed step: a 512-token prefill chunk beside 16 decodes at 2,048 tokens of context."""
    return features(cm, [StepSample(512, 1, 512 * 513 / 2, 0, 16, 16 * 2048, 0.0)])


def pooled(workers: Iterable[Any]) -> dict[str, tuple[Efficiency, int, list[str]]]:
    """"<accelerator>/<model>" -> (Efficiency, steps, worker ids): what the fitted workers of each kind learned
    (anything with WorkerStatus's accelerator, cost_model, efficiency, fitted_steps and worker_id), their time
    multipliers (1/compute, 1/memory) and overheads averaged with their step counts as weights. The efficiency
    file `hetmesh calibrate` writes, and what the live planner plans with."""
    groups: dict[str, list[Any]] = {}
    for w in workers:
        if w.fitted_steps > 0 and w.efficiency and w.cost_model:
            groups.setdefault(f"{w.accelerator}/{w.cost_model}", []).append(w)
    out = {}
    for key, ws in sorted(groups.items()):
        n = sum(w.fitted_steps for w in ws)
        mean = {k: sum((1.0 / w.efficiency[k] if k in ("compute", "memory") else w.efficiency[k]) * w.fitted_steps
                       for w in ws) / n for k in ("compute", "memory", "overhead_s", "per_seq_s")}
        out[key] = (efficiency_of(np.array([mean["compute"], mean["memory"], mean["overhead_s"], mean["per_seq_s"]])),
                    n, sorted(w.worker_id for w in ws))
    return out
