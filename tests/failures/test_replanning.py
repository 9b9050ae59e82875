"""Live re-planning with real processes: a worker switches role, or model, under load and no request is
lost or changed; a request for a model whose last worker is switching away gets 503 + Retry-After; of two
planners started only the lease holder acts, and the other takes over when it dies; garbage on the
planner's subjects is logged and ignored; an acting planner (scope fleet) moves a worker to a model left
without one.

The mesh is conftest.py's (its `[planner]` section: a round a second, a 4 s lease; a model switch's load
takes about a second). Each test leaves it whole for the next: every worker back in its cluster file's
model and role.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import nats
import pytest
from rich.console import Console

from hetmesh import subjects
from hetmesh.bus import decode, encode
from hetmesh.cli.__main__ import main as cli
from hetmesh.cli.__main__ import table
from hetmesh.launcher import Mesh
from hetmesh.protocol import (
    DemandReport,
    Heartbeat,
    ModelDemandStats,
    ModelSwitch,
    PlanProposal,
    Role,
    RoleSwitch,
    SchedulerStatus,
    WorkerCommand,
    WorkerStatus,
)

from ..e2e.conftest import EventLog
from .conftest import Sse, expected_text, stream


async def status(nc: Any) -> SchedulerStatus:
    return decode((await nc.request(subjects.SCHED_STATUS, b"", timeout=5)).data, SchedulerStatus)


async def switch(nc: Any, worker_id: str, role: Role) -> None:
    await nc.publish(subjects.worker_command(worker_id), encode(RoleSwitch(worker_id=worker_id, role=role,
                                                                          planner="test")))


async def move(nc: Any, worker_id: str, model: str, role: Role, parallel: str = "") -> None:
    await nc.publish(subjects.worker_command(worker_id), encode(ModelSwitch(
        worker_id=worker_id, model=model, role=role, planner="test", parallel=parallel)))


async def settled(nc: Any, ok: Callable[[dict[str, WorkerStatus]], bool], timeout_s: float) -> SchedulerStatus:
    async with asyncio.timeout(timeout_s):
        while True:
            st = await status(nc)
            if ok({w.worker_id: w for w in st.details}):
                return st
            await asyncio.sleep(0.1)


async def layout_settles(nc: Any, want: dict[str, tuple[str, Role]], timeout_s: float = 30) -> SchedulerStatus:
    """Wait until every worker in `want` heartbeats that model and role and none is moving."""
    return await settled(nc, lambda got: all(w in got and (got[w].model, got[w].role) == mr and not got[w].moving_to
                                             for w, mr in want.items()), timeout_s)


async def roles_settle(nc: Any, want: dict[str, Role], timeout_s: float = 30) -> SchedulerStatus:
    """Wait until every worker in `want` heartbeats that role and none is moving."""
    return await settled(nc, lambda got: all(w in got and got[w].role == r and not got[w].moving_to
                                             for w, r in want.items()), timeout_s)


@pytest.fixture
async def bus(mesh: Mesh) -> AsyncIterator[Any]:
    nc = await nats.connect(mesh.nats_url)
    yield nc
    # back to the cluster file's layout, whatever a test or a planner did
    want = {wid: (g.model, g.role) for g in mesh.cfg.workers for wid in g.worker_ids()}
    layout = {wid: g.parallel for g in mesh.cfg.workers for wid in g.worker_ids()}
    st = await settled(nc, lambda got: not any(w.moving_to for w in got.values()), 60)  # moves under way end first
    for w in st.details:
        if (w.model, w.role, w.parallel) != (*want[w.worker_id], layout[w.worker_id]):
            await move(nc, w.worker_id, *want[w.worker_id], layout[w.worker_id])
    await settled(nc, lambda got: all(w in got and (got[w].model, got[w].role, got[w].parallel) == (*mr, layout[w])
                                      and not got[w].moving_to for w, mr in want.items()), 60)
    await nc.close()


def check(got: Sse, prompt: str, n: int) -> None:
    assert not got.errors and got.done, got.errors
    assert got.text == expected_text(prompt, n)
    assert got.chunks[-1]["usage"]["completion_tokens"] == n


async def test_role_flip_under_load_loses_no_request(mesh: Mesh, events: EventLog, bus: Any) -> None:
    """h100-0 goes both -> prefill -> both while streams run on the aggregated model: every stream ends
    with exactly the undisturbed text, the switch drained the old role's work, and the heartbeats (what
    the scheduler's view and `hetmesh status` show) said so."""
    n = 16
    prompts = [f"re-plan {i} " + "x" * (40 * i) for i in range(12)]
    since = time.time()
    seen_moving: list[str] = []

    async def on_heartbeat(m: Any) -> None:  # what the scheduler's view (and `hetmesh status`) is made of
        hb = decode(m.data, Heartbeat)
        if hb.moving_to:
            seen_moving.append(f"{hb.worker_id}:{hb.role.value}->{hb.moving_to}")

    beats = await bus.subscribe(subjects.heartbeat("h100-0"), cb=on_heartbeat)

    async def flips() -> None:
        await asyncio.sleep(0.5)  # the first wave is decoding
        await switch(bus, "h100-0", Role.PREFILL)
        await roles_settle(bus, {"h100-0": Role.PREFILL})
        await asyncio.sleep(0.5)
        await switch(bus, "h100-0", Role.BOTH)
        await roles_settle(bus, {"h100-0": Role.BOTH})

    async def wave(ps: list[str], delay: float) -> list[Sse]:
        await asyncio.sleep(delay)
        return list(await asyncio.gather(*(stream(mesh, "agg", p, n) for p in ps)))

    try:
        results = await asyncio.gather(wave(prompts[:4], 0), wave(prompts[4:8], 0.6), wave(prompts[8:], 2.0), flips())
    finally:
        await beats.unsubscribe()
    for got, p in zip([s for w in results[:3] for s in w], prompts, strict=True):
        check(got, p, n)
    mine = [e for e in events.events if e.service == "worker" and e.detail.get("worker_id") == "h100-0"
            and e.ts >= since]
    switched = [e for e in mine if e.kind == "role_switched"]
    assert [(e.detail["from_role"], e.detail["to_role"]) for e in switched] == [("both", "prefill"),
                                                                                  ("prefill", "both")]
    assert "h100-0:both->prefill" in seen_moving and "h100-0:prefill->both" in seen_moving
    # While it moved it took no work; as a prefill worker it took prefills only.
    start, mid = [e.ts for e in mine if e.kind == "role_switching"]
    end_first = switched[0].ts
    accepted = [e for e in mine if e.kind == "accepted"]
    assert not [e for e in accepted if start <= e.ts <= end_first or mid <= e.ts <= switched[1].ts]
    assert all(e.detail["phase"] == "prefill" for e in accepted if end_first < e.ts < mid)
    # The scheduler's next demand report judged the finished requests against the model's SLOs.
    sub = await bus.subscribe(subjects.DEMAND)
    try:
        report = decode((await sub.next_msg(timeout=10)).data, DemandReport)
    finally:
        await sub.unsubscribe()
    agg = next(m for m in report.models if m.model == "agg")
    assert agg.slo_attainment is not None and 0.0 <= agg.slo_attainment <= 1.0, agg


