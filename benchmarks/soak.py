"""Bounded soak on loopback: a whole mesh (gateway, scheduler, kv-transfer, sim workers as separate
processes) under a closed loop of mixed streaming and non-streaming requests, with random client
cancels and workers taken away under the load (`--chaos`):

- kill: every `--every` seconds one worker (in turn) is SIGKILLed and restarted;
- term: the same with SIGTERM (a graceful drain; the process must exit 0);
- rolling: every worker, one at a time, is drained with SIGTERM and restarted (a rolling restart).

Every completed text is checked against the text the sim engine's definition gives for the request
(migration must neither lose nor duplicate a token). Prints a table and writes results/soak_<chaos>.json:
requests, outcomes (ok, wrong_text, cancelled, error, hung), errors by code, p50/p99 latency, the
migrations the gateway made and the pause each one cost its stream (p50/p99 of the gap between the
last token before and the first token after, from the gateway's `migration_resumed` events), the
restarts before any token by reason, the items that reached a worker already draining (handed over at
once, worker event `handed_over` with `queued`) and any left undelivered on a worker that let go
(`work_left`), the workers' exit codes, and per process the RSS and NATS subscriptions at the start and the end, plus the
gateway's in-flight gauge once the load has stopped (a leaked request, subscription or memory growth).

    .venv/bin/python benchmarks/soak.py --duration 300 --clients 8 --chaos kill --every 30
    .venv/bin/python benchmarks/soak.py --duration 300 --clients 8 --chaos term --every 30
    .venv/bin/python benchmarks/soak.py --duration 120 --clients 8 --chaos rolling
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import nats
from rich.console import Console
from rich.table import Table

from hetmesh import servers, subjects
from hetmesh.bus import decode_events
from hetmesh.engines.sampling import expected_completion
from hetmesh.launcher import Mesh
from hetmesh.metrics import scrape
from hetmesh.protocol import SamplingParams
from hetmesh.tokenizer import ByteTokenizer

CLUSTER = """
[mesh]
time_scale = {time_scale}
heartbeat_interval_s = 0.2
heartbeat_timeout_s = 1.0
stall_timeout_s = 30.0
max_attempts = 3
migration_limit = 3

[worker]
drain_timeout_s = {drain_timeout_s}

[scheduler]
policy = "prefix_aware"

[[models]]
name = "agg"
spec = "tiny-llama"
max_context = 4096

[[models]]
name = "pd"
spec = "tiny-llama"
max_context = 4096

[[workers]]
name = "h100"
model = "agg"
accelerator = "nvidia-h100"
count = 2

[[workers]]
name = "cpx"
model = "pd"
accelerator = "nvidia-rubin-cpx"
role = "prefill"
count = 2

[[workers]]
name = "vr200"
model = "pd"
accelerator = "nvidia-rubin-vr200"
role = "decode"
count = 2
"""
TOK = ByteTokenizer()

PREFIXES = ["You are a terse assistant. " * 8, "Summarise the following log. " * 6, "Translate to French: "]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def snapshot(mesh: Mesh, monitor: str) -> dict[str, dict[str, float]]:
    """RSS per service process and NATS subscriptions per client connection name."""
    out: dict[str, dict[str, float]] = {}
    for name, svc in mesh.services.items():
        if svc.alive and svc.proc is not None:
            out[name] = {"rss_mb": round(rss_mb(svc.proc.pid), 1)}
    with urllib.request.urlopen(f"{monitor}/connz?subs=1&limit=1024", timeout=5) as r:
        conns = json.loads(r.read())["connections"]
    subs: Counter[str] = Counter()
    for c in conns:
        subs[c.get("name", "")] += c.get("subscriptions", 0)
    for name, svc in out.items():
        wid = name.split(":", 1)[-1]
        svc["nats_subs"] = sum(n for cname, n in subs.items()
                               if cname.endswith(f"-{wid}") or (name == "gateway" and cname.startswith("gateway-"))
                               or (name == "scheduler" and cname.startswith("scheduler-"))
                               or (name.startswith("kv-transfer") and cname.startswith("kv-transfer-")))
    return out


def expected(prompt: str, max_tokens: int, ignore_eos: bool) -> str:
    """The sim engine's text for this request (temperature 1, no seed): its own definition."""
    return expected_completion(TOK, TOK.encode(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))[1]


