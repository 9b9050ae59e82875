"""The live view of the cluster, as the placement core sees it.

`ClusterState` folds heartbeats and the scheduler's own assignments into `WorkerView`s.
Between two heartbeats a worker's reported load is stale, so work assigned since its last
heartbeat is added on top (optimistic accounting), which keeps `least_loaded` from sending
a burst of requests to the one worker that looked idle.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from msgspec import Struct, field

from hetmesh.protocol import Booking, Heartbeat, Role


class WorkerView(Struct, frozen=True, kw_only=True):
    worker_id: str
    model: str
    accelerator: str
    vendor: str
    devices: int
    role: Role
    queue_depth: int  # waiting requests, including ones assigned since the last heartbeat
    running: int
    max_batch: int
    kv_blocks_total: int
    kv_blocks_used: int
    block_size: int
    work_subject: str = ""
    parallel: str = "tp"  # tp | ep | dp over the devices: the cost model prices each differently
    step_tokens: int = 8192  # the engine's step budget (prefill chunk size)

    @property
    def load(self) -> int:
        return self.queue_depth + self.running

    def serves(self, role: Role) -> bool:
        return self.role == Role.BOTH or self.role == role


class RequestInfo(Struct, frozen=True, kw_only=True):
    request_id: str
    model: str
    prompt_len: int
    max_tokens: int
    # worker_id -> leading prompt blocks already in that worker's cache (from the prefix index)
    cached_blocks: Mapping[str, int] = field(default_factory=dict)
    block_size: int = 16
    exclude: frozenset[str] = frozenset()
    arrival: float = 0.0
    waited_s: float = 0.0  # held by admission since its submit this long: its TTFT clock runs from the submit
    # The share of its TTFT and TPOT SLOs its placement must fit within: below 1 where flow control keeps room
    # for others' next arrivals (hetmesh.placement.flow.reserved)
    slo_share: float = 1.0

    def cached_tokens(self, worker_id: str) -> int:
        return min(self.cached_blocks.get(worker_id, 0) * self.block_size, max(self.prompt_len - 1, 0))


class Decision(Struct, frozen=True, kw_only=True):
    mode: str  # "aggregated" | "disaggregated"
    decode_worker: str
    prefill_worker: str | None = None
    expected_cached_tokens: int = 0
    reason: str = ""
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    retry_after_s: float | None = None  # a refusal's: how long until admission would let it in (before any floor)
    # A refusal the scheduler may hold instead: place it again after this many seconds (its TTFT SLO still in
    # reach then); None: answer the refusal now.
    hold_s: float | None = None
    # What the cost policy booked for it, for the other scheduler replicas to book too (CostPolicy.booked)
    booking: Booking | None = None
    # Every placement the policy weighed: (prefill worker, decode worker, ttft s, tpot s, e2e s); for traces.
    candidates: tuple[tuple[str, str, float, float, float], ...] = ()

    @property
    def workers(self) -> tuple[str, ...]:
        return (self.decode_worker,) if self.prefill_worker is None else (self.prefill_worker, self.decode_worker)


class _Entry(Struct):
    hb: Heartbeat
    seen: float
    assigned_since: int = 0  # placed on it after hb was sent
    finished_since: int = 0  # left it after hb was sent
    progress_at: float = 0.0  # when its engine was last seen working (counters moved) or idle (nothing running)
    wedged: bool = False


class _Counters(Protocol):
    tokens_generated: int
    prompt_tokens_computed: int
    prompt_tokens_cached: int
    aborted: int


RETIRED_KEPT = 8  # per worker, the runs of its process (Heartbeat.instance) replaced by a newer one, remembered


class _Past(Struct):
    """What a worker's earlier heartbeats said, to tell a late one from a new one."""

    retired: list[str] = field(default_factory=list)  # its runs since replaced by a newer one, newest last
    lost: tuple[str, int] | None = None  # counted lost (silent): the (instance, seq) of its last heartbeat


def stale(last: tuple[str, int], hb: Heartbeat) -> bool:
    """`hb` was sent before the heartbeat `last` ((instance, seq)) of the same run: both numbered."""
    return bool(hb.instance) and hb.instance == last[0] and 0 < hb.seq <= last[1]


def progress(c: _Counters) -> tuple[int, int, int, int]:
    """What an engine that works moves every step (a heartbeat's or the engine's own stats): tokens out, prompt
    tokens in (computed or cached), aborts. Busy and unchanged for long: wedged."""
    return c.tokens_generated, c.prompt_tokens_computed, c.prompt_tokens_cached, c.aborted


