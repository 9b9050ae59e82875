"""The live half of benchmarks/live_replanning.py: a case's cluster file, two meshes (static and planner)
replaying the trace side by side through the real gateway, and what their clients saw (SLO-meeting tokens,
the streamed text checked against the sim engine's deterministic text, switch events, proposals)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import string
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import nats
from loadgen import SSEClient, cpu_seconds

from hetmesh import subjects
from hetmesh.bus import decode, decode_events
from hetmesh.engines.sampling import expected_completion
from hetmesh.launcher import Mesh
from hetmesh.planner import Assignment
from hetmesh.protocol import PlanProposal, Role, SamplingParams
from hetmesh.sim.traces import TraceRequest
from hetmesh.tokenizer import ByteTokenizer

if TYPE_CHECKING:
    from live_replanning import Case

PATH = "/v1/completions"
TOK = ByteTokenizer()
HUNG_S = 300.0  # wall seconds without the end of a stream: counted as hung (an error)
MAX_WIRE_BYTES = 65536  # the sim KV of an 8k prompt is ~1 GB: loopback carries a token of it
SWITCH_EVENTS = {"role_switching", "role_switched", "model_switching", "model_switched", "model_switch_failed",
                 "role_switch_refused", "model_switch_refused"}


def worker_group(server: str) -> str:
    return server.replace("-", "")  # server cpx-1 runs as group cpx1, worker cpx1-0


def cluster_toml(c: Case, lay: list[Assignment], a: argparse.Namespace, planner: bool) -> str:
    d0 = c.demand[0][0]
    ctx = max(r.input_len + r.output_len for r in c.trace) + 64
    out = ["[mesh]", f"time_scale = {a.time_scale!r}", f"heartbeat_interval_s = {a.heartbeat_s!r}",
           "heartbeat_timeout_s = 5.0", "stall_timeout_s = 120.0",  # 2 shared cores: a process may stall a while
           "", "[gateway]", "submit_timeout_s = 30.0",  # the same: a scheduler stalled 5 s by other work here
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
