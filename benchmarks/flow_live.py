"""Flow control on the live mesh: the simulator benchmark's tenants (benchmarks/flow_control.py) sent through a real
gateway, scheduler and sim-engine workers as separate processes over NATS and Redis.

The cluster is the simulator's (four H100 workers, Llama-3.1-8B, max_batch 64, the cost policy with SLO-aware
admission, TTFT 2 s and TPOT 0.1 s), its engines slowed to `--time-scale` (0.25: a second of engine time takes
four of wall time), so that engine time, not the mesh's own milliseconds or this 2-core host, decides who meets
its SLOs. The traces are the simulator benchmark's own (its `load`, its capacity), replayed open loop at their
arrival times / time_scale: each request a streamed /v1/completions of exactly its prompt's tokens (the byte
tokenizer: one character a token, a unique head so nothing is a prefix hit) and `max_tokens` = its output length
with ignore_eos, its tenant in the flow header. The client stamps the first token and the last; a request meets its
SLOs when TTFT x time_scale <= 2 s and (last - first) / (tokens - 1) x time_scale <= 0.1 s; a refusal (429/503)
is a miss. Attainment is of all a tenant offered; goodput is the output tokens of the requests within SLO, each
counted whole: a run waits for every stream to end (`--grace` caps the wait; a stream cut by it counts what it
streamed, and the simulator's figure is then scored at the same cut, as a cut favours short outputs). Each case
runs with flow control ([[tenants]] in the cluster file) and without (no [[tenants]]: the header is ignored), and
the simulator's figure for the same trace is shown beside it:

- noisy neighbour: three quiet tenants at 0.2x capacity each, a fourth sending 10x its fair share (2.5x capacity)
  of 8k-token prompts; target: each quiet tenant's attainment within 3 points of the run without the noisy one;
- priority bands: a high band at 0.5x capacity keeps >= 99% attainment while a low band sends 2x capacity;
- equal weights, backlogged (tenants at 0.5x, 1x, 2x capacity): Jain's index of per-tenant goodput >= 0.95;
- weights 1:2:4, backlogged (each tenant at 1.5x capacity): each tenant's goodput share within 10% of w/7;
- an idle tenant (three tenants at 1x capacity, a fourth configured that sends nothing): total goodput (output
  tokens of the requests within SLO, the same trace in both runs) with flow control >= 0.97x that without.

The load average and the mesh's CPU are recorded per run: where the host, not the engines, sets the pace, the
quiet-only run itself misses its SLOs. Live runs of the same trace on one host differ by several points, so
`--repeats N` runs each case N times (flow and no flow alternating which goes first); a row's value is the median
over them, each run's kept.

    .venv/bin/python benchmarks/flow_live.py [--time-scale 0.25] [--duration 30] [--grace 600] [--repeats 1]
        [--cases noisy bands jain weights idle]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import tomli_w
from flow_control import IN, SLO, WORKERS, capacity, jain, load, within_slo
from loadgen import cpu_seconds, cpu_ticks, percentile, steal_fraction
from mesh_overhead import machine
from mesh_replicas import code
from rich.console import Console
from rich.table import Table

from hetmesh.cli.mesh import fetch_status
from hetmesh.launcher import Mesh
from hetmesh.placement.flow import Tenant
from hetmesh.sim import SimConfig, Trace, simulate
from hetmesh.sim.results import SimResult
from hetmesh.sim.traces import merge

MODEL = "llama-3.1-8b"
# The client's streams are spread over this many httpx clients: httpcore's connection pool walks every connection
# it holds each time a request starts or ends (quadratically once past its keep-alive limit), and a single pool of
# the hundreds of streams these traces hold open put the client itself, not the mesh, seconds behind its schedule.
CLIENT_POOLS = 32
HEADER = "x-hetmesh-tenant"


def cluster(time_scale: float, tenants: tuple[Tenant, ...], bands: int) -> str:
    """The simulator benchmark's fleet as a cluster file; `tenants` empty: flow control off."""
    doc: dict[str, Any] = {
        "mesh": {"time_scale": time_scale, "heartbeat_interval_s": 0.5},
        "scheduler": {"policy": "cost", "ttft_slo_s": SLO.ttft_s, "tpot_slo_s": SLO.tpot_s},
        "models": [{"name": MODEL, "spec": MODEL, "max_context": 131072, "block_size": 16}],
        "workers": [{"name": "h100", "model": MODEL, "accelerator": "nvidia-h100", "role": "both", "count": 4,
                     "max_batch": 64}],
    }
    if tenants:
        names = [f"band{i}" for i in range(bands)]
        doc["flow"] = {"bands": names, "header": HEADER}
        doc["tenants"] = [{"name": t.name, "weight": t.weight, "priority": names[t.band]} for t in tenants]
    return tomli_w.dumps(doc)