async def one(http: httpx.AsyncClient, rng: random.Random, stats: dict[str, Any]) -> None:
    model = rng.choice(["agg", "agg", "pd"])
    stream = rng.random() < 0.5
    cancel = stream and rng.random() < 0.15
    prompt = rng.choice(PREFIXES) + f"request {rng.randrange(10**6)}"
    body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(8, 128), "stream": stream,
            "ignore_eos": rng.random() < 0.5}
    want = expected(prompt, body["max_tokens"], body["ignore_eos"])
    outcomes: Counter[str] = stats["outcomes"]
    errors: Counter[str] = stats["errors"]
    lat: list[float] = stats["latency_s"]
    t0 = time.perf_counter()

    def done(text: str) -> None:
        if text == want:
            outcomes["ok"] += 1
            lat.append(time.perf_counter() - t0)
        else:
            outcomes["wrong_text"] += 1  # a token lost or duplicated
            stats["wrong"].append({"model": model, "prompt": prompt, "got": text, "want": want})

    try:
        if not stream:
            r = await http.post("/v1/completions", json=body)
            if r.status_code == 200:
                done(r.json()["choices"][0]["text"])
            else:
                outcomes["error"] += 1
                errors[f"{r.status_code} {r.json()['error'].get('code')}"] += 1
            return
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                outcomes["error"] += 1
                errors[f"{resp.status_code} {json.loads(resp.text)['error'].get('code')}"] += 1
                return
            n = 0
            parts: list[str] = []
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done("".join(parts))
                    return
                payload = json.loads(line[6:])
                if "error" in payload:
                    outcomes["error"] += 1
                    errors[f"stream {payload['error'].get('code')}"] += 1
                    return
                parts.extend(c["text"] for c in payload["choices"])
                n += 1
                if cancel and n >= 3:
                    outcomes["cancelled"] += 1
                    return  # leaving the block closes the connection mid-stream
            outcomes["error"] += 1
            errors["stream ended without [DONE]"] += 1
    except httpx.TimeoutException:
        outcomes["hung"] += 1  # no answer within the client timeout: what must never happen
    except httpx.HTTPError as exc:
        outcomes["error"] += 1
        errors[f"client {type(exc).__name__}"] += 1


async def take_away(mesh: Mesh, name: str, sig: int, stats: dict[str, Any], t_start: float) -> None:
    """Kill or drain one worker, wait for it to exit, bring it back and wait until the mesh sees it."""
    at = round(time.monotonic() - t_start, 1)
    await asyncio.to_thread(mesh.kill, name, sig)  # SIGTERM: returns once the drain is over
    proc = mesh.services[name].proc
    stats["chaos"].append({"service": name, "signal": signal.Signals(sig).name, "at_s": at,
                           "exit_code": proc.returncode if proc is not None else None,
                           "down_s": round(time.monotonic() - t_start - at, 1)})
    mesh.spawn(name)
    await asyncio.to_thread(mesh.wait_ready, 90)


async def run(mesh: Mesh, duration_s: float, clients: int, seed: int, chaos: str,
              every_s: float) -> dict[str, Any]:
    stats: dict[str, Any] = {"outcomes": Counter(), "errors": Counter(), "latency_s": [], "chaos": [], "wrong": [],
                             "migrations": [], "migration_gaps_ms": [], "retries": [], "late_items": 0, "work_left": 0}
    t_start = time.monotonic()
    stop = t_start + duration_s
    rng = random.Random(seed)
    workers = [n for n in mesh.services if n.startswith("worker:")]
    nc = await nats.connect(mesh.nats_url)

    async def on_events(m: Any) -> None:
        for e in decode_events(m.data):
            if e.kind == "migrated":
                stats["migrations"].append(e.detail.get("reason"))
            elif e.kind == "retried":  # re-placed before any token
                stats["retries"].append(e.detail.get("reason"))
            elif e.kind == "handed_over" and e.detail.get("queued"):  # reached a draining worker, handed on at once
                stats["late_items"] += 1
            elif e.kind == "work_left":  # left undelivered on a worker that let go (must not happen)
                stats["work_left"] += int(str(e.detail.get("items", 0)))
            elif e.kind == "migration_resumed":
                stats["migration_gaps_ms"].append(float(str(e.detail["gap_ms"])))

    await nc.subscribe(subjects.EVENTS_ALL, cb=on_events)

    async def client(i: int) -> None:
        r = random.Random(rng.random())
        async with httpx.AsyncClient(base_url=mesh.url, timeout=90) as http:
            while time.monotonic() < stop:
                await one(http, r, stats)

    async def chaos_loop() -> None:
        if chaos == "rolling":  # every worker once, one at a time, spread over the run
            gap = duration_s / (len(workers) + 1)
            for name in workers:
                await asyncio.sleep(max(0.0, t_start + gap * (workers.index(name) + 1) - time.monotonic()))
                await take_away(mesh, name, signal.SIGTERM, stats, t_start)
            return
        sig = signal.SIGKILL if chaos == "kill" else signal.SIGTERM
        k = 0
        while True:
            await asyncio.sleep(max(0.0, t_start + every_s * (k + 1) - time.monotonic()))
            if time.monotonic() >= stop - 1.0:
                return
            await take_away(mesh, workers[k % len(workers)], sig, stats, t_start)
            k += 1

    try:
        await asyncio.gather(chaos_loop(), *(client(i) for i in range(clients)))
        await asyncio.sleep(0.5)  # the last events
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
    return stats


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return round(xs[int(q * (len(xs) - 1))], 3) if xs else None


