"""Bounded soak on loopback: a whole mesh (gateway, scheduler, kv-transfer, sim workers as separate
processes) under a closed loop of mixed streaming and non-streaming requests, with random client
cancels and one worker SIGKILLed (and brought back) half way. Prints a table and writes
results/soak.json: requests, outcomes, errors by code, p50/p99 latency, and per process the RSS
and NATS subscriptions at the start and the end, plus the gateway's in-flight gauge once the load
has stopped (what would show a leaked request, subscription or memory growth).

    .venv/bin/python benchmarks/soak.py --duration 240 --clients 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import statistics
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from hetmesh import servers
from hetmesh.launcher import Mesh

CLUSTER = """
[mesh]
time_scale = {time_scale}
heartbeat_interval_s = 0.2
heartbeat_timeout_s = 1.0
stall_timeout_s = 30.0

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

[[workers]]
name = "vr200"
model = "pd"
accelerator = "nvidia-rubin-vr200"
role = "decode"
"""

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


async def one(http: httpx.AsyncClient, rng: random.Random, stats: dict[str, object]) -> None:
    model = rng.choice(["agg", "agg", "pd"])
    stream = rng.random() < 0.5
    cancel = stream and rng.random() < 0.15
    prompt = rng.choice(PREFIXES) + f"request {rng.randrange(10**6)}"
    body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(8, 128), "stream": stream,
            "ignore_eos": rng.random() < 0.5}
    outcomes: Counter[str] = stats["outcomes"]  # type: ignore[assignment]
    errors: Counter[str] = stats["errors"]  # type: ignore[assignment]
    lat: list[float] = stats["latency_s"]  # type: ignore[assignment]
    t0 = time.perf_counter()
    try:
        if not stream:
            r = await http.post("/v1/completions", json=body)
            if r.status_code == 200:
                outcomes["ok"] += 1
                lat.append(time.perf_counter() - t0)
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
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    outcomes["ok"] += 1
                    lat.append(time.perf_counter() - t0)
                    return
                payload = json.loads(line[6:])
                if "error" in payload:
                    outcomes["error"] += 1
                    errors[f"stream {payload['error'].get('code')}"] += 1
                    return
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


async def run(mesh: Mesh, duration_s: float, clients: int, seed: int, kill_at: float) -> dict[str, object]:
    stats: dict[str, object] = {"outcomes": Counter(), "errors": Counter(), "latency_s": []}
    stop = time.monotonic() + duration_s
    rng = random.Random(seed)

    async def client(i: int) -> None:
        r = random.Random(rng.random())
        async with httpx.AsyncClient(base_url=mesh.url, timeout=90) as http:
            while time.monotonic() < stop:
                await one(http, r, stats)

    async def chaos() -> None:
        await asyncio.sleep(duration_s * kill_at)
        mesh.kill("worker:h100-0")
        stats["killed"] = {"service": "worker:h100-0", "at_s": round(duration_s * kill_at, 1)}
        await asyncio.sleep(5)
        mesh.spawn("worker:h100-0")

    await asyncio.gather(chaos(), *(client(i) for i in range(clients)))
    return stats


def in_flight(mesh: Mesh) -> float:
    with urllib.request.urlopen(f"{mesh.url}/metrics", timeout=5) as r:
        m = re.search(rb"^hetmesh_gateway_requests_in_flight (\S+)$", r.read(), re.M)
    return float(m.group(1)) if m else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=240.0, help="seconds of load")
    ap.add_argument("--clients", type=int, default=8, help="closed-loop clients")
    ap.add_argument("--time-scale", type=float, default=5.0, help="sim engines run this much faster than real time")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="results/soak.json")
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="hetmesh-soak-"))
    (d / "cluster.toml").write_text(CLUSTER.format(time_scale=args.time_scale))
    mport = servers.free_port()
    nats_srv = servers.start_nats(monitor_port=mport)
    monitor = f"http://127.0.0.1:{mport}"
    mesh = Mesh(d / "cluster.toml", gateway_port=0, log_dir=d / "logs", nats_url=nats_srv.url)
    try:
        mesh.start(ready_timeout_s=120)
        start = snapshot(mesh, monitor)
        t0 = time.monotonic()
        stats = asyncio.run(run(mesh, args.duration, args.clients, args.seed, kill_at=0.5))
        wall = time.monotonic() - t0
        mesh.wait_ready(60)
        time.sleep(3.0)  # let cancels, Finished records and heartbeats settle
        end = snapshot(mesh, monitor)
        left = in_flight(mesh)
    finally:
        mesh.stop()
        nats_srv.stop()
    lat = sorted(stats["latency_s"])  # type: ignore[arg-type]
    outcomes: Counter[str] = stats["outcomes"]  # type: ignore[assignment]
    total = sum(outcomes.values())
    res = {
        "duration_s": args.duration, "wall_s": round(wall, 1), "clients": args.clients, "time_scale": args.time_scale,
        "requests": total, "outcomes": dict(outcomes), "errors": dict(stats["errors"]),  # type: ignore[arg-type]
        "latency_p50_s": round(statistics.median(lat), 3) if lat else None,
        "latency_p99_s": round(lat[int(0.99 * (len(lat) - 1))], 3) if lat else None,
        "gateway_in_flight_after": left, "killed": stats.get("killed"),
        "processes": {name: {"start": start.get(name), "end": end.get(name)} for name in sorted(set(start) | set(end))},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    con = Console()
    con.print(f"{total} requests in {wall:.0f} s, {args.clients} clients: {dict(outcomes)}; "
              f"p50 {res['latency_p50_s']} s, p99 {res['latency_p99_s']} s; errors {dict(stats['errors'])}; "  # type: ignore[arg-type]
              f"gateway in flight afterwards: {left:g}")
    t = Table("process", "RSS start MB", "RSS end MB", "NATS subs start", "NATS subs end")
    for name, v in res["processes"].items():  # type: ignore[union-attr]
        s, e = v["start"] or {}, v["end"] or {}
        t.add_row(name, str(s.get("rss_mb", "-")), str(e.get("rss_mb", "-")), str(s.get("nats_subs", "-")),
                  str(e.get("nats_subs", "-")))
    con.print(t)
    con.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