@dataclass(slots=True)
class Outcome:
    tenant: str
    status: int = 0  # HTTP status; 0: no answer (a connection error)
    ttft_s: float = 0.0  # wall seconds
    last_s: float = 0.0  # to the last token so far
    tokens: int = 0  # streamed so far
    cut: bool = False  # still streaming at the run's end: judged on what it had streamed
    code: str = ""  # a refusal's error code
    late_s: float = 0.0  # how far behind the trace's arrival time the client sent it (wall seconds)

    @property
    def tpot_s(self) -> float:
        return (self.last_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else 0.0


async def one(c: httpx.AsyncClient, o: Outcome, i: int, n_in: int, n_out: int, flow: bool) -> None:
    head = f"r{i} "
    body = {"model": MODEL, "prompt": head + "x" * max(n_in - len(head), 1), "max_tokens": n_out, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    try:
        async with c.stream("POST", "/v1/completions", json=body, headers={HEADER: o.tenant} if flow else {}) as r:
            o.status = r.status_code
            if r.status_code != 200:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    o.code = json.loads(await r.aread())["error"]["code"]
                return
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    # the byte tokenizer: a character a token (the gateway may merge tokens into one event)
                    n = sum(len(ch["text"]) for ch in json.loads(line[6:])["choices"])
                    if n:
                        o.last_s = time.perf_counter() - t0
                        o.ttft_s = o.ttft_s or o.last_s
                        o.tokens += n
    except (httpx.HTTPError, OSError):
        o.status = 0


async def replay(url: str, trace: Trace, time_scale: float, flow: bool, grace_s: float) -> list[Outcome]:
    """Every request of `trace` at its arrival / time_scale; those still streaming `grace_s` after the last
    arrival are cut and judged on what they streamed (their TTFT, their TPOT so far)."""
    outs = [Outcome(r.tenant) for r in trace.requests]
    async with contextlib.AsyncExitStack() as stack:
        pools = [await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)))
                 for _ in range(CLIENT_POOLS)]
        tasks = []
        t0 = time.perf_counter()
        for i, r in enumerate(trace.requests):
            due = t0 + r.arrival / time_scale
            if (delay := due - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            outs[i].late_s = max(time.perf_counter() - due, 0.0)  # after the sleep: a busy loop oversleeps
            tasks.append(asyncio.create_task(one(pools[i % CLIENT_POOLS], outs[i], i, r.input_len, r.output_len,
                                                 flow)))
        _, pending = await asyncio.wait(tasks, timeout=grace_s)
        for t in pending:
            outs[tasks.index(t)].cut = True
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return outs


def score(outs: list[Outcome], time_scale: float) -> dict[str, dict[str, Any]]:
    """Per tenant: offered, served, refused, cut, SLO attainment of all offered, the tokens of the requests within
    SLO (goodput), TTFT p50/p99 and TPOT p50 (engine seconds)."""
    per: dict[str, dict[str, Any]] = {}
    for t in sorted({o.tenant for o in outs}):
        mine = [o for o in outs if o.tenant == t]
        ok = [o for o in mine if o.status == 200 and o.ttft_s * time_scale <= SLO.ttft_s
              and o.tokens and (o.tokens <= 1 or o.tpot_s * time_scale <= SLO.tpot_s)]
        served = [o for o in mine if o.status == 200]
        per[t] = {"offered": len(mine), "served": len(served), "refused": sum(o.status in (429, 503) for o in mine),
                  "failed": sum(o.status not in (200, 429, 503) and not o.cut for o in mine),
                  "cut": sum(o.cut for o in mine),
                  "refusals": dict(Counter(f"{o.status} {o.code}" for o in mine if o.status not in (0, 200))),
                  "attainment": len(ok) / len(mine), "good_tokens": sum(o.tokens for o in ok),
                  "ttft_p50_s": percentile([o.ttft_s * time_scale for o in served], 0.5),
                  "ttft_p99_s": percentile([o.ttft_s * time_scale for o in served], 0.99),
                  "tpot_p50_s": percentile([o.tpot_s * time_scale for o in served], 0.5),
                  "client_late_p99_s": percentile([o.late_s for o in mine], 0.99)}
    return per


def live(trace: Trace, tenants: tuple[Tenant, ...], a: argparse.Namespace, label: str) -> dict[str, Any]:
    """One fresh mesh (its own nats-server and redis-server), `trace` replayed through it."""
    d = Path(tempfile.mkdtemp(prefix="hetmesh-flow-live-"))
    (d / "cluster.toml").write_text(cluster(a.time_scale, tenants, 1 + max((t.band for t in tenants), default=0)))
    mesh = Mesh(d / "cluster.toml", gateway_port=0, log_dir=d / "logs", die_with_parent=True)
    mesh.start(ready_timeout_s=120)
    try:
        pids = [s.proc.pid for s in mesh.services.values() if s.proc] + [p.proc.pid for p in mesh.started_servers]
        load0, c0, k0, me0, w0 = os.getloadavg(), cpu_seconds(pids), cpu_ticks(), time.process_time(), time.time()
        outs = asyncio.run(replay(mesh.url, trace, a.time_scale, bool(tenants), a.grace))
        wall = time.time() - w0
        # the scheduler's own per-tenant figures (placed, refused, held, cost in flight), as `hetmesh status
        # --tenants` shows them: what the queue did, beside what the client saw
        queue = asyncio.run(fetch_status(mesh.nats_url, 5.0)).tenants if tenants else {}
        run = {"label": label, "flow": bool(tenants), "requests": len(outs), "wall_s": wall,
               "load_average_start": load0, "load_average_end": os.getloadavg(),
               "mesh_cpu_cores": (cpu_seconds(pids) - c0) / wall, "client_cpu_cores": (time.process_time() - me0) / wall,
               "host_steal_fraction": steal_fraction(k0, cpu_ticks()), "tenants": score(outs, a.time_scale),
               "scheduler_tenants": queue}
    finally:
        mesh.stop()
    t = run["tenants"]
    Console().print(f"[dim]{label}: {wall:.0f} s, load {run['load_average_end'][0]:.1f}, mesh "
                    f"{run['mesh_cpu_cores']:.2f} cores, client {run['client_cpu_cores']:.2f}; attainment "
                    + ", ".join(f"{n} {v['attainment']:.3f} ({v['refused']} refused)" for n, v in t.items()))
    return run


def sim_scored(res: SimResult, trace: Trace, cutoff: float) -> dict[str, dict[str, float]]:
    """The simulator's run scored as the live client scores its own: per tenant, SLO attainment of all offered and
    the output tokens of the requests within SLO, a request still streaming at `cutoff` (engine seconds from the
    start) counting what it streamed by then (at an even pace between its first token and its last)."""
    end = res.start + cutoff
    offered = Counter(r.tenant for r in trace.requests)
    out = {t: {"attainment": 0.0, "good_tokens": 0.0} for t in offered}
    for r in res.records:
        if r.output_len <= 0 or r.first_token > end or not within_slo(r):
            continue
        o = out[r.tenant]
        o["attainment"] += 1 / offered[r.tenant]
        o["good_tokens"] += r.output_len if r.finish <= end else 1 + (end - r.first_token) / max(r.tpot, 1e-9)
    return out


def att(run: dict[str, Any], t: str) -> float:
    return run["tenants"][t]["attainment"]


def share_error(good: dict[str, float], weights: dict[str, float]) -> float:
    """The largest relative error of a tenant's share of `good` against its share of `weights`."""
    total, wsum = sum(good.values()), sum(weights.values())
    return max(abs(good[n] / total / (w / wsum) - 1) for n, w in weights.items()) if total else 1.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-scale", type=float, default=0.25, help="engine seconds per wall second")
    ap.add_argument("--duration", type=float, default=30.0, help="engine seconds of arrivals per trace")
    ap.add_argument("--grace", type=float, default=600.0,
                    help="wall seconds a run waits past its last arrival for its streams to end (the default lets "
                         "every output finish at time scale 0.25); those still streaming then are cut, judged on "
                         "what they streamed, and the simulator's run is scored at the same cut")
    every = ["noisy", "bands", "jain", "weights", "idle"]
    ap.add_argument("--cases", nargs="+", default=every, choices=every)
    ap.add_argument("--repeats", type=int, default=1, help="live runs of each case (the median is its value)")
    ap.add_argument("--out", default="results/flow_live.json")
    a = ap.parse_args()
    if a.repeats < 1:
        ap.error(f"--repeats must be >= 1, not {a.repeats}")
    t0, d, ts = time.time(), a.duration, a.time_scale
    cap = capacity(d)  # engine req/s, the simulator's
    runs: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []

    def sim_of(trace: Trace, tenants: tuple[Tenant, ...]) -> dict[str, dict[str, float]]:
        _, res = simulate(WORKERS, "cost", trace, SimConfig(tenants=tenants), SLO)
        return sim_scored(res, trace, max(r.arrival for r in trace.requests) + a.grace * ts)

    def both(case: str, trace: Trace, tenants: tuple[Tenant, ...]) -> tuple[list[dict[str, dict]], dict[str, dict]]:
        """`--repeats` pairs of live runs, flow and no flow (their order alternating, so that drift of the host
        falls on both alike), and the simulator's run of each (the same every time: once)."""
        sims = {"flow": sim_of(trace, tenants), "no flow": sim_of(trace, ())}
        reps = []
        for k in range(a.repeats):
            pair = (("flow", tenants), ("no flow", ()))
            rep = {}
            for label, ts_ in (pair if k % 2 == 0 else pair[::-1]):
                r = live(trace, ts_, a, f"{case}, {label}, run {k + 1}")
                r["repeat"], r["sim"] = k + 1, sims[label]
                runs.append(r)
                rep[label] = r
            reps.append(rep)
        return reps, sims

    def row(case: str, run: str, metric: str, values: list[float], sim: float, target: str,
            detail: dict[str, Any]) -> None:
        """One row: the median over the repeats (each repeat's value kept), judged against `target`."""
        v = statistics.median(values)
        bound = float(target.split()[-1])
        ok = v <= bound if target.startswith("<=") else v >= bound
        rows.append({"case": case, "run": run, "metric": metric, "value": v, "values": values, "sim": sim,
                     "target": target, "ok": ok, "detail": detail})

    if "noisy" in a.cases:
        four = tuple(Tenant(n) for n in ("q1", "q2", "q3", "noisy"))
        quiet = merge(*(load(0.2 * cap, d, f"q{i}", i) for i in (1, 2, 3)))
        bases, base_sim = [], sim_of(quiet, four)  # the simulator's run is the same every time: once
        for k in range(a.repeats):
            b = live(quiet, four, a, f"noisy neighbour, quiet tenants alone, run {k + 1}")
            b["repeat"], b["sim"] = k + 1, base_sim
            runs.append(b)
            bases.append(b)
        reps, sims = both("noisy neighbour", merge(quiet, load(2.5 * cap, d, "noisy", 7, input_mean=8 * IN)), four)
        for label in ("flow", "no flow"):
            drops = [max(100 * (att(base, q) - att(rep[label], q)) for q in ("q1", "q2", "q3"))
                     for base, rep in zip(bases, reps, strict=True)]
            sdrop = max(100 * (base_sim[q]["attainment"] - sims[label][q]["attainment"]) for q in ("q1", "q2", "q3"))
            row("noisy neighbour", label, "worst quiet tenant's drop (pts)", drops, sdrop, "<= 3",
                {n: [round(att(rep[label], n), 3) for rep in reps] for n in reps[0][label]["tenants"]}
                | {"alone": {q: [round(att(b, q), 3) for b in bases] for q in ("q1", "q2", "q3")}})

    if "bands" in a.cases:
        banded = merge(load(0.5 * cap, d, "high", 21), load(2.0 * cap, d, "low", 22))
        reps, sims = both("priority bands", banded, (Tenant("high", 1.0, 0), Tenant("low", 1.0, 1)))
        for label in ("flow", "no flow"):
            row("priority bands, low at 2x", label, "high band's attainment", [att(r[label], "high") for r in reps],
                sims[label]["high"]["attainment"], ">= 0.99",
                {n: [round(att(r[label], n), 3) for r in reps] for n in ("high", "low")})

    if "jain" in a.cases:
        unequal = merge(*(load(x * cap, d, n, i) for i, (n, x) in enumerate(zip("abc", (0.5, 1.0, 2.0), strict=True))))
        reps, sims = both("equal weights", unequal, tuple(Tenant(n) for n in "abc"))
        for label in ("flow", "no flow"):
            row("equal weights, backlogged", label, "Jain's index of goodput",
                [jain([r[label]["tenants"][n]["good_tokens"] for n in "abc"]) for r in reps],
                jain([sims[label][n]["good_tokens"] for n in "abc"]), ">= 0.95",
                {n: [r[label]["tenants"][n]["good_tokens"] for r in reps] for n in "abc"})

    if "weights" in a.cases:
        ws = {"a": 1.0, "b": 2.0, "c": 4.0}
        weighted = merge(*(load(1.5 * cap, d, n, 10 + i) for i, n in enumerate(ws)))
        reps, sims = both("weights 1:2:4", weighted, tuple(Tenant(n, w) for n, w in ws.items()))
        for label in ("flow", "no flow"):
            goods = [{n: r[label]["tenants"][n]["good_tokens"] for n in ws} for r in reps]
            row("weights 1:2:4, backlogged", label, "largest share error vs 1:2:4",
                [share_error(g, ws) for g in goods], share_error({n: sims[label][n]["good_tokens"] for n in ws}, ws),
                "<= 0.10", {n: [round(g[n] / (sum(g.values()) or 1), 3) for g in goods] for n in ws})

    if "idle" in a.cases:
        equal = merge(*(load(cap, d, n, i) for i, n in enumerate("abc")))
        reps, sims = both("an idle tenant", equal, tuple(Tenant(n) for n in "abcd"))  # d configured, sends nothing
        # goodput over the same trace in both runs of a pair: output tokens of the requests within SLO, not a rate
        # over each run's own makespan
        goods = [{label: sum(v["good_tokens"] for v in r[label]["tenants"].values()) for label in r} for r in reps]
        sgood = {label: sum(v["good_tokens"] for v in sim.values()) for label, sim in sims.items()}
        row("an idle tenant", "flow vs no flow", "total goodput, flow / no flow",
            [g["flow"] / g["no flow"] if g["no flow"] else 0.0 for g in goods], sgood["flow"] / sgood["no flow"],
            ">= 0.97", {"good tokens": goods, "within SLO": [
                {label: round(sum(v["attainment"] * v["offered"] for v in r[label]["tenants"].values())) for label in r}
                for r in reps]})

    table = Table(title=f"Flow control on the live mesh (4x H100 sim workers, Llama-3.1-8B, time_scale {ts:g}, "
                        f"capacity {cap:.1f} engine req/s = {cap * ts:.1f} req/s wall)")
    for c in ("case", "run", "metric", "live", "sim, same trace", "target", "per tenant (live)"):
        table.add_column(c)
    for r in rows:
        live_v = f"{r['value']:.3f}" + (f" ({', '.join(f'{v:.3f}' for v in r['values'])})" if len(r["values"]) > 1
                                         else "")
        table.add_row(r["case"], r["run"], r["metric"], live_v, f"{r['sim']:.3f}",
                      r["target"] if r["run"] != "no flow" else "", json.dumps(r["detail"]))
    Console(width=160).print(table)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "machine": machine(), "code": code(), "command": f"python benchmarks/flow_live.py --time-scale {ts:g} --duration {d:g} "
                                         f"--grace {a.grace:g} --cases {' '.join(a.cases)} --repeats {a.repeats}",
        "repeats": a.repeats, "time_scale": ts, "duration_engine_s": d, "capacity_engine_req_s": cap,
        "slo_engine_s": {"ttft": SLO.ttft_s, "tpot": SLO.tpot_s}, "wall_s": time.time() - t0,
        "rows": rows, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
