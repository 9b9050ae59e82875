"""Live re-planning on the sim engine: the planner benchmark's time-varying cases replayed through the
real gateway, scheduler, planner and sim-engine workers (time-scaled), against the best static layout.

Per case (benchmarks/planner_timevarying.py `shift_case`, scaled down to fit this machine):
- the fleet becomes `--workers` one-device servers (the groups' proportions kept; a model whose weights
  fit no single device runs as a smaller one, SPEC_ON_ONE_DEVICE), and each window's rate per model is
  scaled by the small fleet's capacity over the original's (hetmesh.planner.capacity, all `both`): every
  window loads the small fleet as much as the original one;
- the trace: `--windows` windows of `--window-s` engine seconds, each a synthetic trace of that window's
  demand (hetmesh.planner.demand_trace), replayed open-loop at `--time-scale` (engine seconds per wall
  second), every prompt distinct, `ignore_eos`;
- static: the best single layout in hindsight, chosen by the simulator (each window's own plan, today's
  layout, the plan for the mean demand), run with the planner off;
- planner: the same starting layout with `[planner] mode = "act"` (scope "fleet" where the case moves
  demand between models: model switches; a case that needs them is "not run" where they are not there).

Live goodput: output tokens of the requests that met the SLOs (TTFT and mean TPOT, measured by the
client, in engine seconds) and whose streamed text is the sim engine's deterministic text, per engine
second of the trace. The simulator's figures for the same trace: the static layout per window, and the
layouts the live planner actually moved through (split at each switch), with the planner's switch-cost
accounting (a move takes its server out for its priced seconds: drain, + reload; the share of the
window's server-seconds lost comes off that window's goodput). Also the offline planner's own
re-planning of the same windows (from the last window's demand, as benchmarks/planner.py).
Target: live gain (planner / static) within 10% of the simulator's.

    .venv/bin/python benchmarks/live_replanning.py [--cases pd-shift,model-step] [--time-scale 4]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import random
import string
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
from rich.console import Console
from rich.table import Table

from hetmesh import config, protocol, subjects
from hetmesh.bus import decode, decode_events
from hetmesh.costmodel import server_model
from hetmesh.engines.sampling import expected_completion
from hetmesh.launcher import Mesh
from hetmesh.loadgen import SSEClient, cpu_seconds
from hetmesh.planner import Assignment, ModelDemand, ServerGroup, demand_trace, evaluate, plan
from hetmesh.planner.capacity import capacity
from hetmesh.planner.plan import current_layout, moves, score
from hetmesh.protocol import PlanProposal, Role, SamplingParams
from hetmesh.sim.report import write_json
from hetmesh.sim.traces import Trace, TraceRequest
from hetmesh.tokenizer import ByteTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_timevarying import CASES, regroup, shift_case

ROOT = Path(__file__).resolve().parents[1]
PATH = "/v1/completions"
TOK = ByteTokenizer()
# 70B weights (140 GB in bf16) fit no one device of these fleets; the 8B runs the same case on one.
SPEC_ON_ONE_DEVICE = {"llama-3.1-70b": "llama-3.1-8b"}
HUNG_S = 300.0  # wall seconds without the end of a stream: counted as hung (an error)
MAX_WIRE_BYTES = 65536  # the sim KV of an 8k prompt is ~1 GB: loopback carries a token of it
console = Console(width=150)


def model_switch_available() -> bool:
    """Workers take ModelSwitch commands and the planner plans across models (planner.scope = fleet)."""
    return hasattr(protocol, "ModelSwitch") and "scope" in config.PlannerConfig.__struct_fields__


# --- the case, scaled down -----------------------------------------------------------------------
@dataclass
class Case:
    name: str
    groups: list[ServerGroup]
    demand: list[list[ModelDemand]]  # per window
    window_s: float
    trace: list[TraceRequest]  # every window's requests, arrivals in engine seconds from the start
    rate_scale: list[dict[str, float]] = field(default_factory=list)  # per window: small fleet's rate / original's

    @property
    def models(self) -> list[str]:
        return [d.name for d in self.demand[0]]

    def window(self, i: int, t0: float | None = None, t1: float | None = None) -> Trace:
        lo = i * self.window_s if t0 is None else t0
        hi = (i + 1) * self.window_s if t1 is None else t1
        return Trace([r for r in self.trace if lo <= r.arrival < hi], name=f"{self.name}-{i}")


def fleet_capacity(groups: list[ServerGroup], d: ModelDemand) -> float:
    """Requests/s the fleet sustains on `d` with every server `both` (the planner's closed form)."""
    return sum(g.count * capacity(server_model(g.accelerator, d.spec, devices=g.devices, parallel=g.parallel),
                                  d, Role.BOTH, g.max_batch, g.step_tokens) for g in groups)


def scaled_case(name: str, windows: int, window_s: float, workers: int, load: float = 1.0) -> Case:
    groups, demand = shift_case(name, windows)
    n = sum(g.count for g in groups)
    small = [msgspec.structs.replace(g, devices=1, count=max(1, round(g.count * workers / n))) for g in groups]
    out, scale = [], []
    for ds in demand:
        row, ks = [], {}
        for d in ds:
            d1 = msgspec.structs.replace(d, spec=SPEC_ON_ONE_DEVICE.get(d.spec, d.spec))
            ks[d.name] = load * fleet_capacity(small, d1) / fleet_capacity(groups, d)
            row.append(d1.scaled(ks[d.name]))
        out.append(row)
        scale.append(ks)
    trace: list[TraceRequest] = []
    for i, ds in enumerate(out):
        tr = demand_trace(ds, window_s, seed=i, max_requests=10**6)
        trace += [TraceRequest(r.arrival + i * window_s, r.input_len, r.output_len, r.hash_ids, r.model)
                  for r in tr.requests if r.arrival < window_s]
    return Case(name, small, out, window_s, sorted(trace, key=lambda r: r.arrival), scale)


# --- the simulator's figures ---------------------------------------------------------------------
def good_tokens(lay: list[Assignment], c: Case, i: int, tr: Trace) -> float:
    """Simulated SLO-meeting output tokens (priority-weighted) of `tr`'s requests on `lay`."""
    if not tr.requests:
        return 0.0
    sm = evaluate(lay, c.demand[i], c.groups, tr)
    return score(sm, c.demand[i]) * sm["duration_s"] if sm else 0.0


def best_static(c: Case) -> tuple[str, list[Assignment], list[float]]:
    """The best single layout in hindsight (each window's own plan, today's layout, the mean-demand plan)
    that serves every model."""
    cands = {f"window-{i}": plan(c.groups, c.demand[i], trace=c.window(i), horizon_s=float("inf")).assignments
             for i in range(len(c.demand))}
    mean = [msgspec.structs.replace(m, rate=sum(w[j].rate for w in c.demand) / len(c.demand), peak_rate=0.0)
            for j, m in enumerate(c.demand[0])]
    cands["mean-demand"] = plan(c.groups, mean, check_duration_s=c.window_s, horizon_s=float("inf")).assignments
    cands["today"] = current_layout(c.groups)
    seen: dict[tuple, list[float]] = {}
    per: dict[str, list[float]] = {}
    for k, lay in cands.items():
        sig = tuple(sorted((a.server, a.model, str(a.role)) for a in lay))
        if sig not in seen:
            seen[sig] = [good_tokens(lay, c, i, c.window(i)) for i in range(len(c.demand))]
        per[k] = seen[sig]
    # Only layouts that keep a worker on every model, as the planner keeps them (hetmesh.planner.solve): a
    # model with no live worker is refused at the gateway's door (503 no_workers).
    pool = [k for k, lay in cands.items() if {a.model for a in lay} >= set(c.models)] or list(cands)
    name = max(pool, key=lambda k: sum(per[k]))
    return name, cands[name], per[name]


def priced(c: Case, before: list[Assignment], after: list[Assignment], i: int, storage: float) -> float:
    """The planner's price of going from `before` to `after` (server-seconds out of service)."""
    named = [a if a.server == f"{a.group}-0" else msgspec.structs.replace(a, server=f"{a.server}-0") for a in after]
    return sum(m.seconds for m in moves(regroup(c.groups, before), named, c.demand[i], storage))  # regroup's names


def with_debt(c: Case, tokens: list[float], out_s: list[float]) -> float:
    """Windows' good tokens less the share of their server-seconds moves took out (what does not fit in a
    window carries into the next): benchmarks/planner_timevarying.py's accounting."""
    n, debt, tot = sum(g.count for g in c.groups), 0.0, 0.0
    for tok, o in zip(tokens, out_s, strict=True):
        o += debt
        debt = max(o - c.window_s * n, 0.0)
        tot += tok * (1 - min(o / (c.window_s * n), 1.0))
    return tot


def sim_of_layouts(c: Case, start: list[Assignment], changes: list[tuple[float, str, str, Role]],
                   storage: float) -> dict[str, Any]:
    """The trace on the layouts the live planner moved through: `changes` = (engine s, server, model, role)
    as each switch completed; every window split at them, each piece simulated on the layout then in force."""
    lay, tokens, out_s = list(start), [], []
    pending = sorted(changes)
    for i in range(len(c.demand)):
        t, hi = i * c.window_s, (i + 1) * c.window_s
        tok = out = 0.0
        while True:
            nxt = pending[0][0] if pending and pending[0][0] < hi else hi
            tok += good_tokens(lay, c, i, c.window(i, t, nxt))
            if nxt >= hi:
                break
            _, server, model, role = pending.pop(0)
            new = [msgspec.structs.replace(a, model=model, role=role) if a.server == server else a for a in lay]
            out += priced(c, lay, new, i, storage)
            lay, t = new, nxt
        tokens.append(tok)
        out_s.append(out)
    return {"good_tokens": with_debt(c, tokens, out_s), "per_window": tokens, "switch_out_s": out_s}


def sim_replanned(c: Case, start: list[Assignment], storage: float) -> dict[str, Any]:
    """The offline planner's own re-planning of the windows: window i planned from window i-1's demand."""
    lay, tokens, out_s, moved = list(start), [], [], 0
    for i in range(len(c.demand)):
        cur = regroup(c.groups, lay)
        basis = c.demand[max(i - 1, 0)]
        p = plan(cur, basis, trace=c.window(max(i - 1, 0)), horizon_s=c.window_s, storage_bytes_per_s=storage)
        new = [msgspec.structs.replace(a, group=b.group, server=b.server)
               for a, b in zip(sorted(p.assignments, key=lambda a: a.server), sorted(lay, key=lambda a: a.server),
                               strict=True)]
        out_s.append(sum(m.seconds for m in p.moves))
        moved += len(p.moves)
        tokens.append(good_tokens(new, c, i, c.window(i)))
        lay = new
    return {"good_tokens": with_debt(c, tokens, out_s), "per_window": tokens, "moves": moved}


# --- the live mesh -------------------------------------------------------------------------------
SWITCH_EVENTS = {"role_switching", "role_switched", "model_switching", "model_switched", "model_switch_failed",
                 "role_switch_refused", "model_switch_refused"}


def worker_group(server: str) -> str:
    return server.replace("-", "")  # server cpx-1 runs as group cpx1, worker cpx1-0


def cluster_toml(c: Case, lay: list[Assignment], a: argparse.Namespace, planner: bool) -> str:
    d0 = c.demand[0][0]
    ctx = max(r.input_len + r.output_len for r in c.trace) + 64
    out = ["[mesh]", f"time_scale = {a.time_scale!r}", f"heartbeat_interval_s = {a.heartbeat_s!r}",
           "heartbeat_timeout_s = 5.0", "stall_timeout_s = 120.0",  # 2 shared cores: a process may stall a while
           "", "[scheduler]", 'policy = "cost"',  # the policy the planner simulates
           f"ttft_slo_s = {d0.ttft_slo_s!r}", f"tpot_slo_s = {d0.tpot_slo_s!r}", "", "[kv_transfer]",
           f"max_wire_bytes = {MAX_WIRE_BYTES}", "", "[planner]", f'mode = "{"act" if planner else "off"}"',
           f"interval_s = {a.interval_s!r}", f"window_s = {a.demand_window_s!r}",
           f"horizon_s = {c.window_s!r}",  # engine seconds, as the offline re-planning's
           f"max_moving_share = {a.max_moving_share!r}"]
    if len(c.models) > 1:
        out.append('scope = "fleet"')
    for d in c.demand[0]:
        out += ["", "[[models]]", f'name = "{d.name}"', f'spec = "{d.spec}"', f"max_context = {ctx}",
                f"ttft_slo_s = {d.ttft_slo_s!r}", f"tpot_slo_s = {d.tpot_slo_s!r}", f"priority = {d.priority!r}"]
    gs = {g.name: g for g in c.groups}
    for s in lay:
        if s.model:  # an idle server of the layout is not started (the planner starts no workers)
            out += ["", "[[workers]]", f'name = "{worker_group(s.server)}"', f'model = "{s.model}"',
                    f'accelerator = "{s.accelerator}"', f'role = "{s.role.value}"',
                    f"max_batch = {gs[s.group].max_batch}", f"step_tokens = {gs[s.group].step_tokens}"]
    return "\n".join(out) + "\n"


_BASE = "".join(random.Random(7).choices(string.ascii_letters, k=1 << 16))


def prompt(i: int, n: int) -> str:
    """n ASCII bytes (byte tokenizer: n tokens), distinct from the first block on: no prefix hits."""
    head = f"request {i}: "
    off = (i * 7919) % 4096
    return (head + _BASE[off:off + n])[:n]


@functools.lru_cache(maxsize=1 << 16)
def expected(i: int, n_in: int, n_out: int) -> str:
    """The sim engine's text for request i (its own definition; ignore_eos: exactly n_out tokens)."""
    p = prompt(i, n_in)
    return expected_completion(TOK, TOK.encode(p), SamplingParams(max_tokens=n_out, ignore_eos=True))[1]


def parse(body: bytes) -> tuple[int, str, bool, str]:
    """(HTTP status, streamed text, [DONE] seen, first error) of one raw HTTP/1.1 SSE response."""
    head, _, rest = body.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
    if b"chunked" in head.lower():
        payload, pos = bytearray(), 0
        while (eol := rest.find(b"\r\n", pos)) >= 0:
            n = int(rest[pos:eol], 16)
            if n == 0:
                break
            payload += rest[eol + 2:eol + 2 + n]
            pos = eol + 4 + n
        rest = bytes(payload)
    if status != 200:  # an OpenAI-shaped error body: "<code>: <message>"
        try:
            e = json.loads(rest)["error"]
            return status, "", False, f"{e.get('code')}: {e.get('message', '')}"[:200]
        except (ValueError, KeyError, TypeError, AttributeError):
            return status, "", False, rest[:200].decode(errors="replace")
    text, done, err = [], False, ""
    for line in rest.split(b"\n"):
        if line == b"data: [DONE]":
            done = True
        elif line.startswith(b"data: "):
            ev = json.loads(line[6:])
            if "error" in ev:
                e = ev["error"]
                err = err or (f"{e.get('code')}: {e.get('message', '')}" if isinstance(e, dict) else str(e))[:200]
            text += [ch.get("text", "") for ch in ev.get("choices", [])]
    return status, "".join(text), done, err


@dataclass(slots=True)
class Done:
    status: int
    ttft_s: float  # wall
    total_s: float
    tokens: int
    text: str
    done: bool
    error: str


async def replay(mesh: Mesh, c: Case, k: float, start: float, events: list[Any]) -> list[Done]:
    """Every request of the trace at `start` (perf_counter) + arrival / k; switch events and the planner's
    proposals gathered meanwhile."""
    nc = await nats.connect(mesh.nats_url)

    async def on_event(m: Any) -> None:
        events.extend(e for e in decode_events(m.data) if e.kind in SWITCH_EVENTS)

    async def on_plan(m: Any) -> None:
        events.append(decode(m.data, PlanProposal))

    await nc.subscribe(subjects.EVENTS_ALL, cb=on_event)
    await nc.subscribe(subjects.PLAN, cb=on_plan)
    client = SSEClient(mesh.cfg.gateway.host, mesh.port, keep_body=True)

    async def one(i: int, r: TraceRequest) -> Done:
        await asyncio.sleep(max(0.0, start + r.arrival / k - time.perf_counter()))
        body = json.dumps({"model": r.model, "prompt": prompt(i, r.input_len), "max_tokens": r.output_len,
                           "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
        try:
            res = await asyncio.wait_for(client.stream(PATH, body), HUNG_S)
        except (OSError, TimeoutError) as exc:  # reset, refused, or no end within HUNG_S: an error the client saw
            return Done(0, 0.0, 0.0, 0, "", False, f"client {exc!r}"[:200])
        status, text, done, err = parse(res.body)
        return Done(status, res.ttft_s, res.total_s, res.completion_tokens, text, done, err)

    out = list(await asyncio.gather(*(one(i, r) for i, r in enumerate(c.trace))))
    await asyncio.sleep(1.0)  # the last switch events
    await nc.close()
    return out


def run_arms(c: Case, lay: list[Assignment], a: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The static arm (planner off) and the planner arm (act) as two meshes replaying the trace side by side:
    the load the machine's other work puts on its cores falls on both alike (the gain is their ratio)."""
    meshes: list[Mesh] = []
    for planner in (False, True):
        d = Path(tempfile.mkdtemp(prefix=f"hetmesh-live-replan-{c.name}-"))
        (d / "cluster.toml").write_text(cluster_toml(c, lay, a, planner))
        meshes.append(Mesh(d / "cluster.toml", gateway_port=0, log_dir=d / "logs"))
    events: list[list[Any]] = [[], []]
    try:
        for m in meshes:
            m.start(ready_timeout_s=180)
        pids = [[s.proc.pid for s in m.services.values() if s.proc] for m in meshes]
        c0, w0 = [cpu_seconds(p) for p in pids], time.perf_counter()

        async def both() -> tuple[list[list[Done]], float]:
            for m in meshes:
                await SSEClient(m.cfg.gateway.host, m.port).wait_ready()
            start, epoch = time.perf_counter() + 1.0, time.time() + 1.0
            return list(await asyncio.gather(*(replay(m, c, a.time_scale, start, ev)
                                                 for m, ev in zip(meshes, events, strict=True)))), epoch

        done, epoch = asyncio.run(both())
        wall = time.perf_counter() - w0
        cpu = [cpu_seconds(p) - before for p, before in zip(pids, c0, strict=True)]
    finally:
        for m in meshes:
            m.stop()
    return tuple(summarize_live(c, dn, ev, epoch, lay, a.time_scale) | {  # type: ignore[return-value]
        "wall_s": round(wall, 1), "mesh_cpu_cores": round(cp / wall, 2), "logs": str(m.log_dir)}
        for dn, ev, cp, m in zip(done, events, cpu, meshes, strict=True))


def summarize_live(c: Case, done: list[Done], events: list[Any], epoch: float, lay: list[Assignment],
                   k: float) -> dict[str, Any]:
    slo = {d.name: (d.ttft_slo_s, d.tpot_slo_s, d.priority) for d in c.demand[0]}
    good, wrong, errors, refused, unserved, ttfts, tpots = 0.0, 0, [], 0, 0, [], []
    for i, (r, x) in enumerate(zip(c.trace, done, strict=True)):
        if x.status == 429 or x.error.startswith("slo_unattainable"):
            refused += 1  # SLO admission said no (at the start, or to a retry): a refusal, not an error
            continue
        if x.status == 503 and x.error.startswith(("no_workers", "model_moving")):
            unserved += 1  # no worker serves the model (yet), or its last one is moving: the designed 503, no hang
            continue
        if x.status != 200 or not x.done or x.error:
            errors.append(f"{x.status} {x.error}"[:200])
            continue
        if x.text != expected(i, r.input_len, r.output_len) or x.tokens != r.output_len:
            wrong += 1  # a token lost, duplicated or changed
            continue
        ttft, tpot = x.ttft_s * k, (x.total_s - x.ttft_s) * k / max(x.tokens - 1, 1)
        ttfts.append(ttft)
        tpots.append(tpot)
        ttft_slo, tpot_slo, prio = slo[r.model]
        if ttft <= ttft_slo and (x.tokens <= 1 or tpot <= tpot_slo):
            good += prio * x.tokens
    worker_server = {f"{worker_group(s.server)}-0": s.server for s in lay}
    proposals = [e for e in events if isinstance(e, PlanProposal)]
    events = [e for e in events if not isinstance(e, PlanProposal)]
    changes, out_s, starts = [], 0.0, {}
    for e in sorted(events, key=lambda e: e.ts):
        w = str(e.detail.get("worker_id", e.instance))
        if e.kind.endswith("_switching"):
            starts[w] = e.ts
        elif e.kind in ("role_switched", "model_switched") and w in worker_server:
            model = str(e.detail.get("to_model") or next(s.model for s in lay if s.server == worker_server[w]))
            changes.append(((e.ts - epoch) * k, worker_server[w], model, Role(str(e.detail["to_role"]))))
            out_s += (e.ts - starts.pop(w, e.ts)) * k
    ttfts.sort()
    tpots.sort()
    return {"requests": len(done), "good_tokens": good, "goodput_tok_s": good / (len(c.demand) * c.window_s),
            "errors": len(errors), "error_samples": errors[:5], "wrong_text": wrong, "refused": refused,
            "unserved": unserved,
            "ttft_p50_s": ttfts[len(ttfts) // 2] if ttfts else None,
            "tpot_p50_s": tpots[len(tpots) // 2] if tpots else None,
            "moves": len(changes), "switch_out_s_measured": round(out_s, 1),
            "changes": [(round(t, 1), s, m, r.value) for t, s, m, r in changes],
            "switch_events": [(round((e.ts - epoch) * k, 1), e.kind, str(e.detail.get("worker_id", "")))
                              for e in sorted(events, key=lambda e: e.ts)][:60],
            # engine s, moves proposed, sent: how soon the planner saw the change and what it asked for
            "proposals": [(round((p.ts - epoch) * k, 1), len(p.moves), ",".join(p.sent)) for p in proposals]}


# --- one case, and the table ---------------------------------------------------------------------
def run_case(name: str, a: argparse.Namespace) -> dict[str, Any]:
    c = scaled_case(name, a.windows, a.window_s, a.workers, a.load)
    dur = len(c.demand) * c.window_s
    info: dict[str, Any] = {
        "fleet": [(g.name, g.accelerator, g.count) for g in c.groups], "models": c.models,
        "rate_scale": c.rate_scale, "windows": len(c.demand), "window_s": c.window_s, "requests": len(c.trace),
        "demand": [[(d.name, d.spec, round(d.rate, 2), d.input_mean, d.output_mean) for d in ds] for ds in c.demand]}
    if len(c.models) > 1 and not model_switch_available():
        return info | {"not_run": "model switch not available"}
    storage = config.WorkerConfig().storage_bytes_per_s  # the workers' reload speed, as the planner prices it
    t0 = time.process_time()
    static_name, lay, static_per = best_static(c)
    info |= {"static_layout": static_name, "layout": {s.server: f"{s.model}/{s.role.value}" for s in lay},
             "sim_static_good_tokens": sum(static_per), "sim_static_per_window": static_per}
    console.print(f"{name}: {len(c.trace)} requests over {dur:g} engine s; best static layout {static_name} "
                  f"{info['layout']} (sim {sum(static_per) / dur:.1f} tok/s)")
    live_static, live_plan = run_arms(c, lay, a)
    console.print(f"  live static: {live_static['goodput_tok_s']:.1f} tok/s, {live_static['errors']} errors, "
                  f"{live_static['wrong_text']} wrong texts, {live_static['refused']} refused")
    console.print(f"  live planner: {live_plan['goodput_tok_s']:.1f} tok/s, {live_plan['moves']} moves, "
                  f"{live_plan['errors']} errors, {live_plan['wrong_text']} wrong texts, {live_plan['refused']} refused")
    changes = [(t, s, m, Role(r)) for t, s, m, r in live_plan["changes"]]
    same = sim_of_layouts(c, lay, changes, storage)
    offline = sim_replanned(c, lay, storage)
    st = sum(static_per)
    live_gain = live_plan["good_tokens"] / max(live_static["good_tokens"], 1e-9)
    sim_gain = same["good_tokens"] / max(st, 1e-9)
    info |= {"live_static": live_static, "live_planner": live_plan, "sim_same_layouts": same,
             "sim_offline_replanned": offline, "sim_cpu_s": round(time.process_time() - t0, 1),
             "live_gain": live_gain, "sim_gain": sim_gain, "live_over_sim_gain": live_gain / sim_gain,
             "sim_offline_gain": offline["good_tokens"] / max(st, 1e-9),
             "live_over_sim_static": live_static["good_tokens"] / max(st, 1e-9),
             "within_10pct": abs(live_gain / sim_gain - 1) <= 0.10,
             "clean": live_static["errors"] + live_plan["errors"] + live_static["wrong_text"]
             + live_plan["wrong_text"] == 0}
    return info


def table(res: dict[str, Any], a: argparse.Namespace) -> Table:
    t = Table(title=f"live re-planning (sim engines, time scale {a.time_scale:g}; goodput in SLO-meeting "
                    f"output tok per engine s)")
    for col in ("case", "static layout", "live static", "sim static", "live planner", "moves", "sim same layouts",
                "live gain", "sim gain", "live/sim gain", "offline re-plan gain", "errors / wrong / refused"):
        t.add_column(col, justify="right")
    for name, r in res.items():
        if "not_run" in r:
            t.add_row(name, f"not run: {r['not_run']}", *[""] * 10)
            continue
        dur = r["windows"] * r["window_s"]
        ls, lp = r["live_static"], r["live_planner"]
        t.add_row(name, ", ".join(f"{k}={v}" for k, v in r["layout"].items()), f"{ls['goodput_tok_s']:.1f}",
                  f"{r['sim_static_good_tokens'] / dur:.1f}", f"{lp['goodput_tok_s']:.1f}", str(lp["moves"]),
                  f"{r['sim_same_layouts']['good_tokens'] / dur:.1f}", f"{r['live_gain']:.3f}",
                  f"{r['sim_gain']:.3f}", f"{r['live_over_sim_gain']:.3f}", f"{r['sim_offline_gain']:.3f}",
                  f"{ls['errors'] + lp['errors']} / {ls['wrong_text'] + lp['wrong_text']} / "
                  f"{ls['refused']} + {lp['refused']}")
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window-s", type=float, default=100.0, help="engine seconds per window of constant demand")
    ap.add_argument("--workers", type=int, default=3, help="one-device sim workers the fleet is scaled to")
    # 1: as busy as the original fleet. The live mesh's own CPU (gateway, client, ~12 processes a mesh, two
    # meshes side by side) shares 2 cores with other work here: at 1 its queues ran away (TTFT tens of s).
    ap.add_argument("--load", type=float, default=0.5, help="the scaled rates times this")
    ap.add_argument("--time-scale", type=float, default=1.0, help="engine seconds per wall second")
    ap.add_argument("--heartbeat-s", type=float, default=0.1, help="heartbeat interval, wall seconds")
    # a plan simulates its candidates (seconds of CPU each round): rounds further apart leave the workers the CPU
    ap.add_argument("--interval-s", type=float, default=10.0, help="planner round and demand report, wall seconds")
    ap.add_argument("--demand-window-s", type=float, default=0.0,
                    help="the scheduler's demand window, wall seconds (0: two planner rounds)")
    ap.add_argument("--max-moving-share", type=float, default=0.67)
    ap.add_argument("--out", default=str(ROOT / "results" / "live_replanning.json"))
    a = ap.parse_args()
    a.demand_window_s = a.demand_window_s or 2 * a.interval_s
    res = {}
    for name in a.cases.split(","):
        res[name] = run_case(name, a)
        expected.cache_clear()
    console.print(table(res, a))
    write_json(a.out, {"cases": res, "config": vars(a), "model_switch_available": model_switch_available(),
                       "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                   "python": platform.python_version(),
                                   "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
                       "ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    console.print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
