"""The live planner's pure parts: the scheduler's demand window, the fleet as the scheduler sees it
turned into planner input, and which of a plan's moves to send now.

The planner service (services/hetmesh/planner_service) is the shell: it feeds these with the scheduler's
status and demand reports, runs `hetmesh.planner.plan` per model (role moves: `RoleSwitch`) or over the
whole fleet (`planner.scope = fleet`, hetmesh.planner.commands: model moves too, `ModelSwitch`). A
multi-device worker's change of parallel layout is a `ModelSwitch` (a reload); a stop is reported, not made.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

import msgspec

from hetmesh.config import ClusterConfig
from hetmesh.planner.forecast import forecast_value
from hetmesh.planner.inputs import ModelDemand, ServerGroup
from hetmesh.planner.plan import Move, Plan
from hetmesh.protocol import ModelDemandStats, Role, WorkerStatus

FORGET_AFTER_WINDOWS = 10  # a submitted request never seen finishing is forgotten after this many windows


class _Arrival:
    __slots__ = ("cached", "max_tokens", "model", "prompt", "ts")

    def __init__(self, ts: float, model: str, prompt: int, max_tokens: int, cached: int) -> None:
        self.ts, self.model, self.prompt, self.max_tokens, self.cached = ts, model, prompt, max_tokens, cached


class DemandWindow:
    """Per-model demand over the last `window_s` seconds. Fed events with their time; `report(now)`
    summarises the window (and forgets what fell out of it).

    SLO attainment is judged from what the scheduler sees: its own submit and the request's last
    Finished record. TTFT is known only where a prefill worker's `prefill_done` came first (P/D; it
    is sent once the KV is shipped, so this TTFT is a transfer late: a lower bound of attainment);
    otherwise a request counts as within its SLOs when it ended within TTFT SLO + (tokens - 1) x TPOT
    SLO, a bound that a fast decode can meet after a late first token (an upper bound of attainment).
    `slos`: (TTFT, TPOT) seconds per model (engine time); `time_scale`: engine seconds per wall second
    (a sim mesh's `mesh.time_scale`), so that wall-clock latencies compare with the SLOs."""

    def __init__(self, window_s: float, slos: Mapping[str, tuple[float, float]] | None = None,
                 time_scale: float = 1.0) -> None:
        if window_s <= 0 or time_scale <= 0:
            raise ValueError("window_s and time_scale must be > 0")
        self.window_s = window_s
        self.slos = dict(slos or {})
        self.time_scale = time_scale
        self._arrivals: deque[_Arrival] = deque()
        self._finishes: deque[tuple[float, str, int, bool | None]] = deque()  # ts, model, tokens, within SLO
        self._open: dict[str, tuple[str, float, float | None]] = {}  # request id -> (model, submitted, first token)
        self._refusals: deque[tuple[float, str]] = deque()  # ts, model

    def submitted(self, request_id: str, model: str, now: float, prompt_tokens: int, max_tokens: int,
                  cached_tokens: int = 0) -> None:
        self._arrivals.append(_Arrival(now, model, prompt_tokens, max_tokens, min(cached_tokens, prompt_tokens)))
        self._open[request_id] = (model, now, None)

    def refused(self, model: str, now: float, prompt_tokens: int, max_tokens: int) -> None:
        """A request turned away (admission, no capacity, its model moving): demand all the same (a planner
        that saw only what was admitted would never add capacity), and an SLO miss."""
        self._arrivals.append(_Arrival(now, model, prompt_tokens, max_tokens, 0))
        self._refusals.append((now, model))

    def first_token(self, request_id: str, now: float) -> None:
        """The request's first token is out (a P/D prefill finished): its TTFT is known."""
        got = self._open.get(request_id)
        if got is not None and got[2] is None:
            self._open[request_id] = (got[0], got[1], now)

    def finished(self, request_id: str, now: float, completion_tokens: int, reason: str = "stop") -> bool | None:
        """A request ended (its last worker let go of it); unknown ids (placed before this window began
        or by another scheduler instance) are ignored. An `abort` or `error` may go on elsewhere (a
        migration, a retry under the same id): the request stays open, and a client's cancel is
        forgotten with the stale ones. Returns whether it met its SLOs (None: not judged)."""
        if reason in ("abort", "error"):
            return None
        got = self._open.pop(request_id, None)
        if got is None:
            return None
        met = self._within_slo(got, now, completion_tokens)
        self._finishes.append((now, got[0], completion_tokens, met))
        return met

    def _within_slo(self, req: tuple[str, float, float | None], now: float, tokens: int) -> bool | None:
        slo = self.slos.get(req[0])
        if slo is None:
            return None
        ttft_slo, tpot_slo = slo
        k = self.time_scale
        e2e = (now - req[1]) * k
        if req[2] is None:
            return e2e <= ttft_slo + max(tokens - 1, 0) * tpot_slo
        ttft = (req[2] - req[1]) * k
        return ttft <= ttft_slo and (tokens <= 1 or (e2e - ttft) / (tokens - 1) <= tpot_slo)

    def _forget(self, now: float) -> None:
        start = now - self.window_s
        while self._arrivals and self._arrivals[0].ts < start:
            self._arrivals.popleft()
        while self._finishes and self._finishes[0][0] < start:
            self._finishes.popleft()
        while self._refusals and self._refusals[0][0] < start:
            self._refusals.popleft()
        stale = now - FORGET_AFTER_WINDOWS * self.window_s
        if self._open and next(iter(self._open.values()))[1] < stale:  # insertion order = submit order
            self._open = {k: v for k, v in self._open.items() if v[1] >= stale}

    def report(self, now: float) -> list[ModelDemandStats]:
        self._forget(now)
        out: list[ModelDemandStats] = []
        for model in sorted({a.model for a in self._arrivals} | {f[1] for f in self._finishes}):
            arr = [a for a in self._arrivals if a.model == model]
            fin = [f for f in self._finishes if f[1] == model]
            prompt = sum(a.prompt for a in arr)
            judged = [f[3] for f in fin if f[3] is not None] + [False for r in self._refusals if r[1] == model]
            out.append(ModelDemandStats(
                model=model, requests=len(arr), rate=len(arr) / self.window_s,
                prompt_mean=prompt / len(arr) if arr else 0.0,
                output_mean=sum(f[2] for f in fin) / len(fin) if fin else 0.0,
                max_tokens_mean=sum(a.max_tokens for a in arr) / len(arr) if arr else 0.0,
                prefix_hit=sum(a.cached for a in arr) / prompt if prompt else 0.0,
                slo_attainment=sum(judged) / len(judged) if judged else None))
        return out


def server_id(worker_id: str) -> str:
    """The planner names the servers of a group `<group>-<i>`; a live group is one worker (i = 0)."""
    return f"{worker_id}-0"


def fleet(workers: Iterable[WorkerStatus], cfg: ClusterConfig, model: str) -> list[ServerGroup]:
    """The live workers of `model` (not those leaving or moving), one planner group each, as they run now."""
    out = []
    for w in sorted(workers, key=lambda w: w.worker_id):
        if w.model != model or w.draining or w.moving_to:
            continue
        try:
            g = cfg.group_of(w.worker_id)
        except KeyError:  # a worker of another cluster file: the planner cannot price what it does not know
            continue
        out.append(ServerGroup(name=w.worker_id, accelerator=w.accelerator, devices=w.devices, count=1, model=model,
                               role=w.role, parallel=w.parallel, max_batch=g.max_batch, step_tokens=g.step_tokens,
                               layouts=g.layouts()))
    return out


def demand(stats: ModelDemandStats, cfg: ClusterConfig) -> ModelDemand | None:
    """The planner's demand from the scheduler's window (None: no traffic to plan for)."""
    if stats.requests == 0 or stats.rate <= 0:
        return None
    try:
        m = cfg.model(stats.model)
    except KeyError:  # a model this cluster file does not know: nothing to plan with
        return None
    ttft, tpot = cfg.slo(stats.model)
    # the window counts arrivals per wall second; the planner prices engine seconds (a sim mesh at
    # time_scale k runs k engine seconds per wall second)
    return ModelDemand(name=m.name, spec=m.spec, rate=stats.rate / cfg.mesh.time_scale, input_mean=max(stats.prompt_mean, 1.0),
                       output_mean=max(stats.output_mean or stats.max_tokens_mean, 1.0), prefix_hit=stats.prefix_hit,
                       ttft_slo_s=ttft, tpot_slo_s=tpot, priority=m.priority)


def role_moves(p: Plan) -> list[tuple[str, Role, Move]]:
    """(worker id, new role, move) for each role switch of the plan. A layout change on one device (tp, ep
    and dp are the same there) is a role switch too; other reloads are model switches
    (hetmesh.planner.commands), stops are not made live."""
    new = {a.server: a for a in p.assignments}
    out = []
    for mv in p.moves:
        a = new.get(mv.server)
        if a is None or not mv.server.endswith("-0"):
            continue
        model, role = [*mv.before.split("/"), "", ""][:2]
        same_layout = mv.change == "role" or (mv.change == "reload" and a.devices == 1)
        if same_layout and a.model == model and a.role.value != role:
            out.append((mv.server[:-2], a.role, Move(mv.server, "role", mv.before, mv.after, mv.seconds)))
    return out


def to_send(moves: Sequence[tuple[str, Role, Move]], fleet_size: int, moving_now: int,
            max_moving_share: float, moved_at: Mapping[str, float] | None = None, now: float = 0.0,
            settle_s: float = 0.0) -> list[tuple[str, Role, Move]]:
    """The moves to start now: at most `max_moving_share` of the fleet moving at once (at least one worker),
    counting those still moving; the shortest first (the fleet is back at strength soonest). A worker this
    planner moved less than `settle_s` ago (`moved_at`: worker -> when) stays: its move was priced to pay
    within the horizon, and undoing it sooner on a noisy window makes the fleet flap."""
    moved_at = moved_at or {}
    free = [m for m in moves if now - moved_at.get(m[0], -math.inf) >= settle_s]
    cap = max(1, math.floor(max_moving_share * fleet_size)) - moving_now
    return sorted(free, key=lambda m: (m[2].seconds, m[0]))[:max(cap, 0)]


def plan_models(stats: Sequence[ModelDemandStats], workers: Sequence[WorkerStatus], cfg: ClusterConfig,
                planner: Callable[[list[ServerGroup], list[ModelDemand]], Plan]) -> dict[str, Plan]:
    """One plan per model with traffic, over that model's own workers (roles move, models stay)."""
    out = {}
    for s in stats:
        d = demand(s, cfg)
        groups = fleet(workers, cfg, s.model)
        if d is not None and groups:
            out[s.model] = planner(groups, [d])
    return out


def merge(reports: Iterable[Sequence[ModelDemandStats]]) -> list[ModelDemandStats]:
    """Several scheduler replicas' windows (each placed its own share of the requests) as one demand:
    counts and rates add up, means are weighted by the requests behind them."""
    by: dict[str, list[ModelDemandStats]] = {}
    for rep in reports:
        for s in rep:
            by.setdefault(s.model, []).append(s)
    out = []
    for model, ss in sorted(by.items()):
        n = sum(s.requests for s in ss)

        def mean(f: Callable[[ModelDemandStats], float], ss: list[ModelDemandStats] = ss, n: int = n) -> float:
            return sum(f(s) * s.requests for s in ss) / n if n else 0.0

        slo = [s for s in ss if s.slo_attainment is not None]
        out.append(ModelDemandStats(
            model=model, requests=n, rate=sum(s.rate for s in ss), prompt_mean=mean(lambda s: s.prompt_mean),
            output_mean=mean(lambda s: s.output_mean), max_tokens_mean=mean(lambda s: s.max_tokens_mean),
            # prefix share of prompt tokens: weighted by each replica's prompt tokens
            prefix_hit=(sum(s.prefix_hit * s.prompt_mean * s.requests for s in ss)
                        / max(sum(s.prompt_mean * s.requests for s in ss), 1e-9)),
            slo_attainment=(sum(s.slo_attainment * s.requests for s in slo) / max(sum(s.requests for s in slo), 1)
                            if slo else None)))  # type: ignore[operator]
    return out


def forecast(history: Sequence[Sequence[ModelDemandStats]], method: str) -> list[ModelDemandStats]:
    """Each model's demand one planning round on, from the rounds' merged reports (oldest first), by
    `hetmesh.planner.forecast`'s `method` (`last`: the latest report as it is; `trend`: the line through
    the last two rounds). A model missing from a round had no arrivals in it. Rates stay >= 0, lengths
    >= 1 (output: >= 0, none finished), prefix shares in [0, 1]."""
    if not history:
        return []
    if method == "last":
        return list(history[-1])
    out = []
    for s in history[-1]:
        seen = [next((x for x in rep if x.model == s.model), None) for rep in history]
        rows = [x if x is not None else msgspec.structs.replace(s, requests=0, rate=0.0) for x in seen]

        def f(name: str, rows: list[ModelDemandStats] = rows) -> float:
            return forecast_value([getattr(x, name) for x in rows], method)

        out.append(msgspec.structs.replace(
            s, rate=max(f("rate"), 0.0), prompt_mean=max(f("prompt_mean"), 1.0), output_mean=max(f("output_mean"), 0.0),
            max_tokens_mean=max(f("max_tokens_mean"), 1.0), prefix_hit=min(max(f("prefix_hit"), 0.0), 1.0)))
    return out