async def test_model_switch_under_load(mesh: Mesh, events: EventLog, bus: Any) -> None:
    """h100-0 moves agg -> pd while streams run on it: each ends with exactly the undisturbed text (finished
    within the drain, or handed over to h100-1, agg's other worker). Then h100-1, agg's last worker, moves
    too: a request for agg meanwhile gets an OpenAI-shaped 503 with Retry-After (never a hang), and `hetmesh
    status` shows the move. Then h100-0 moves back (a reload again) and serves agg, the model it took on."""
    n = 16
    since = time.time()
    prompts = [f"model move {i} " + "m" * (30 * i) for i in range(6)]
    started: set[int] = set()

    def first_chunk(i: int) -> Callable[[Sse], Any]:
        async def on(_s: Sse) -> bool:
            started.add(i)
            return True
        return on

    load = asyncio.gather(*(stream(mesh, "agg", p, n, first_chunk(i)) for i, p in enumerate(prompts)))
    try:
        await until(lambda: len(started) == len(prompts), 30)  # every stream is placed and decoding
        await move(bus, "h100-0", "pd", Role.BOTH)
        results = await load
    finally:
        if not load.done():
            load.cancel()
    for got, p in zip(results, prompts, strict=True):
        check(got, p, n)
    switching = next(e for e in events.events if e.kind == "model_switching" and e.ts >= since)
    assert any(e.kind == "accepted" and e.detail.get("worker_id") == "h100-0" and since <= e.ts < switching.ts
               for e in events.events)  # some of the streams ran on the worker that moved
    await layout_settles(bus, {"h100-0": ("pd", Role.BOTH)})

    await move(bus, "h100-1", "pd", Role.BOTH)  # agg's last worker
    moving = await settled(bus, lambda got: got["h100-1"].moving_model == "pd", 10)
    refused = await refused_while(mesh, bus, "agg", lambda w: w["h100-1"].moving_model == "pd")
    assert refused.status_code == 503 and float(refused.headers["retry-after"]) > 0
    err = refused.json()["error"]
    assert err["code"] == "model_moving" and "h100-1 is switching to pd/both" in err["message"], err
    # `hetmesh status` of the scheduler's view during the move: model and role, and that it is moving
    out = Console(width=200, record=True)
    out.print(table(moving))
    row = next(line for line in out.export_text().splitlines() if "h100-1" in line)
    assert "agg -> pd" in row and "both -> both" in row, row
    await layout_settles(bus, {"h100-1": ("pd", Role.BOTH)})
    async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as http:  # no worker at all: a 503 as before
        gone = await http.post("/v1/completions", json={"model": "agg", "prompt": "nobody", "max_tokens": 2})
    assert gone.status_code == 503 and gone.json()["error"]["code"] == "no_workers" and gone.headers["retry-after"]

    await move(bus, "h100-0", "agg", Role.BOTH)  # agg has no worker now; h100-0 brings it back
    await settled(bus, lambda got: got["h100-0"].moving_model == "agg", 10)
    coming = await refused_while(mesh, bus, "agg", lambda w: w["h100-0"].moving_model == "agg")
    assert coming.status_code == 503 and coming.json()["error"]["code"] == "model_moving"
    assert "h100-0 is switching to agg/both" in coming.json()["error"]["message"]
    await layout_settles(bus, {"h100-0": ("agg", Role.BOTH)})
    back = [f"served after the move {i}" for i in range(3)]
    for got, p in zip(await asyncio.gather(*(stream(mesh, "agg", p, 8) for p in back)), back, strict=True):
        check(got, p, 8)
    mine = [e for e in events.events if e.service == "worker" and e.ts >= since and e.kind == "model_switched"]
    assert [(e.detail["worker_id"], e.detail["from_model"], e.detail["to_model"]) for e in mine] == [
        ("h100-0", "agg", "pd"), ("h100-1", "agg", "pd"), ("h100-0", "pd", "agg")]
    assert all(float(e.detail["load_seconds"]) > 0 for e in mine)


