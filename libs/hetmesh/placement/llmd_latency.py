"""llm-d's predicted-latency scheduling as a Hetmesh policy: a learned black box, no physics.

llm-d's EPP asks latency-predictor sidecars for each candidate pod's p90 TTFT and TPOT, predicted from the
pod's load at that moment, and an SLO-aware scorer picks among the pods with headroom. The predictor is
trained online on the TTFT and TPOT the EPP observes on its requests against the load features it saw when
it placed them. Rules, from llm-d's docs (architecture/advanced/latency-predictor,
guides/predicted-latency) and the gateway-api-inference-extension source (latency predictor training server;
scheduling/framework/plugins/multi/slo_aware_router/plugin.go):

- Features (the training server's): TTFT from KV-cache utilisation, prompt length, waiting and running
  requests, prefix-cache score and the uncached prompt ((1 - prefix score) x prompt length); TPOT from
  KV-cache utilisation, prompt length, waiting and running requests (the batch the request joins).
- Model: one per pool (here per model and role), trained on every pod's samples; llm-d assumes one pod shape
  (its docs: heterogeneous pools "are not yet modeled", "will produce inaccurate predictions"). Its default
  model is XGBoost with a p90 quantile objective; it also ships a Bayesian ridge model type. Neither XGBoost
  nor scikit-learn is a dependency here, so `model="trees"` is `QuantileTrees` below (a small gradient-boosted
  tree ensemble with the pinball loss, numpy) and `model="ridge"` is `OnlineRidge` (ridge regression from
  exponentially forgotten sufficient statistics, its p90 the fit plus z(0.9) residual spreads). Both learn
  from every sample as it comes (llm-d's training server refits periodically: this is the generous side).
  `per_pod=True` is a variant llm-d does not ship: one model per pod (the pool's model until the pod has
  samples of its own), the most a learned black box can do about heterogeneous pods.
- Cold start: until the pool's model has `min_samples` samples the predictor is not ready and llm-d's
  other scorers decide: here llm-d's prefix-cache + queue profile (`LlmD`).
- SLO scorer (slo_aware_router): headroom = SLO - predicted p90, per TTFT and TPOT. An affinity gate keeps
  only the pods holding (nearly) the whole prefix when any do (tau 0.99 over all candidates, 0.8 within a
  tier), ignored with probability epsilon (0.01). Pods with both headrooms positive are chosen with
  probability 1 - epsilon: a weighted draw, each pod's headrooms normalised within the tier and blended
  0.8 TTFT / 0.2 TPOT, weight favouring the least headroom ("least": packing, llm-d's default) or the most
  ("most"). Else among the pods over an SLO: idle pods first, then a weighted draw favouring the smallest
  blended deficit. Without an SLO (0) every pod is over it and the draw favours the lowest predictions.
- Shedding: when no pod has headroom and every pod is busy, a sheddable request (priority < 0 in llm-d) is
  refused; others still go to the least bad pod. `sheddable=True` treats every request as sheddable.
- P/D: the decode profile first (its pick by the scorer above), then llm-d's prefix-based decider
  (`non_cached_tokens`, 0 disables splitting); a split request's prefill pod is chosen on TTFT headroom
  alone (llm-d's P/D SLO design: prefill by TTFT, decode by TTFT and TPOT). A split request's TTFT trains
  the prefill pod's model on the prefill pod's features, its TPOT the decode pod's.

The feedback hooks: `request_first_token` (its TTFT, as llm-d samples it while the response streams) and
`request_done` (its mean TPOT); the simulator calls both. The features each request was placed on are kept
until it finishes, keyed by request id.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np

from hetmesh.placement.admission import REFUSED
from hetmesh.placement.llmd import LlmD, disaggregate, endpoints
from hetmesh.placement.state import Decision, RequestInfo, WorkerView
from hetmesh.protocol import Role

# slo_aware_router's defaults
TAU_GLOBAL = 0.99  # affinity gate over all candidates
TAU = 0.80  # affinity gate within a headroom tier
EPSILON = 0.01  # exploration: ignore the gate / pick from the negative tier
TTFT_WEIGHT, TPOT_WEIGHT = 0.8, 0.2  # blend of normalised headrooms (and of deficits)
MAX_PENDING = 200_000  # placements awaiting their completion (oldest dropped: a request that never finished)


class OnlineRidge:
    """Ridge regression y ~ x, refit from exponentially forgotten sufficient statistics.

    Each sample's weight decays by `forget` per later sample (memory about 1 / (1 - forget) samples), so a pod
    whose speed drifts is re-learned. The ridge penalty `ridge` is relative to each feature's variance (ridge on
    standardised features), so features in tokens and in queue slots are treated alike. `spread` is the running
    RMS of the prequential residuals (each sample against the fit before it): the quantile is fit + z x spread.
    """

    def __init__(self, n_features: int, quantile: float = 0.9, forget: float = 0.999, ridge: float = 1e-3) -> None:
        self.n = n_features
        self.z = NormalDist().inv_cdf(quantile)
        self.forget = forget
        self.ridge = ridge
        self.w = 0.0  # total weight
        self.sx = np.zeros(n_features)
        self.sxx = np.zeros((n_features, n_features))
        self.sy = 0.0
        self.sxy = np.zeros(n_features)
        self.count = 0  # samples seen
        self.sq = 0.0  # forgotten sum of squared residuals, and its weight
        self.sq_w = 0.0
        self._coef: list[float] | None = None
        self._intercept = 0.0

    def add(self, x: Sequence[float], y: float) -> None:
        if self.count >= 2 * (self.n + 1):  # a residual against a fit of enough samples before this one
            r = y - self.mean(x)
            self.sq = self.forget * self.sq + r * r
            self.sq_w = self.forget * self.sq_w + 1.0
        v = np.asarray(x, dtype=float)
        f = self.forget
        self.w = f * self.w + 1.0
        self.sx *= f
        self.sx += v
        self.sxx *= f
        self.sxx += np.outer(v, v)
        self.sy = f * self.sy + y
        self.sxy *= f
        self.sxy += y * v
        self.count += 1
        self._coef = None

    def _fit(self) -> None:
        mx = self.sx / self.w
        my = self.sy / self.w
        cov = self.sxx / self.w - np.outer(mx, mx)
        c = self.sxy / self.w - mx * my
        d = np.clip(np.diag(cov), 0.0, None)
        a = cov + np.diag(self.ridge * d + 1e-12 * (1.0 + d))
        beta = np.linalg.solve(a, c)
        self._coef = [float(b) for b in beta]
        self._intercept = float(my - mx @ beta)

    def mean(self, x: Sequence[float]) -> float:
        if self.count == 0:
            return 0.0
        if self._coef is None:
            self._fit()
        assert self._coef is not None
        return self._intercept + sum(b * v for b, v in zip(self._coef, x, strict=True))

    @property
    def spread(self) -> float:
        return math.sqrt(self.sq / self.sq_w) if self.sq_w > 0 else 0.0

    def predict(self, x: Sequence[float]) -> float:
        """The quantile at x: the fit plus z residual spreads, never below 0."""
        return max(self.mean(x) + self.z * self.spread, 0.0)


class QuantileTrees:
    """Gradient-boosted regression trees with the pinball (quantile) loss, XGBoost's `reg:quantileerror` in
    small: the model llm-d's predictor trains by default, on the same samples.

    Samples go to a window of the latest `window` (the forgetting); the ensemble is refit from the window when
    half as many samples again came since the last fit, and at least every tenth of a window (llm-d's training
    server refits periodically, not per sample).
    Each tree: depth `depth`, splits on `bins` quantile bins per feature chosen on the pinball gradient (unit
    hessian, as histogram GBDTs do for this loss), each leaf the residuals' quantile (the loss's line search),
    shrunk by `rate`. A tree predicts within the targets it saw: it does not extrapolate a slope.
    """

    def __init__(self, n_features: int, quantile: float = 0.9, trees: int = 40, depth: int = 3, rate: float = 0.3,
                 bins: int = 16, min_leaf: int = 5, window: int = 2000) -> None:
        self.n = n_features
        self.q = quantile
        self.n_trees, self.depth, self.rate, self.bins, self.min_leaf = trees, depth, rate, bins, min_leaf
        self.xs: deque[tuple[float, ...]] = deque(maxlen=window)
        self.ys: deque[float] = deque(maxlen=window)
        self.count = 0
        self._fitted_at = 0  # count at the last fit
        self._base = 0.0
        self._trees: list[object] = []  # node: (feature, threshold, left, right) or a leaf value (float)

    def add(self, x: Sequence[float], y: float) -> None:
        self.xs.append(tuple(x))
        self.ys.append(y)
        self.count += 1

    def _leaf(self, r: np.ndarray) -> float:
        """The residuals' q-quantile (the pinball loss's best constant), shrunk by the learning rate."""
        k = min(int(self.q * len(r)), len(r) - 1)
        return self.rate * float(np.partition(r, k)[k])

    def _grow(self, flat: np.ndarray, valid: np.ndarray, edges: list[np.ndarray], g: np.ndarray, r: np.ndarray,
              idx: np.ndarray, depth: int, out: np.ndarray) -> object:
        """One node over samples `idx` (`flat`: each sample's bin per feature, offset per feature); writes each
        sample's leaf value to `out`. The best split over every feature at once, by the gradients' variance
        reduction."""
        n = len(idx)
        if depth == 0 or n < 2 * self.min_leaf:
            v = out[idx] = self._leaf(r[idx])
            return v
        nf, nb = valid.shape[0], valid.shape[1] + 1
        gi = g[idx]
        fi = flat[idx]
        gs = np.bincount(fi.ravel(), weights=np.repeat(gi, nf), minlength=nf * nb).reshape(nf, nb)
        ns = np.bincount(fi.ravel(), minlength=nf * nb).reshape(nf, nb)
        gl = np.cumsum(gs, axis=1)[:, :-1]  # left of split k: bins 0..k
        nl = np.cumsum(ns, axis=1)[:, :-1]
        ok = valid & (nl >= self.min_leaf) & (n - nl >= self.min_leaf)
        if not ok.any():
            v = out[idx] = self._leaf(r[idx])
            return v
        total = float(gi.sum())
        gain = np.where(ok, gl * gl / np.maximum(nl, 1) + (total - gl) ** 2 / np.maximum(n - nl, 1), -np.inf)
        j, k = divmod(int(np.argmax(gain)), nb - 1)
        if gain[j, k] - total * total / n <= 1e-12:
            v = out[idx] = self._leaf(r[idx])
            return v
        left = fi[:, j] - j * nb <= k
        return (j, float(edges[j][k]), self._grow(flat, valid, edges, g, r, idx[left], depth - 1, out),
                self._grow(flat, valid, edges, g, r, idx[~left], depth - 1, out))

    def _fit(self) -> None:
        x = np.asarray(self.xs, dtype=float)
        y = np.asarray(self.ys, dtype=float)
        cuts = np.linspace(0.0, 1.0, self.bins + 1)[1:-1]
        edges = [np.unique(np.quantile(x[:, j], cuts)) for j in range(self.n)]
        nb = self.bins  # at most bins - 1 edges: bins 0 .. bins - 1
        # bin k of feature j holds edges[j][k-1] <= x < edges[j][k]: left of split k is x < edges[j][k]
        xb = np.stack([np.searchsorted(e, x[:, j], side="right") for j, e in enumerate(edges)], axis=1)
        flat = xb + np.arange(self.n) * nb
        valid = np.arange(nb - 1)[None, :] < np.array([len(e) for e in edges])[:, None]
        self._base = float(np.quantile(y, self.q))
        pred = np.full(len(y), self._base)
        self._trees = []
        idx = np.arange(len(y))
        out = np.empty(len(y))
        for _ in range(self.n_trees):
            r = y - pred
            g = np.where(r > 0, -self.q, 1.0 - self.q)  # the pinball loss's gradient in the prediction
            self._trees.append(self._grow(flat, valid, edges, g, r, idx, self.depth, out))
            pred += out
        self._fitted_at = self.count

    def predict(self, x: Sequence[float]) -> float:
        """The quantile at x, never below 0."""
        if self.count == 0:
            return 0.0
        if not self._trees or self.count - self._fitted_at >= max(len(self.xs) // 10, self._fitted_at // 2, 1):
            self._fit()
        v = self._base
        for node in self._trees:
            while type(node) is tuple:
                j, thr, lo, hi = node
                node = lo if x[j] < thr else hi
            v += node  # type: ignore[operator]
        return max(v, 0.0)


# llm-d's model types: XGBoost (its default; here the small quantile GBDT) and Bayesian ridge (here ridge)
MODELS: dict[str, type[OnlineRidge] | type[QuantileTrees]] = {"trees": QuantileTrees, "ridge": OnlineRidge}


def ttft_features(w: WorkerView, prefix: float, prompt_len: int) -> tuple[float, ...]:
    """KV utilisation, prompt (k tokens), waiting, running, prefix score, uncached prompt (k tokens)."""
    kv = w.kv_blocks_used / w.kv_blocks_total if w.kv_blocks_total > 0 else 0.0
    k = prompt_len / 1000.0
    return (kv, k, float(w.queue_depth), float(w.running), prefix, (1.0 - prefix) * k)


def tpot_features(w: WorkerView, prompt_len: int) -> tuple[float, ...]:
    """KV utilisation, prompt (k tokens), waiting, running (the batch it joins)."""
    kv = w.kv_blocks_used / w.kv_blocks_total if w.kv_blocks_total > 0 else 0.0
    return (kv, prompt_len / 1000.0, float(w.queue_depth), float(w.running))


class _Pred:
    __slots__ = ("prefix", "tpot", "tpot_room", "ttft", "ttft_room", "w")

    def __init__(self, w: WorkerView, ttft: float, tpot: float, prefix: float, ttft_slo: float, tpot_slo: float):
        self.w = w
        self.ttft = ttft
        self.tpot = tpot
        self.prefix = prefix
        self.ttft_room = ttft_slo - ttft
        self.tpot_room = tpot_slo - tpot

    @property
    def positive(self) -> bool:
        return self.ttft_room > 0 and self.tpot_room > 0


def _norm(vals: list[float], flat: float = 0.5) -> list[float]:
    """Min-max within the cohort; `flat` each when they are all equal (the router: 0.5 for headrooms, 0 for
    deficits)."""
    lo, hi = min(vals), max(vals)
    return [flat] * len(vals) if hi - lo <= 1e-9 else [(v - lo) / (hi - lo) for v in vals]


class LlmDLatency:
    """llm-d's predicted-latency routing: online-learned p90 TTFT/TPOT per candidate, SLO-headroom picker."""

    name = "llm_d_latency"

    def __init__(self, ttft_slo_s: float = 0.0, tpot_slo_s: float = 0.0, headroom: str = "least",
                 per_pod: bool = False, non_cached_tokens: int = 0, sheddable: bool = False, model: str = "trees",
                 min_samples: int = 10, quantile: float = 0.9, seed: int = 0) -> None:
        if headroom not in ("least", "most"):
            raise ValueError("llm_d_latency: headroom is 'least' (pack) or 'most' (spread)")
        if min(ttft_slo_s, tpot_slo_s) < 0 or non_cached_tokens < 0 or min_samples < 1:
            raise ValueError("llm_d_latency: SLOs and non_cached_tokens must be >= 0, min_samples >= 1")
        if not 0.0 < quantile < 1.0:
            raise ValueError("llm_d_latency: quantile in (0, 1)")
        if model not in MODELS:
            raise ValueError(f"llm_d_latency: model is one of {sorted(MODELS)}")
        self.ttft_slo = ttft_slo_s
        self.tpot_slo = tpot_slo_s
        self.headroom = headroom
        self.per_pod = per_pod
        self.non_cached_tokens = non_cached_tokens
        self.sheddable = sheddable
        self.min_samples = min_samples
        self.quantile = quantile
        self.regressor = MODELS[model]
        self.rng = random.Random(seed)
        self.fallback = LlmD(non_cached_tokens=non_cached_tokens, seed=seed)  # cold start: prefix + queue
        # (kind, key) -> model; kind "ttft" | "tpot"; key: ("pool", model, role) or ("pod", worker id)
        self.models: dict[tuple[str, tuple[str, ...]], OnlineRidge | QuantileTrees] = {}
        # request id -> (prefill view, TTFT features, decode view, TPOT features, TTFT learned), as placed
        self.pending: OrderedDict[str, tuple[WorkerView, tuple[float, ...], WorkerView, tuple[float, ...],
                                             float | None]] = OrderedDict()
        self._last = ""
        self.observed = 0  # completed requests learned from
        self.cold = 0  # placements made by the cold-start scorer

    # ---- learning ----
    def _model(self, kind: str, key: tuple[str, ...], n: int) -> OnlineRidge | QuantileTrees:
        m = self.models.get((kind, key))
        if m is None:
            m = self.models[(kind, key)] = self.regressor(n, quantile=self.quantile)
        return m

    def _keys(self, w: WorkerView) -> list[tuple[str, ...]]:
        pool = ("pool", w.model, str(w.role))
        return [pool, ("pod", w.worker_id)] if self.per_pod else [pool]

    def _learn(self, kind: str, w: WorkerView, x: Sequence[float], y: float | None) -> None:
        """One sample against the pod's features at placement; a missing or absurd value (NaN, negative, a
        TPOT of 0) trains nothing."""
        if y is None or not math.isfinite(y) or y < 0 or (kind == "tpot" and y == 0):
            return
        for key in self._keys(w):
            self._model(kind, key, len(x)).add(x, y)

    def request_first_token(self, request_id: str, ttft_s: float, now: float) -> None:
        """Feedback: request `request_id` streamed its first token at `now`, `ttft_s` after its placement (llm-d
        sends its TTFT sample then, not at the end of the stream)."""
        placed = self.pending.get(request_id)
        if placed is not None and placed[4] is None:
            self._learn("ttft", placed[0], placed[1], ttft_s)
            self.pending[request_id] = (*placed[:4], ttft_s)

    def request_done(self, request_id: str, prefill_worker: str, decode_worker: str, ttft_s: float | None,
                     tpot_s: float | None, now: float) -> None:
        """Feedback: request `request_id` finished at `now` with this TTFT and mean TPOT (None: one token)."""
        placed = self.pending.pop(request_id, None)
        if placed is None:  # not placed by this policy, or dropped as too old
            return
        pw, xt, dw, xp, seen = placed
        if seen is None:  # no first-token report came: its TTFT now
            self._learn("ttft", pw, xt, ttft_s)
        self._learn("tpot", dw, xp, tpot_s)
        self.observed += 1

    def withdraw(self, decision: Decision) -> None:
        """The last placement was refused after all (an admission gate in front): nothing will complete."""
        self.pending.pop(self._last, None)

    def _ready(self, kind: str, w: WorkerView) -> OnlineRidge | QuantileTrees | None:
        """The model that predicts for w: its own when it has enough samples (per_pod), else its pool's; None
        while neither has."""
        for key in reversed(self._keys(w)):
            m = self.models.get((kind, key))
            if m is not None and m.count >= self.min_samples:
                return m
        return None

    # ---- placement ----
    def _predict(self, req: RequestInfo, pool: Sequence[WorkerView], ttft_only: bool) -> list[_Pred] | None:
        total = max(req.prompt_len // max(req.block_size, 1), 1)
        out = []
        for w in pool:
            mt = self._ready("ttft", w)
            mp = None if ttft_only else self._ready("tpot", w)
            if mt is None or (mp is None and not ttft_only):
                return None
            prefix = min(req.cached_blocks.get(w.worker_id, 0) / total, 1.0)
            ttft = mt.predict(ttft_features(w, prefix, req.prompt_len))
            tpot = 0.0 if mp is None else mp.predict(tpot_features(w, req.prompt_len))
            out.append(_Pred(w, ttft, tpot, prefix, self.ttft_slo, math.inf if ttft_only else self.tpot_slo))
        return out

    def _gate(self, preds: list[_Pred], tau: float) -> tuple[list[_Pred], bool]:
        """Affinity gate: only the pods holding >= tau of the prefix, if any (ignored with probability epsilon)."""
        sticky = [p for p in preds if p.prefix >= tau]
        if not sticky or self.rng.random() < EPSILON:
            return preds, False
        return sticky, True

    def _draw(self, preds: list[_Pred], weights: list[int]) -> _Pred:
        i = self.rng.randrange(sum(weights))
        for p, wt in zip(preds, weights, strict=True):
            if i < wt:
                return p
            i -= wt
        return preds[0]

    def _positive(self, preds: list[_Pred]) -> _Pred:
        if len(preds) == 1:
            return preds[0]
        cand, sticky = self._gate(preds, TAU)
        if sticky and len(cand) == 1:
            return cand[0]
        nt = _norm([p.ttft_room for p in cand])
        np_ = _norm([p.tpot_room if math.isfinite(p.tpot_room) else 0.0 for p in cand])
        combined = [TTFT_WEIGHT * a + TPOT_WEIGHT * b for a, b in zip(nt, np_, strict=True)]
        share = combined if self.headroom == "most" else [1.0 - c for c in combined]
        return self._draw(cand, [int(s * 99) + 2 for s in share])

    def _negative(self, preds: list[_Pred]) -> _Pred:
        if len(preds) == 1:
            return preds[0]
        idle = [p for p in preds if p.w.load == 0]
        preds = idle or preds
        if len(preds) == 1:
            return preds[0]
        cand, sticky = self._gate(preds, TAU)
        if sticky and len(cand) == 1:
            return cand[0]
        # tiers in order (both over, TTFT over, TPOT over, neither): each weighted by its blended deficit
        tiers: list[list[_Pred]] = [[], [], [], []]
        for p in cand:
            t_over, p_over = p.ttft_room < 0, p.tpot_room < 0
            tiers[0 if t_over and p_over else 1 if t_over else 2 if p_over else 3].append(p)
        pods: list[_Pred] = []
        weights: list[int] = []
        for i, tier in enumerate(tiers):
            if not tier:
                continue
            if i == 3:
                pods += tier
                weights += [1] * len(tier)
                continue
            dt = _norm([max(-p.ttft_room, 0.0) for p in tier], 0.0)
            dp = _norm([max(-p.tpot_room, 0.0) for p in tier], 0.0)
            pods += tier
            weights += [int((1.0 - (TTFT_WEIGHT * a + TPOT_WEIGHT * b)) * 80) + 2 for a, b in zip(dt, dp, strict=True)]
        return self._draw(pods, weights)

    def _pick(self, preds: list[_Pred]) -> tuple[_Pred, bool]:
        """The scorer's choice, and whether the pool has no room for it (no headroom anywhere, every pod busy)."""
        everyone, sticky = self._gate(preds, TAU_GLOBAL)
        full = not sticky and all(not p.positive for p in everyone) and all(p.w.load > 0 for p in everyone)
        pos = [p for p in everyone if p.positive]
        neg = [p for p in everyone if not p.positive]
        if pos and (not neg or self.rng.random() >= EPSILON):
            return self._positive(pos), full
        return self._negative(neg), full

    def place(self, req: RequestInfo, workers: Sequence[WorkerView]) -> Decision | None:
        decode = endpoints(req, workers, Role.DECODE)
        if not decode:
            return None
        preds = self._predict(req, decode, ttft_only=False)
        if preds is None:  # predictor not ready: llm-d's other scorers decide
            self.cold += 1
            d = self.fallback.place(req, workers)
            if d is not None:
                self._remember(req, workers, d)
            return d
        chosen, full = self._pick(preds)
        if full and self.sheddable:
            best = min(preds, key=lambda p: p.ttft)
            return Decision(mode=REFUSED, decode_worker="", predicted_ttft_s=best.ttft, predicted_tpot_s=best.tpot,
                            reason="llm_d_latency: no pod with headroom, all busy: shed")
        dw = chosen.w
        cached = req.cached_tokens(dw.worker_id)
        pw, ttft = dw, chosen.ttft
        if disaggregate(req.prompt_len, cached, self.non_cached_tokens):
            prefill = endpoints(req, workers, Role.PREFILL)
            if prefill:
                pp = self._predict(req, prefill, ttft_only=True)
                if pp is None:  # no TTFT model for the prefill pods yet: the cold-start scorer picks
                    pw = self.fallback.pick(req, prefill)
                else:
                    c, _ = self._pick(pp)
                    pw, ttft = c.w, c.ttft
        if pw is dw:
            d = Decision(mode="aggregated", decode_worker=dw.worker_id, expected_cached_tokens=cached,
                         predicted_ttft_s=ttft, predicted_tpot_s=chosen.tpot,
                         reason=f"llm_d_latency: p90 TTFT {ttft:.3f}s TPOT {chosen.tpot * 1e3:.1f}ms")
        else:
            d = Decision(mode="disaggregated", prefill_worker=pw.worker_id, decode_worker=dw.worker_id,
                         expected_cached_tokens=req.cached_tokens(pw.worker_id), predicted_ttft_s=ttft,
                         predicted_tpot_s=chosen.tpot,
                         reason=f"llm_d_latency: split, p90 TTFT {ttft:.3f}s TPOT {chosen.tpot * 1e3:.1f}ms")
        self._remember(req, workers, d)
        return d

    def _remember(self, req: RequestInfo, workers: Sequence[WorkerView], d: Decision) -> None:
        """Keep the features the request was placed on, for its completion."""
        by_id = {w.worker_id: w for w in workers}
        dw = by_id[d.decode_worker]
        pw = by_id[d.prefill_worker] if d.prefill_worker else dw
        total = max(req.prompt_len // max(req.block_size, 1), 1)
        prefix = min(req.cached_blocks.get(pw.worker_id, 0) / total, 1.0)
        self.pending[req.request_id] = (pw, ttft_features(pw, prefix, req.prompt_len), dw,
                                        tpot_features(dw, req.prompt_len), None)
        self.pending.move_to_end(req.request_id)
        self._last = req.request_id
        while len(self.pending) > MAX_PENDING:
            self.pending.popitem(last=False)
