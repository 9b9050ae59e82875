"""llm-d's inference scheduler (the endpoint picker, EPP) as a Hetmesh policy, for users who run it today.

Shaped as llm-d is: per scheduling profile a filter (the endpoints of a role), weighted scorers each
normalised to [0, 1], and a max-score picker; the P/D profile handler schedules the decode profile
first and runs the prefill profile only when its decider says so. Rules, from
llm-d/llm-d-inference-scheduler (the gateway-api-inference-extension plugins it builds on):

- prefix-cache-scorer (gateway-api-inference-extension pkg/epp/scheduling/framework/plugins/multi/prefix):
  matched prefix blocks / the prompt's blocks.
- queue-scorer (same tree, plugins/scorer/queue.go): (max queue - queue) / (max queue - min queue) over
  the candidates, 1.0 for every one when all queues are equal.
- kv-cache-utilization-scorer (plugins/scorer/kvcache_utilization.go): 1 - KV cache usage.
- max-score picker (plugins/picker/max_score_picker.go): the highest weighted sum, ties at random (llm-d
  shuffles the candidates first; ours is a seeded RNG, so a run repeats).
- weights: the example P/D profile (deploy/config/sim-pd-epp-config.yaml): prefix-cache-scorer 2,
  queue-scorer 1, in both the prefill and the decode profile; llm-d's default profile (its inference-scheduling
  guide): prefix-cache-scorer 3, kv-cache-utilization-scorer 2, queue-scorer 2.
- P/D decider (pkg/plugins/profile/prefix_based_pd_decider.go): on the chosen decode endpoint,
  non-cached = prompt tokens - cached tokens; disaggregate iff non-cached >= nonCachedTokens, where
  nonCachedTokens = 0 disables disaggregation. Without a prefill endpoint the decode endpoint prefills
  (the sidecar's decode-only fallback).

Filters by role: the decode profile takes `decode` and `both` workers, the prefill profile `prefill` and
`both` (llm-d's by-label role filters). When the prefill profile picks the decode endpoint itself, the
request runs aggregated there.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from hetmesh.placement.state import Decision, RequestInfo, WorkerView
from hetmesh.protocol import Role


def endpoints(req: RequestInfo, workers: Sequence[WorkerView], role: Role) -> list[WorkerView]:
    """The profile's filter: the request's model, workers that take `role` (or both), not excluded."""
    return [w for w in workers if w.model == req.model and w.serves(role) and w.worker_id not in req.exclude]


def prefix_scores(req: RequestInfo, pool: Sequence[WorkerView]) -> list[float]:
    """prefix-cache-scorer: the share of the prompt's blocks each endpoint holds."""
    total = max(req.prompt_len // max(req.block_size, 1), 1)
    return [min(req.cached_blocks.get(w.worker_id, 0) / total, 1.0) for w in pool]


def queue_scores(pool: Sequence[WorkerView]) -> list[float]:
    """queue-scorer: min-max normalised waiting queue, the shortest 1.0; all equal -> 1.0 each."""
    qs = [w.queue_depth for w in pool]
    lo, hi = min(qs, default=0), max(qs, default=0)
    if hi == lo:
        return [1.0] * len(qs)
    return [(hi - q) / (hi - lo) for q in qs]


def kv_scores(pool: Sequence[WorkerView]) -> list[float]:
    """kv-cache-utilization-scorer: 1 - the share of KV blocks in use."""
    return [1.0 - (w.kv_blocks_used / w.kv_blocks_total if w.kv_blocks_total > 0 else 0.0) for w in pool]


def weighted(parts: Sequence[tuple[float, Sequence[float]]], n: int) -> list[float]:
    """The profile's score: sum of weight x scorer (each scorer already in [0, 1])."""
    out = [0.0] * n
    for weight, scores in parts:
        if weight:
            for i, s in enumerate(scores):
                out[i] += weight * s
    return out


def max_score(pool: Sequence[WorkerView], scores: Sequence[float], rng: random.Random | None = None) -> WorkerView:
    """max-score picker: the highest score; ties at random as llm-d's picker shuffles first (seeded `rng`:
    repeatable), or by worker id without one."""
    best = max(scores)
    tied = [w for w, s in zip(pool, scores, strict=True) if s == best]
    return rng.choice(tied) if rng is not None and len(tied) > 1 else min(tied, key=lambda w: w.worker_id)


def disaggregate(prompt_len: int, cached_tokens: int, non_cached_tokens: int) -> bool:
    """prefix-based P/D decider: split iff the decode endpoint's non-cached prompt tokens reach the threshold
    (0 disables splitting)."""
    if non_cached_tokens <= 0:
        return False
    return prompt_len - cached_tokens >= non_cached_tokens


class LlmD:
    """llm-d's EPP: decode profile, then (if the decider approves) the prefill profile."""

    name = "llm_d"

    def __init__(self, prefix_weight: float = 2.0, queue_weight: float = 1.0, kv_weight: float = 0.0,
                 non_cached_tokens: int = 0, seed: int = 0) -> None:
        if min(prefix_weight, queue_weight, kv_weight) < 0 or non_cached_tokens < 0:
            raise ValueError("llm_d: scorer weights and non_cached_tokens must be >= 0")
        self.weights = (prefix_weight, queue_weight, kv_weight)
        self.non_cached_tokens = non_cached_tokens
        self.rng = random.Random(seed)

    def pick(self, req: RequestInfo, pool: Sequence[WorkerView]) -> WorkerView:
        wp, wq, wk = self.weights
        parts = [(wp, prefix_scores(req, pool) if wp else ()), (wq, queue_scores(pool) if wq else ()),
                 (wk, kv_scores(pool) if wk else ())]
        return max_score(pool, weighted(parts, len(pool)), self.rng)

    def place(self, req: RequestInfo, workers: Sequence[WorkerView]) -> Decision | None:
        decode = endpoints(req, workers, Role.DECODE)
        if not decode:
            return None
        d = self.pick(req, decode)
        cached = req.cached_tokens(d.worker_id)
        p = d
        if disaggregate(req.prompt_len, cached, self.non_cached_tokens):
            prefill = endpoints(req, workers, Role.PREFILL)
            if prefill:
                p = self.pick(req, prefill)
        if p is d:
            return Decision(mode="aggregated", decode_worker=d.worker_id, expected_cached_tokens=cached,
                            reason=f"llm_d: decode profile, non-cached {req.prompt_len - cached}")
        return Decision(mode="disaggregated", prefill_worker=p.worker_id, decode_worker=d.worker_id,
                        expected_cached_tokens=req.cached_tokens(p.worker_id),
                        reason=f"llm_d: non-cached {req.prompt_len - cached} >= {self.non_cached_tokens}")