class ClusterState:
    """Workers known from heartbeats; `expire(now)` removes the silent ones and returns them, `wedged(now)`
    marks the stuck ones (heartbeats on, engine still) and returns them."""

    def __init__(self, heartbeat_timeout_s: float, wedge_timeout_s: float = 0.0) -> None:
        self.timeout_s = heartbeat_timeout_s
        self.wedge_timeout_s = wedge_timeout_s
        self._workers: dict[str, _Entry] = {}
        # The placement views, kept between placements: a booking or a heartbeat rebuilds only its worker's view
        # (placing costs O(changed workers), not O(fleet)); a worker joining, leaving or wedged rebuilds all.
        self._views: list[WorkerView] | None = None
        self._at: dict[str, int] = {}  # worker -> its index in _views
        self._dirty: set[str] = set()
        self._past: dict[str, _Past] = {}

    def observe(self, hb: Heartbeat, now: float) -> str:
        """Fold a heartbeat in: "joined" for a worker not known, "rejoined" for one counted lost that is back
        with the same run of its process (a partition healed: what it held was failed over meanwhile),
        "restarted" for a known one whose heartbeat names another run of its process (`Heartbeat.instance`: it
        came back faster than the heartbeat timeout and holds nothing the last run held), else "".
        "stale": a heartbeat older than one already folded in (`Heartbeat.seq`), or from a run since replaced
        by a newer one; it is dropped, changing nothing (folded in, it would put the newer view back by a
        beat, or fail over the new run's requests as if it had restarted)."""
        old = self._workers.get(hb.worker_id)
        past = self._past.get(hb.worker_id)
        if past is not None and (hb.instance in past.retired or (past.lost is not None and stale(past.lost, hb))):
            return "stale"
        if old is not None and stale((old.hb.instance, old.hb.seq), hb):
            return "stale"
        e = self._workers[hb.worker_id] = _Entry(hb, now, progress_at=now)
        if old is None:
            self._views = None
            back = past is not None and past.lost is not None and past.lost[0] == hb.instance != ""
            if past is not None:
                past.lost = None
            return "rejoined" if back else "joined"
        self._changed(hb.worker_id)
        if old.hb.instance and hb.instance and old.hb.instance != hb.instance:
            seen = "restarted"
            retired = self._past.setdefault(hb.worker_id, _Past()).retired
            retired.append(old.hb.instance)
            del retired[:-RETIRED_KEPT]
        else:
            seen = ""
            if hb.running > 0 and progress(hb) == progress(old.hb):  # busy and still: the clock runs on
                e.progress_at, e.wedged = old.progress_at, old.wedged
        if old.wedged != e.wedged:  # back in the placement views
            self._views = None
        return seen

    def wedged(self, now: float) -> list[str]:
        """Workers newly found wedged: running requests, yet no token in or out for wedge_timeout_s while their
        heartbeats go on (an engine hung under a live heartbeat loop). They leave the placement view until their
        engine moves again or their process restarts; the caller treats their requests as lost. Off at 0."""
        if self.wedge_timeout_s <= 0:
            return []
        out = []
        for w, e in self._workers.items():
            if not e.wedged and e.hb.running > 0 and now - e.progress_at > self.wedge_timeout_s:
                e.wedged = True
                out.append(w)
        if out:
            self._views = None
        return out

    def is_wedged(self, worker_id: str) -> bool:
        e = self._workers.get(worker_id)
        return e is not None and e.wedged

    def assigned(self, decision: Decision) -> None:
        for w in decision.workers:
            e = self._workers.get(w)
            if e is not None:
                e.assigned_since += 1
                self._changed(w)

    def withdrawn(self, decision: Decision) -> None:
        """A placement taken back (hetmesh.placement.withdrawal): it leaves its workers' counts, as placed since
        their last heartbeats or, where a heartbeat came after it, as if it had finished."""
        for w in decision.workers:
            e = self._workers.get(w)
            if e is not None:
                if e.assigned_since > 0:
                    e.assigned_since -= 1
                else:
                    e.finished_since += 1
                self._changed(w)

    def finished(self, worker_id: str, ts: float) -> None:
        """A request left the worker at `ts` (worker clock): it stops counting before the next heartbeat,
        so a closed loop's next request is not steered away from the worker that just freed a slot.
        Records older than the heartbeat in hand are already in its counts (records travel batched)."""
        e = self._workers.get(worker_id)
        if e is not None and ts > e.hb.ts:
            e.finished_since += 1
            self._changed(worker_id)

    def remove(self, worker_id: str) -> bool:
        self._views = None
        return self._workers.pop(worker_id, None) is not None

    def touch_all(self, seen: float) -> None:
        """Count every worker as heard from at `seen`: after the scheduler's own bus outage, the heartbeats
        it missed say nothing about the workers."""
        for e in self._workers.values():
            e.seen = max(e.seen, seen)
            e.progress_at = max(e.progress_at, seen)

    def paused(self, seconds: float, now: float) -> None:
        """The scheduler's own process did not run for `seconds` up to `now` (`hetmesh.beats.overslept`): the
        heartbeats sent meanwhile still wait unread, so that time is no worker's silence (nor an engine's
        stillness)."""
        for e in self._workers.values():
            e.seen = min(e.seen + seconds, now)
            e.progress_at = min(e.progress_at + seconds, now)

    def expire(self, now: float) -> list[str]:
        """The workers silent past the heartbeat timeout, removed; each one's last heartbeat is remembered, so
        that one sent before it and arriving late does not bring the worker back."""
        dead = [w for w, e in self._workers.items() if now - e.seen > self.timeout_s]
        for w in dead:
            hb = self._workers[w].hb
            self._past.setdefault(w, _Past()).lost = (hb.instance, hb.seq)
            self.remove(w)
        return dead

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def __len__(self) -> int:
        return len(self._workers)

    def worker_ids(self) -> Iterable[str]:
        return self._workers.keys()

    def heartbeat(self, worker_id: str) -> Heartbeat | None:
        e = self._workers.get(worker_id)
        return None if e is None else e.hb

    def heartbeats(self) -> list[Heartbeat]:
        return [e.hb for e in self._workers.values()]

    def _changed(self, worker_id: str) -> None:
        if self._views is not None:
            self._dirty.add(worker_id)

    def views(self) -> list[WorkerView]:
        """The workers placement may use (not wedged). A list handed out is never changed afterwards."""
        if self._views is None:
            live = [(w, e) for w, e in self._workers.items() if not e.wedged]
            self._views = [self._view(e) for _, e in live]
            self._at = {w: i for i, (w, _) in enumerate(live)}
            self._dirty.clear()
        elif self._dirty:
            views = list(self._views)
            for w in self._dirty:
                i, e = self._at.get(w), self._workers.get(w)
                if i is not None and e is not None:
                    views[i] = self._view(e)
            self._views = views
            self._dirty.clear()
        return self._views

    def view(self, worker_id: str) -> WorkerView | None:
        e = self._workers.get(worker_id)
        return None if e is None else self._view(e)

    def every_view(self) -> list[WorkerView]:
        """Every worker known, wedged ones too (for status)."""
        return [self._view(e) for e in self._workers.values()]

    @staticmethod
    def _view(e: _Entry) -> WorkerView:
        # Finished requests come off the running batch first; any left over were assigned (and
        # finished) since the heartbeat.
        running = max(e.hb.running - e.finished_since, 0)
        leftover = max(e.finished_since - e.hb.running, 0)
        return WorkerView(
            worker_id=e.hb.worker_id,
            model=e.hb.model,
            accelerator=e.hb.accelerator,
            vendor=e.hb.vendor,
            devices=e.hb.devices,
            role=e.hb.role,
            queue_depth=max(e.hb.queue_depth + e.assigned_since - leftover, 0),
            running=running,
            max_batch=e.hb.max_batch,
            kv_blocks_total=e.hb.kv_blocks_total,
            kv_blocks_used=e.hb.kv_blocks_used,
            block_size=e.hb.block_size,
            work_subject=e.hb.work_subject,
            parallel=e.hb.parallel,
            step_tokens=e.hb.step_tokens,
        )


