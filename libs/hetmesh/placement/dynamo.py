"""NVIDIA Dynamo's KV router as a Hetmesh policy, for users who run it today.

Rules, from ai-dynamo/dynamo:

- Worker cost (docs/components/router/router-concepts.md; lib/kv-router/src/scheduling/selector.rs,
  `worker_logit`): raw prefill blocks = the worker's active prefill blocks + the prompt's blocks;
  adjusted = max(raw - overlap_score_credit x cached blocks, 0);
  cost = prefill_load_scale x adjusted + decode blocks (active + this request's)
         + decode_active_request_weight x active requests.
  Defaults: credit 1, scale 1, request weight 0 (`--agentic` preset: 2, 4, 64). The older docs' form is
  the same with credit folded in: cost = overlap_score_weight x prefill_blocks + decode_blocks, worked
  example W1 = 8 + 10 = 18, W2 = 5 + 5 = 10 (chosen), W3 = 2 + 9 = 11.
- Selection: temperature 0 -> argmin, ties at random among the best (ours: a seeded RNG, so a run repeats).
- Disaggregated serving: the decode router's branch is max(decode blocks - credit x cached, 0) + request
  weight x active requests; the prefill router uses the full cost over the prefill workers.
- Conditional disaggregation, policy `isl_bounding` (the docs' "Conditional Disaggregation" page; frontend
  flags --router-conditional-disagg, --router-conditional-disagg-config {eff_isl_threshold, ...}):
  the prefill stays on the chosen decode worker when its effective (uncached) ISL < eff_isl_threshold
  (2048) and effective / raw ISL < eff_isl_ratio_threshold (0.7).

Shaped like the other anchor: a filter (the request's model; `both`, or the prefill and decode pools), a
scorer (`kv_cost`, `decode_cost`) and a picker (`argmin`).

What the router tracks itself (lib/kv-router ActiveSequences: prompt blocks from routing until the first
token) we rebuild from what a heartbeat says: each worker's prompt blocks this policy routed there, oldest
first, kept while the worker still reports that many requests waiting (`queue_depth`). Active decode blocks
are the worker's KV blocks in use. All blocks are counted in the request's block size.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence

from hetmesh.placement.state import Decision, RequestInfo, WorkerView
from hetmesh.protocol import Role


def kv_cost(prefill_blocks: float, cached_blocks: float, decode_blocks: float, active_requests: int = 0, *,
            prefill_load_scale: float = 1.0, overlap_score_credit: float = 1.0,
            request_weight: float = 0.0) -> float:
    """A worker's routing cost (lower is better)."""
    adjusted = max(prefill_blocks - overlap_score_credit * cached_blocks, 0.0)
    return prefill_load_scale * adjusted + decode_blocks + request_weight * active_requests


def decode_cost(decode_blocks: float, cached_blocks: float, active_requests: int = 0, *,
                overlap_score_credit: float = 1.0, request_weight: float = 0.0) -> float:
    """The decode router's cost in disaggregated serving."""
    return max(decode_blocks - overlap_score_credit * cached_blocks, 0.0) + request_weight * active_requests


def isl_bounding(raw_isl: int, cached_tokens: int, eff_isl_threshold: int = 2048,
                 eff_isl_ratio_threshold: float = 0.7) -> bool:
    """True: prefill locally on the decode worker (no disaggregation)."""
    eff = max(raw_isl - cached_tokens, 0)
    return eff < eff_isl_threshold and eff / max(raw_isl, 1) < eff_isl_ratio_threshold


def argmin(pool: Sequence[WorkerView], costs: Sequence[float], rng: random.Random | None = None) -> WorkerView:
    """Temperature 0: the lowest cost; ties at random (seeded `rng`: repeatable), or by worker id without one."""
    best = min(costs)
    tied = [w for w, c in zip(pool, costs, strict=True) if c == best]
    return rng.choice(tied) if rng is not None and len(tied) > 1 else min(tied, key=lambda w: w.worker_id)


