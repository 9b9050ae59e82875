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
is a miss. Attainment is of all a tenant offered. Each case runs with flow control ([[tenants]] in the cluster
file) and without (no [[tenants]]: the header is ignored), and the simulator's figure for the same trace is shown
beside it:

- noisy neighbour: three quiet tenants at 0.2x capacity each, a fourth sending 10x its fair share (2.5x capacity)
  of 8k-token prompts; target: each quiet tenant's attainment within 3 points of the run without the noisy one;
- priority bands: a high band at 0.5x capacity keeps >= 99% attainment while a low band sends 2x capacity;
- equal weights, backlogged (tenants at 0.5x, 1x, 2x capacity): Jain's index of per-tenant goodput >= 0.95;
- weights 1:2:4, backlogged (each tenant at 1.5x capacity): each tenant's goodput share within 10% of w/7;
- an idle tenant (three tenants at 1x capacity, a fourth configured that sends nothing): total goodput (output
  tokens of the requests within SLO, the same trace in both runs) with flow control >= 0.97x that without.

The load average and the mesh's CPU are recorded per run: where the host, not the engines, sets the pace, the
quiet-only run itself misses its SLOs.

    .venv/bin/python benchmarks/flow_live.py [--time-scale 0.25] [--duration 24] [--cases noisy bands jain weights idle]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import tomli_w
from flow_control import IN, SLO, capacity, jain, load
from flow_control import run as simulate
from loadgen import cpu_seconds, cpu_ticks, percentile, steal_fraction
from mesh_overhead import machine
from mesh_replicas import code
from rich.console import Console
from rich.table import Table

from hetmesh.launcher import Mesh
from hetmesh.placement.flow import Tenant
from hetmesh.sim import Trace
from hetmesh.sim.traces import merge