def moving(model: str, heartbeats: Iterable[Heartbeat]) -> list[Heartbeat]:
    """The workers of `model`, or on their way to it, that are switching role or model (the planner's
    RoleSwitch / ModelSwitch): while no other worker can take a request of `model`, it is asked to retry."""
    return [hb for hb in heartbeats if hb.moving_to and model in (hb.model, hb.moving_model)]


def back_in_s(model: str, busy: Iterable[Heartbeat], floor_s: float, cap_s: float = 60.0) -> float:
    """Retry-After for a request of `model` while `busy` (moving(model, ...)) move: the soonest a worker
    staying with or coming to the model is expected back (its heartbeat's ready_in_s), within
    [floor_s, cap_s]; floor_s when all of them are leaving the model (nobody knows when one comes)."""
    back = [hb.ready_in_s for hb in busy if hb.moving_model in ("", model)]
    return min(max(min(back), floor_s), cap_s) if back else floor_s


def exclusion(model: str, views: Iterable[WorkerView], avoid: Iterable[str], draining: Iterable[str]) -> frozenset[str]:
    """The workers a placement must not pick: the draining ones, and those a retry avoids (`avoid`: where its
    earlier attempts failed or were lost) unless that leaves no live worker of `model` at all. A worker lost to a
    stall of its process or of the bus comes back with its heartbeats: sole worker of its model, it serves the
    retry rather than a 503."""
    out = frozenset(draining)
    avoided = frozenset(avoid)
    if avoided and any(v.model == model and v.worker_id not in out and v.worker_id not in avoided for v in views):
        return out | avoided
    return out


def pool_full(model: str, workers: Iterable[WorkerView], queue_factor: float) -> bool:
    """Admission: the model's pool holds as many requests as it may queue (each worker: its batch plus
    `queue_factor` batches waiting). Past that, queueing more only grows latency and memory without bound;
    the caller refuses instead. False when no worker serves the model (that is a different error)."""
    load = capacity = 0.0
    for w in workers:
        if w.model == model:
            load += w.load
            capacity += w.max_batch * (1.0 + queue_factor)
    return capacity > 0 and load >= capacity