def in_flight(mesh: Mesh) -> float:
    return scrape(f"{mesh.url}/metrics").get(("hetmesh_gateway_requests_in_flight", ()), float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--clients", type=int, default=8, help="closed-loop clients")
    ap.add_argument("--time-scale", type=float, default=5.0, help="sim engines run this much faster than real time")
    ap.add_argument("--chaos", choices=["kill", "term", "rolling"], default="kill",
                    help="SIGKILL a worker every --every s | SIGTERM (drain) one every --every s | a rolling restart")
    ap.add_argument("--every", type=float, default=30.0, help="seconds between workers taken away (kill, term)")
    ap.add_argument("--drain-timeout", type=float, default=0.25,
                    help="the workers' worker.drain_timeout_s (short: some streams finish, some are handed over)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="", help="default results/soak_<chaos>.json")
    args = ap.parse_args()
    out = args.out or f"results/soak_{args.chaos}.json"
    d = Path(tempfile.mkdtemp(prefix="hetmesh-soak-"))
    (d / "cluster.toml").write_text(CLUSTER.format(time_scale=args.time_scale, drain_timeout_s=args.drain_timeout))
    mport = servers.free_port()
    nats_srv = servers.start_nats(monitor_port=mport)
    monitor = f"http://127.0.0.1:{mport}"
    mesh = Mesh(d / "cluster.toml", gateway_port=0, log_dir=d / "logs", nats_url=nats_srv.url)
    try:
        mesh.start(ready_timeout_s=120)
        start = snapshot(mesh, monitor)
        t0 = time.monotonic()
        stats = asyncio.run(run(mesh, args.duration, args.clients, args.seed, args.chaos, args.every))
        wall = time.monotonic() - t0
        mesh.wait_ready(60)
        time.sleep(3.0)  # let cancels, Finished records and heartbeats settle
        end = snapshot(mesh, monitor)
        left = in_flight(mesh)
    finally:
        mesh.stop()
        nats_srv.stop()
    lat = stats["latency_s"]
    outcomes: Counter[str] = stats["outcomes"]
    total = sum(outcomes.values())
    gaps = stats["migration_gaps_ms"]
    res = {
        "duration_s": args.duration, "wall_s": round(wall, 1), "clients": args.clients, "time_scale": args.time_scale,
        "chaos": args.chaos, "every_s": args.every if args.chaos != "rolling" else None,
        "drain_timeout_s": args.drain_timeout,
        "requests": total, "outcomes": dict(outcomes), "errors": dict(stats["errors"]),
        "latency_p50_s": pct(lat, 0.5), "latency_p99_s": pct(lat, 0.99),
        "migrations": len(stats["migrations"]), "migrations_by_reason": dict(Counter(stats["migrations"])),
        "migration_gap_p50_ms": pct(gaps, 0.5), "migration_gap_p99_ms": pct(gaps, 0.99),
        "retries_by_reason": dict(Counter(stats["retries"])), "late_items_handed_over": stats["late_items"],
        "work_left": stats["work_left"],
        "workers_taken_away": stats["chaos"], "wrong_texts": stats["wrong"][:5],
        "gateway_in_flight_after": left,
        "processes": {name: {"start": start.get(name), "end": end.get(name)} for name in sorted(set(start) | set(end))},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=2) + "\n")
    con = Console()
    exits = Counter(str(c["exit_code"]) for c in stats["chaos"])
    con.print(f"{args.chaos}: {total} requests in {wall:.0f} s, {args.clients} clients: {dict(outcomes)}; "
              f"p50 {res['latency_p50_s']} s, p99 {res['latency_p99_s']} s; errors {dict(stats['errors'])}; "
              f"{len(stats['chaos'])} workers taken away (exit codes {dict(exits)}); {res['migrations']} migrations "
              f"{res['migrations_by_reason']}, pause p50 {res['migration_gap_p50_ms']} ms p99 "
              f"{res['migration_gap_p99_ms']} ms; restarts before a token {res['retries_by_reason']}; items that "
              f"reached a draining worker, handed over at once: {stats['late_items']}; left undelivered: "
              f"{stats['work_left']}; gateway in flight afterwards: {left:g}")
    t = Table("process", "RSS start MB", "RSS end MB", "NATS subs start", "NATS subs end")
    for name, v in res["processes"].items():  # type: ignore[union-attr]
        s, e = v["start"] or {}, v["end"] or {}
        t.add_row(name, str(s.get("rss_mb", "-")), str(e.get("rss_mb", "-")), str(s.get("nats_subs", "-")),
                  str(e.get("nats_subs", "-")))
    con.print(t)
    con.print(f"wrote {out}")


if __name__ == "__main__":
    main()
