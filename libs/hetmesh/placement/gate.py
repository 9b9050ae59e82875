"""Any policy's placement behind the cost policy's SLO-aware admission (hetmesh.placement.admission).

For a fair comparison with the routers users run (benchmarks/anchors.py): llm-d has flow control and
Dynamo busy thresholds, so an anchor with an admission rule of its own is a real deployment. Here the rule
is exactly cost's: the inner policy chooses, the cost model predicts that choice's TTFT and TPOT
(`CostPolicy.assess`), and the request is refused when that placement is over `margin` x its SLO (with
admission's idle exception). An admitted placement is booked in the predictor's backlog; a refused one is
withdrawn from the inner policy's own bookkeeping where it keeps one (`withdraw`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hetmesh.placement.admission import REFUSED
from hetmesh.placement.state import Decision, RequestInfo, WorkerView

if TYPE_CHECKING:
    from hetmesh.placement.cost import CostPolicy
    from hetmesh.placement.policies import Policy


class Gated:
    def __init__(self, inner: Policy, predictor: CostPolicy, margin: float | None = None) -> None:
        self.inner = inner
        self.predictor = predictor
        self.margin = margin  # None: the predictor's own (per model)
        self.name = f"{inner.name}+admission"
        self.learner = predictor.learner  # the admission prices with what the predictor learned
        self.observe = predictor.observe
        self.booked = predictor.booked  # another scheduler's placement: into the predictor's backlog too
        self.withdrawn = predictor.withdrawn  # a placement taken back: out of it
        # an inner policy that learns from observed latencies still hears of first tokens and completions
        self.request_first_token = getattr(inner, "request_first_token", None)
        self.request_done = getattr(inner, "request_done", None)

    def place(self, req: RequestInfo, workers: Sequence[WorkerView]) -> Decision | None:
        d = self.inner.place(req, workers)
        if d is None or d.mode == REFUSED:
            return d
        judged = self.predictor.assess(req, workers, d, self.margin)
        if judged.mode == REFUSED:
            withdraw = getattr(self.inner, "withdraw", None)
            if withdraw is not None:
                withdraw(d)
        return judged