MODEL = "llama-3.1-8b"
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
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    outs = [Outcome(r.tenant) for r in trace.requests]
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as c:
        tasks = []
        t0 = time.perf_counter()
        for i, r in enumerate(trace.requests):
            delay = t0 + r.arrival / time_scale - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(c, outs[i], i, r.input_len, r.output_len, flow)))
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
                  "tpot_p50_s": percentile([o.tpot_s * time_scale for o in served], 0.5)}
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
        run = {"label": label, "flow": bool(tenants), "requests": len(outs), "wall_s": wall,
               "load_average_start": load0, "load_average_end": os.getloadavg(),
               "mesh_cpu_cores": (cpu_seconds(pids) - c0) / wall, "client_cpu_cores": (time.process_time() - me0) / wall,
               "host_steal_fraction": steal_fraction(k0, cpu_ticks()), "tenants": score(outs, a.time_scale)}
    finally:
        mesh.stop()
    t = run["tenants"]
    Console().print(f"[dim]{label}: {wall:.0f} s, load {run['load_average_end'][0]:.1f}, mesh "
                    f"{run['mesh_cpu_cores']:.2f} cores, client {run['client_cpu_cores']:.2f}; attainment "
                    + ", ".join(f"{n} {v['attainment']:.3f} ({v['refused']} refused)" for n, v in t.items()))
    return run


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
    ap.add_argument("--grace", type=float, default=20.0, help="wall seconds a run waits past its last arrival")
    every = ["noisy", "bands", "jain", "weights", "idle"]
    ap.add_argument("--cases", nargs="+", default=every, choices=every)
    ap.add_argument("--out", default="results/flow_live.json")
    a = ap.parse_args()
    t0, d, ts = time.time(), a.duration, a.time_scale
    cap = capacity(d)  # engine req/s, the simulator's
    runs: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []

    def both(case: str, trace: Trace, tenants: tuple[Tenant, ...]) -> list[tuple[str, dict[str, Any], dict]]:
        out = []
        for label, ts_ in (("flow", tenants), ("no flow", ())):
            r = live(trace, ts_, a, f"{case}, {label}")
            s = simulate(trace, ts_)
            r["sim"] = {n: {"attainment": v["offered_slo_attainment"], "goodput_tok_s": v["goodput_tok_s"],
                            "good_tokens": v["goodput_tok_s"] * s["duration_s"]} for n, v in s["tenants"].items()}
            runs.append(r)
            out.append((label, r, r["sim"]))
        return out

    if "noisy" in a.cases:
        four = tuple(Tenant(n) for n in ("q1", "q2", "q3", "noisy"))
        quiet = merge(*(load(0.2 * cap, d, f"q{i}", i) for i in (1, 2, 3)))
        base = live(quiet, four, a, "noisy neighbour, quiet tenants alone")
        base["sim"] = {n: {"attainment": v["offered_slo_attainment"]} for n, v in simulate(quiet, four)["tenants"].items()}
        runs.append(base)
        for label, r, sim in both("noisy neighbour", merge(quiet, load(2.5 * cap, d, "noisy", 7, input_mean=8 * IN)),
                                  four):
            drop = max(100 * (att(base, q) - att(r, q)) for q in ("q1", "q2", "q3"))
            sdrop = max(100 * (base["sim"][q]["attainment"] - sim[q]["attainment"]) for q in ("q1", "q2", "q3"))
            rows.append({"case": "noisy neighbour", "run": label, "metric": "worst quiet tenant's drop (pts)",
                         "value": drop, "sim": sdrop, "target": "<= 3", "ok": drop <= 3,
                         "detail": {n: round(att(r, n), 3) for n in r["tenants"]}
                         | {"alone": {q: round(att(base, q), 3) for q in ("q1", "q2", "q3")}}})

    if "bands" in a.cases:
        banded = merge(load(0.5 * cap, d, "high", 21), load(2.0 * cap, d, "low", 22))
        for label, r, sim in both("priority bands", banded, (Tenant("high", 1.0, 0), Tenant("low", 1.0, 1))):
            rows.append({"case": "priority bands, low at 2x", "run": label, "metric": "high band's attainment",
                         "value": att(r, "high"), "sim": sim["high"]["attainment"], "target": ">= 0.99",
                         "ok": att(r, "high") >= 0.99, "detail": {n: round(att(r, n), 3) for n in r["tenants"]}})

    if "jain" in a.cases:
        unequal = merge(*(load(x * cap, d, n, i) for i, (n, x) in enumerate(zip("abc", (0.5, 1.0, 2.0), strict=True))))
        for label, r, sim in both("equal weights", unequal, tuple(Tenant(n) for n in "abc")):
            j = jain([r["tenants"][n]["good_tokens"] for n in "abc"])
            rows.append({"case": "equal weights, backlogged", "run": label, "metric": "Jain's index of goodput",
                         "value": j, "sim": jain([sim[n]["goodput_tok_s"] for n in "abc"]), "target": ">= 0.95",
                         "ok": j >= 0.95, "detail": {n: r["tenants"][n]["good_tokens"] for n in "abc"}})

    if "weights" in a.cases:
        ws = {"a": 1.0, "b": 2.0, "c": 4.0}
        weighted = merge(*(load(1.5 * cap, d, n, 10 + i) for i, n in enumerate(ws)))
        for label, r, sim in both("weights 1:2:4", weighted, tuple(Tenant(n, w) for n, w in ws.items())):
            good = {n: r["tenants"][n]["good_tokens"] for n in ws}
            err = share_error(good, ws)
            rows.append({"case": "weights 1:2:4, backlogged", "run": label, "metric": "largest share error vs 1:2:4",
                         "value": err, "sim": share_error({n: sim[n]["goodput_tok_s"] for n in ws}, ws),
                         "target": "<= 0.10", "ok": err <= 0.10,
                         "detail": {n: round(g / (sum(good.values()) or 1), 3) for n, g in good.items()}})

    if "idle" in a.cases:
        equal = merge(*(load(cap, d, n, i) for i, n in enumerate("abc")))
        runs_ = both("an idle tenant", equal, tuple(Tenant(n) for n in "abcd"))  # d configured, sends nothing
        # goodput over the same trace in both runs: output tokens of the requests within SLO, not a rate over each
        # run's own makespan
        good = {label: sum(v["good_tokens"] for v in r["tenants"].values()) for label, r, _ in runs_}
        sgood = {label: sum(v["good_tokens"] for v in sim.values()) for label, _, sim in runs_}
        ratio = good["flow"] / good["no flow"] if good["no flow"] else 0.0
        rows.append({"case": "an idle tenant", "run": "flow vs no flow", "metric": "total goodput, flow / no flow",
                     "value": ratio, "sim": sgood["flow"] / sgood["no flow"], "target": ">= 0.97",
                     "ok": ratio >= 0.97, "detail": good | {"within SLO": {
                         label: round(sum(v["attainment"] * v["offered"] for v in r["tenants"].values()))
                         for label, r, _ in runs_}}})

    table = Table(title=f"Flow control on the live mesh (4x H100 sim workers, Llama-3.1-8B, time_scale {ts:g}, "
                        f"capacity {cap:.1f} engine req/s = {cap * ts:.1f} req/s wall)")
    for c in ("case", "run", "metric", "live", "sim, same trace", "target", "per tenant (live)"):
        table.add_column(c)
    for r in rows:
        table.add_row(r["case"], r["run"], r["metric"], f"{r['value']:.3f}", f"{r['sim']:.3f}",
                      r["target"] if r["run"] != "no flow" else "", json.dumps(r["detail"]))
    Console(width=160).print(table)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "machine": machine(), "code": code(), "command": f"python benchmarks/flow_live.py --time-scale {ts:g} --duration {d:g} "
                                         f"--cases {' '.join(a.cases)}",
        "time_scale": ts, "duration_engine_s": d, "capacity_engine_req_s": cap,
        "slo_engine_s": {"ttft": SLO.ttft_s, "tpot": SLO.tpot_s}, "wall_s": time.time() - t0,
        "rows": rows, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