async def test_layout_switch_reloads_in_the_new_layout(mesh: Mesh, events: EventLog, bus: Any) -> None:
    """A ModelSwitch with the worker's own model and another parallel layout reloads it in that layout (the
    planner sends one for a multi-device worker whose plan changes tp / ep / dp): its heartbeats say the new
    layout, the scheduler prices it so, and it serves on. A layout that is none of tp, ep, dp is refused."""
    since = time.time()
    await move(bus, "h100-0", "agg", Role.BOTH, "zz")
    refused = await until_event(events, "model_switch_refused", since)
    assert "parallel 'zz'" in str(refused.detail["reason"]) and refused.detail["worker_id"] == "h100-0"
    await move(bus, "h100-0", "agg", Role.BOTH, "dp")
    await settled(bus, lambda got: got["h100-0"].parallel == "dp" and not got["h100-0"].moving_to, 30)
    done = await until_event(events, "model_switched", since)
    assert (done.detail["from_parallel"], done.detail["to_parallel"], done.detail["to_model"]) == ("tp", "dp", "agg")
    prompts = [f"served in the new layout {i}" for i in range(4)]
    for got, p in zip(await asyncio.gather(*(stream(mesh, "agg", p, 8) for p in prompts)), prompts, strict=True):
        check(got, p, 8)


async def until_event(events: EventLog, kind: str, since: float, timeout_s: float = 20) -> Any:
    async with asyncio.timeout(timeout_s):
        while True:
            for e in events.events:
                if e.kind == kind and e.ts >= since:
                    return e
            await asyncio.sleep(0.05)