class Dynamo:
    """Dynamo's KV router: aggregated over `both` workers; with prefill and decode workers, disaggregated
    (conditionally, with `conditional="isl_bounding"`)."""

    name = "dynamo"

    def __init__(self, prefill_load_scale: float = 1.0, overlap_score_credit: float = 1.0,
                 request_weight: float = 0.0, conditional: str = "", eff_isl_threshold: int = 2048,
                 eff_isl_ratio_threshold: float = 0.7, seed: int = 0) -> None:
        if conditional not in ("", "isl_bounding"):
            raise ValueError("dynamo: conditional is '' (always split when split pools exist) or 'isl_bounding'")
        if min(prefill_load_scale, overlap_score_credit, request_weight) < 0:
            raise ValueError("dynamo: prefill_load_scale, overlap_score_credit and request_weight must be >= 0")
        self.scale = prefill_load_scale
        self.credit = overlap_score_credit
        self.request_weight = request_weight
        self.conditional = conditional
        self.eff_isl = eff_isl_threshold
        self.eff_ratio = eff_isl_ratio_threshold
        self.rng = random.Random(seed)
        self._prefills: dict[str, deque[float]] = {}  # worker -> prompt blocks routed there, oldest first

    # ---- the router's own bookkeeping, rebuilt from heartbeats ----
    def _active_prefill(self, w: WorkerView) -> float:
        q = self._prefills.get(w.worker_id)
        if not q:
            return 0.0
        while len(q) > w.queue_depth:  # the oldest have left the queue: their prefill is under way or done
            q.popleft()
        return sum(q)

    def _decode_blocks(self, w: WorkerView, block: int) -> float:
        return w.kv_blocks_used * w.block_size / block

    # ---- the decision ----
    def place(self, req: RequestInfo, workers: Sequence[WorkerView]) -> Decision | None:
        pool = [w for w in workers if w.model == req.model and w.worker_id not in req.exclude]
        block = max(req.block_size, 1)
        blocks = -(-req.prompt_len // block)
        new = blocks + -(-max(req.max_tokens, 0) // block)  # the blocks this request will hold while decoding
        both = [w for w in pool if w.role == Role.BOTH]
        pre = [w for w in pool if w.role == Role.PREFILL]
        dec = [w for w in pool if w.role == Role.DECODE]
        if not (pre and dec):  # aggregated serving: one router over the workers that do both
            agg = both or dec or pre
            if not agg:
                return None
            costs = [self._cost(req, w, blocks, new, block) for w in agg]
            return self._aggregated(req, argmin(agg, costs, self.rng), blocks)
        costs = [decode_cost(self._decode_blocks(w, block) + new, req.cached_blocks.get(w.worker_id, 0),
                             w.running + w.queue_depth, overlap_score_credit=self.credit,
                             request_weight=self.request_weight) for w in dec]
        d = argmin(dec, costs, self.rng)
        if self.conditional == "isl_bounding" and isl_bounding(req.prompt_len, req.cached_tokens(d.worker_id),
                                                               self.eff_isl, self.eff_ratio):
            return self._aggregated(req, d, blocks, note="isl_bounding: local prefill")
        p = argmin(pre, [self._cost(req, w, blocks, 0, block) for w in pre], self.rng)
        self._routed(req, p, blocks)
        return Decision(mode="disaggregated", prefill_worker=p.worker_id, decode_worker=d.worker_id,
                        expected_cached_tokens=req.cached_tokens(p.worker_id), reason="dynamo: prefill router")

    def _cost(self, req: RequestInfo, w: WorkerView, blocks: int, new: int, block: int) -> float:
        return kv_cost(self._active_prefill(w) + blocks, req.cached_blocks.get(w.worker_id, 0),
                       self._decode_blocks(w, block) + new, w.running + w.queue_depth,
                       prefill_load_scale=self.scale, overlap_score_credit=self.credit,
                       request_weight=self.request_weight)

    def _routed(self, req: RequestInfo, w: WorkerView, blocks: int) -> None:
        # Active prefill is what the worker must compute: the blocks it does not hold.
        self._prefills.setdefault(w.worker_id, deque()).append(float(max(blocks - req.cached_blocks.get(w.worker_id, 0), 0)))

    def withdraw(self, decision: Decision) -> None:
        """Forget the prefill `decision` routed (refused after the choice, by an admission gate)."""
        q = self._prefills.get(decision.prefill_worker or decision.decode_worker)
        if q:
            q.pop()  # place() appended it last

    def _aggregated(self, req: RequestInfo, w: WorkerView, blocks: int, note: str = "kv router") -> Decision:
        self._routed(req, w, blocks)
        return Decision(mode="aggregated", decode_worker=w.worker_id,
                        expected_cached_tokens=req.cached_tokens(w.worker_id), reason=f"dynamo: {note}")