async def refused_while(mesh: Mesh, nc: Any, model: str, moving: Callable[[dict[str, WorkerStatus]], bool],
                        timeout_s: float = 20) -> httpx.Response:
    """Ask for `model` until a request is refused; every answer comes while the move is on."""
    body = {"model": model, "prompt": "while it moves", "max_tokens": 2, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=mesh.url, timeout=30) as http, asyncio.timeout(timeout_s):
        while True:
            r = await http.post("/v1/completions", json=body)
            if r.status_code != 200:
                return r
            assert moving({w.worker_id: w for w in (await status(nc)).details}), "the move ended, nothing refused"


async def until(pred: Callable[[], bool], timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            if pred():
                return
            await asyncio.sleep(0.1)


def log_tail(mesh: Mesh, name: str, lines: int = 40) -> str:
    path = mesh.services[name].log_path
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path else "(no log file)"


def planner(mesh: Mesh, name: str, *extra: str) -> None:
    mesh.add(name, [sys.executable, "-m", "hetmesh.planner_service", "--cluster", str(mesh.cluster_path), "--instance",
                    name, "--mode", "act", *extra])
    mesh.spawn(name)


async def test_two_planners_one_acts_and_garbage_does_not_kill_it(mesh: Mesh, bus: Any) -> None:
    proposals: list[PlanProposal] = []
    commands: list[WorkerCommand] = []

    async def on_plan(m: Any) -> None:
        proposals.append(decode(m.data, PlanProposal))

    async def on_command(m: Any) -> None:
        commands.append(decode(m.data, WorkerCommand))  # type: ignore[arg-type]

    await bus.subscribe(subjects.PLAN, cb=on_plan)
    await bus.subscribe(subjects.worker_command("*"), cb=on_command)
    # no planner has run on this mesh yet: nothing proposed -> a one-line error, exit 2
    assert await asyncio.to_thread(cli, ["plan", "--live", "--nats", mesh.nats_url]) == 2
    planner(mesh, "planner-a")
    planner(mesh, "planner-b")
    prompts = [f"plan load {i} " + "y" * (100 * i) for i in range(24)]

    async def paced(p: str, delay: float) -> tuple[Sse, str]:
        await asyncio.sleep(delay)
        return await stream(mesh, "pd", p, 8), p

    # demand for the planners to plan on; their role switches, if any, must lose none of it
    load = asyncio.gather(*(paced(p, 0.25 * i) for i, p in enumerate(prompts)))
    try:
        await until(lambda: len(proposals) >= 4 and any(p.proposed for p in proposals), 60)
        leaders = {p.planner for p in proposals}
        assert len(leaders) == 1, leaders  # only the lease holder plans and acts
        (leader,) = leaders
        assert {c.planner for c in commands} <= {leader}
        for got, p in await load:
            check(got, p, 8)

        # The leader dies without letting go: the other takes the lease once it ages out.
        mesh.kill(leader)
        other = "planner-b" if leader == "planner-a" else "planner-a"
        try:  # the lease ages out (4 s), the other takes it at its next try and plans: about 10 s here
            await until(lambda: any(p.planner == other for p in proposals), 60)
        except TimeoutError:
            raise AssertionError(f"{other} proposed nothing after {leader} died; its log ends:\n"
                                 + log_tail(mesh, other)) from None

        # Garbage on its subject: not JSON, the wrong shape, and a well-formed report of nonsense.
        await bus.publish(subjects.DEMAND, b"\xff\x00 not json")
        await bus.publish(subjects.DEMAND, b'{"instance": 5}')
        await bus.publish(subjects.DEMAND, encode(DemandReport(instance="x", window_s=-1, ts=0, models=[
            ModelDemandStats(model="no-such-model", requests=5, rate=1e9, prompt_mean=-3, output_mean=float("nan"),
                             max_tokens_mean=0, prefix_hit=7)])))
        await bus.flush()
        after = time.time()
        await until(lambda: any(p.planner == other and p.ts > after + 1.0 for p in proposals), 30)
        assert mesh.services[other].alive
    finally:
        if not load.done():
            load.cancel()
        for name in ("planner-a", "planner-b"):
            mesh.kill(name, signal.SIGTERM)
            del mesh.services[name]


async def test_planner_in_act_mode_switches_roles_back_into_service(mesh: Mesh, events: EventLog, bus: Any,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Both workers of the aggregated model made prefill-only (so it has no decode): the planner, acting on
    the demand the scheduler measured before, switches one back and is killed as the move starts; the
    worker ends the move in a consistent role, the model serves again, and `hetmesh plan --live` shows
    the dead planner's last proposal (the mesh keeps its layout)."""
    prompts = [f"demand {i} " + "z" * (50 * i) for i in range(6)]
    for got, p in zip(await asyncio.gather(*(stream(mesh, "agg", p, 8) for p in prompts)), prompts, strict=True):
        check(got, p, 8)
    for w in ("h100-0", "h100-1"):
        await switch(bus, w, Role.PREFILL)
    await roles_settle(bus, {"h100-0": Role.PREFILL, "h100-1": Role.PREFILL})
    since = time.time()
    planner(mesh, "planner-c")

    def by_planner(kind: str) -> list[Any]:
        return [e for e in events.events if e.kind == kind and e.ts > since and e.detail.get("planner") == "planner-c"
                and str(e.detail.get("worker_id", "")).startswith("h100")]

    try:
        await until(lambda: bool(by_planner("role_switching")), 60)
        mesh.kill("planner-c")  # SIGKILL as its move starts: the worker finishes the move on its own
        moved = by_planner("role_switching")[0].detail["worker_id"]
        await until(lambda: any(e.detail["worker_id"] == moved for e in by_planner("role_switched")), 30)
        st = await roles_settle(bus, {}, 10)
        assert not any(w.moving_to or w.draining for w in st.details)
        assert {w.role for w in st.details if w.model == "agg"} != {Role.PREFILL}
        got = await stream(mesh, "agg", "served again", 8)
        check(got, "served again", 8)
        assert await asyncio.to_thread(cli, ["plan", "--live", "--nats", mesh.nats_url]) == 0
        out = capsys.readouterr().out
        # the dead planner's last proposal: every worker, its role then and the proposed one, the switch sent
        assert "planner planner-c · act" in out and all(w in out for w in ("h100-0", "h100-1", "cpx-0", "vr200-1"))
        assert "agg/prefill" in out and "yes" in out
    finally:
        mesh.kill("planner-c", signal.SIGTERM)
        del mesh.services["planner-c"]


async def test_planner_moves_a_worker_to_a_model_left_without_one(mesh: Mesh, events: EventLog, bus: Any) -> None:
    """`planner.scope = "fleet"`: both of agg's workers were moved to pd by hand while the demand still asks
    for agg (a report on the scheduler's demand subject, beside the scheduler's own): the acting planner
    sends a ModelSwitch that brings a worker to agg, which then serves it again."""
    for w in ("h100-0", "h100-1"):
        await move(bus, w, "pd", Role.BOTH)
    await layout_settles(bus, {"h100-0": ("pd", Role.BOTH), "h100-1": ("pd", Role.BOTH)})
    since = time.time()
    report = DemandReport(instance="test-demand", window_s=20.0, ts=since, models=[
        ModelDemandStats(model="agg", requests=4, rate=0.2, prompt_mean=200, output_mean=16, max_tokens_mean=16,
                         prefix_hit=0.0),
        ModelDemandStats(model="pd", requests=2, rate=0.1, prompt_mean=200, output_mean=16, max_tokens_mean=16,
                         prefix_hit=0.0)])

    async def feed() -> None:
        while True:
            await bus.publish(subjects.DEMAND, encode(report))
            await asyncio.sleep(0.5)

    def to_agg() -> list[Any]:
        return [e for e in events.events if e.kind == "model_switched" and e.ts > since
                and e.detail.get("planner") == "planner-m" and e.detail.get("to_model") == "agg"]

    feeder = asyncio.create_task(feed())
    planner(mesh, "planner-m", "--scope", "fleet")
    try:
        await until(lambda: bool(to_agg()), 120)
        got = await stream(mesh, "agg", "back on agg", 8)
        check(got, "back on agg", 8)
        switched = to_agg()[0]
        assert switched.detail["from_model"] == "pd" and float(switched.detail["load_seconds"]) > 0
    finally:
        feeder.cancel()
        mesh.kill("planner-m", signal.SIGTERM)
        del mesh.services["planner-m"]
