"""The mesh with several schedulers and gateways (active-active): does the placement work split between the
scheduler replicas, and what does sharing their bookings cost?

A mesh started as the tests and `hetmesh up` start it (its own nats-server and redis-server, sim-engine workers
at time_scale 1e6 so the engines cost nothing), then `--schedulers` - 1 more scheduler processes and
`--gateways` - 1 more gateways added as tests/failures/test_active_active.py adds them. The load is
benchmarks/mesh_overhead.py's: its raw-HTTP open-loop client (the requests spread round-robin over the gateways,
as an HTTP load balancer would) and its 8-token streamed completions. At each offered rate it reads each
scheduler's CPU seconds (/proc) and how many requests it placed (its hetmesh_scheduler_placements counter):

- each scheduler's CPU ms per request it placed: flat as replicas are added if the work splits and nothing is
  repeated but the bookings each must fold (every replica applies the others' placements to its view);
- the same less what the scheduler spends with no requests at all (heartbeats, timers: every replica folds every
  worker's heartbeats, a cost that is repeated, not split), measured for a few seconds before the load;
- the sum over schedulers per request: what the whole tier spends on one request; its growth with replicas is the
  cost of sharing bookings;
- each scheduler's share of the placements; the whole mesh's CPU per request and requests/s per core.

`--per-message` first measures what one scheduler (a 1-scheduler mesh, no requests) spends on one message of
each kind that every replica hears whoever placed the request: a BookedBatch of one booking from another
scheduler, a FinishedBatch of one record, a KvEvent of 5 blocks (written to Redis), at `--message-rate` a second;
with the messages each scheduler hears per request (counted during the load), that is where the repeated work goes.

`--max` also raises the offered rate with 1 and 2 schedulers until the mesh falls behind (achieved below 95% of
offered, or errors), and says which process was busiest there: on a 2-core host the gateway, the workers, NATS
and the load client share the same cores, so the host, not the scheduler, sets that ceiling.

    .venv/bin/python benchmarks/mesh_replicas.py [--rates 200 400] [--seconds 8] [--out results/mesh_replicas.json]
    .venv/bin/python benchmarks/mesh_replicas.py --max --max-rates 400 600 800 1000
    .venv/bin/python benchmarks/mesh_replicas.py --per-message --schedulers 1 2 4 --gateways 1 --rates 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import nats
from loadgen import Result, SSEClient, cpu_seconds, cpu_ticks, open_loop, percentile, steal_fraction
from mesh_overhead import CLUSTER, PATH, body, machine
from rich.console import Console
from rich.table import Table

from hetmesh import servers, subjects
from hetmesh.launcher import Mesh
from hetmesh.launcher.mesh import temp_log_dir
from hetmesh.metrics import scrape, total
from hetmesh.protocol import Booked, Finished, KvEvent

IDLE_S = 3.0
HEARD = {"booked": subjects.SCHED_BOOKED, "finished": subjects.FINISHED, "kv": subjects.KV_EVENTS_ALL}


class Spread:
    """Requests round-robin over several gateways (an HTTP load balancer's simplest rule)."""

    def __init__(self, clients: list[SSEClient]) -> None:
        self.clients, self.i = clients, 0
        self.failures: list[str] = []

    async def stream(self, path: str, data: bytes) -> Result:
        self.i += 1
        c = self.clients[self.i % len(self.clients)]
        r = await c.stream(path, data)
        if not r.ok:
            self.failures.extend(c.failures[-1:])
        return r


def code() -> dict[str, str]:
    """Which code the mesh ran: where hetmesh was imported from, its commit, and whether libs/ or services/ had
    changes not committed (a snapshot made by `git archive` has a COMMIT file instead of .git)."""
    import hetmesh

    root = Path(next(iter(hetmesh.__path__))).parent.parent
    git = ["git", "-C", str(root)]
    try:
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--short", "libs", "services"], capture_output=True, text=True).stdout
    except (subprocess.CalledProcessError, OSError):
        f = root / "COMMIT"
        head, dirty = (f.read_text().strip() if f.exists() else "unknown"), ""
    return {"root": str(root), "commit": head, "uncommitted": dirty.split()[1::2]}


def placements(url: str) -> float:
    return total(scrape(url), "hetmesh_scheduler_placements_total")


def ready(urls: list[str], timeout_s: float = 30) -> None:
    """Until every scheduler's /ready answers 200, then a few of its beats more, so the gateways have heard it."""
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready")
            time.sleep(0.2)
    time.sleep(2.0)


def start(schedulers: int, gateways: int, policy: str,
          cluster: str | None = None) -> tuple[Mesh, list[tuple[str, int]], dict[str, str]]:
    """The mesh (`cluster`: its cluster file's text; default two tiny-sim workers and `policy`), its gateways'
    (host, port) and its schedulers' service names -> instance ids."""
    d = Path(tempfile.mkdtemp(prefix="hetmesh-replicas-"))
    (d / "cluster.toml").write_text(cluster if cluster is not None else CLUSTER.format(workers=2, policy=policy))
    mesh = Mesh(d / "cluster.toml", gateway_port=0, log_dir=temp_log_dir(), die_with_parent=True)
    mesh.start()
    cluster = ["--cluster", str(mesh.cluster_path)]
    scheds = {"scheduler": "sched-0"}
    gws = [(mesh.cfg.gateway.host, mesh.port)]
    for i in range(1, schedulers):
        scheds[f"scheduler-{i}"] = f"sched-{i}"
        mesh.add(f"scheduler-{i}", [sys.executable, "-m", "hetmesh.scheduler", *cluster, "--instance", f"sched-{i}"])
        mesh.spawn(f"scheduler-{i}")
    for i in range(1, gateways):
        port = servers.free_port()
        mesh.add(f"gateway-{i}", [sys.executable, "-m", "hetmesh.gateway", *cluster, "--port", str(port),
                                  "--instance", f"gw{i}"])
        mesh.spawn(f"gateway-{i}")
        gws.append(("127.0.0.1", port))
    ready([mesh.metrics_urls()[n].removesuffix("/metrics") + "/ready" for n in scheds])
    return mesh, gws, scheds


async def measure(mesh: Mesh, gws: list[tuple[str, int]], scheds: dict[str, str], rates: list[float],
                  seconds: float) -> list[dict[str, Any]]:
    clients = [SSEClient(h, p) for h, p in gws]
    urls = mesh.metrics_urls()
    for c in clients:
        await c.wait_ready(60)
    load = Spread(clients)
    procs = {n: s.proc.pid for n, s in mesh.services.items() if s.proc}
    procs.update({p.name: p.proc.pid for p in mesh.started_servers})
    heard = dict.fromkeys(HEARD, 0)  # messages on the subjects every scheduler hears, as one of them hears them
    nc = await nats.connect(mesh.nats_url)
    for kind, subject in HEARD.items():
        async def count(_m: Any, k: str = kind) -> None:
            heard[k] += 1
        await nc.subscribe(subject, cb=count)
    await open_loop(load, PATH, 50, 2, body)  # warm-up: imports, connections, caches
    await asyncio.sleep(1.0)
    i0, w0 = {n: cpu_seconds([procs[n]]) for n in scheds}, time.perf_counter()
    await asyncio.sleep(IDLE_S)  # no requests: what each scheduler spends on heartbeats and timers alone
    idle = {n: (cpu_seconds([procs[n]]) - i0[n]) / (time.perf_counter() - w0) for n in scheds}
    rows = []
    for rate in rates:
        p0 = {n: await asyncio.to_thread(placements, urls[n]) for n in scheds}
        c0 = {n: cpu_seconds([pid]) for n, pid in procs.items()}
        h0 = dict(heard)
        w0, k0, me0, l0 = time.perf_counter(), cpu_ticks(), time.process_time(), os.getloadavg()
        res = await open_loop(load, PATH, rate, seconds, body)
        wall = time.perf_counter() - w0
        me = time.process_time() - me0
        cpu = {n: cpu_seconds([pid]) - c0[n] for n, pid in procs.items()}
        placed = {n: await asyncio.to_thread(placements, urls[n]) - p0[n] for n in scheds}
        ok = [r for r in res if r.ok]
        n_ok, total = max(len(ok), 1), max(sum(placed.values()), 1)
        rows.append({
            "rate_rps": rate, "requests": len(res), "errors": len(res) - len(ok), "achieved_rps": len(ok) / wall,
            "ttft_p50_ms": percentile([r.ttft_s for r in ok], 0.5) * 1e3,
            "ttft_p99_ms": percentile([r.ttft_s for r in ok], 0.99) * 1e3,
            "schedulers": {n: {"placed": placed[n], "share": placed[n] / total, "idle_cores": idle[n],
                               "cpu_ms_per_placed": cpu[n] / max(placed[n], 1) * 1e3,
                               "cpu_ms_per_placed_over_idle": (cpu[n] - idle[n] * wall) / max(placed[n], 1) * 1e3}
                           for n in scheds},
            "heard_per_request": {k: (heard[k] - h0[k]) / n_ok for k in HEARD},
            "scheduler_cpu_ms_per_request": sum(cpu[n] for n in scheds) / n_ok * 1e3,
            "gateway_cpu_ms_per_request": sum(v for n, v in cpu.items() if n.startswith("gateway")) / n_ok * 1e3,
            "mesh_cpu_ms_per_request": sum(cpu.values()) / n_ok * 1e3,
            "mesh_cpu_cores": sum(cpu.values()) / wall, "client_cpu_cores": me / wall,
            "requests_per_s_per_mesh_core": len(ok) / max(sum(cpu.values()), 1e-9),
            "busiest": max(cpu, key=lambda n: cpu[n]), "busiest_cores": max(cpu.values()) / wall,
            "cpu_cores_by_process": {n: v / wall for n, v in cpu.items()},
            "host_steal_fraction": steal_fraction(k0, cpu_ticks()), "load_average_start": l0,
            "failures": load.failures[:3]})
        await asyncio.sleep(1.0)
    await nc.close()
    return rows


async def per_message(rate: float, seconds: float, policy: str) -> dict[str, float]:
    """CPU ms one scheduler (1-scheduler mesh, no requests) spends per message of each kind, published at `rate`."""
    mesh, _, _ = start(1, 1, policy)
    pid = mesh.services["scheduler"].proc.pid
    enc = msgspec.json.Encoder()
    kinds = {  # subject, body of message i
        "none (a subject nobody hears)": lambda i: ("hetmesh.nobody", b"[]"),
        "booked": lambda i: (subjects.SCHED_BOOKED, enc.encode([Booked(
            scheduler="sched-peer", request_id=f"r{i}", decode_worker=f"h100-{i % 2}")])),
        "finished": lambda i: (subjects.FINISHED, enc.encode([Finished(
            request_id=f"r{i}", worker_id=f"h100-{i % 2}", finish_reason="length", ts=time.time())])),
        "kv": lambda i: (subjects.kv_events("h100-0"), enc.encode(KvEvent(
            worker_id="h100-0", model="tiny-sim", stored=[random.getrandbits(63) for _ in range(5)]))),
    }
    out: dict[str, float] = {}
    try:
        nc = await nats.connect(mesh.nats_url)
        await nc.publish(subjects.sched_alive("sched-peer"), b"0")  # its bookings count (a peer heard beating)
        for name, make in kinds.items():
            c0, t0, i = cpu_seconds([pid]), time.perf_counter(), 0
            while (elapsed := time.perf_counter() - t0) < seconds:
                i += 1
                await nc.publish(*make(i))
                if i % 50 == 0:
                    await nc.publish(subjects.sched_alive("sched-peer"), b"0")
                await asyncio.sleep(max(0.0, i / rate - elapsed))
            await nc.flush()
            await asyncio.sleep(0.3)
            out[name] = (cpu_seconds([pid]) - c0) / i * 1e3
            Console().print(f"[dim]{name}: {out[name]:.3f} ms of the scheduler's CPU per message ({i} at {rate:.0f}/s)")
        await nc.close()
    finally:
        mesh.stop()
    return out


def run(schedulers: int, gateways: int, rates: list[float], a: argparse.Namespace) -> dict[str, Any]:
    mesh, gws, scheds = start(schedulers, gateways, a.policy)
    try:
        rows = asyncio.run(measure(mesh, gws, scheds, rates, a.seconds))
    finally:
        mesh.stop()
    for r in rows:
        Console().print(f"[dim]{schedulers} sched, {gateways} gw, {r['rate_rps']:.0f} req/s: achieved "
                        f"{r['achieved_rps']:.0f}, sched {r['scheduler_cpu_ms_per_request']:.3f} ms/req, mesh "
                        f"{r['mesh_cpu_cores']:.2f} cores, load {r['load_average_start'][0]:.1f}")
    return {"schedulers": schedulers, "gateways": gateways, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", type=float, nargs="+", default=[200, 400])
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--schedulers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--gateways", type=int, nargs="+", default=[1, 2])
    # not cost: its SLO-aware admission runs on the engines' clock, 1e6x wall here, so a millisecond's queueing
    # reads as a thousand seconds and it refuses
    ap.add_argument("--policy", default="prefix_aware")
    ap.add_argument("--repeats", type=int, default=1, help="each layout this many times, alternated")
    ap.add_argument("--max", action="store_true", help="also the highest rate sustained with 1 and 2 schedulers")
    ap.add_argument("--max-rates", type=float, nargs="+", default=[400, 600, 800, 1000])
    ap.add_argument("--per-message", action="store_true", help="also one scheduler's CPU per message of each kind")
    ap.add_argument("--message-rate", type=float, default=400)
    ap.add_argument("--out", default="results/mesh_replicas.json")
    a = ap.parse_args()
    t0, load0 = time.time(), os.getloadavg()
    msg_ms = asyncio.run(per_message(a.message_rate, 5.0, a.policy)) if a.per_message else {}
    layouts = [(s, g) for g in a.gateways for s in a.schedulers]
    runs = [run(s, g, a.rates, a) for _ in range(a.repeats) for s, g in layouts]
    ceiling = [run(s, 2, a.max_rates, a) for s in (1, 2)] if a.max else []

    con = Console(width=160)
    table = Table(title=f"Scheduler replicas on the live mesh (sim engines at 1e6x, 2 workers, policy {a.policy}, "
                        f"{os.cpu_count()} cores)")
    for c in ("scheds", "gws", "req/s", "achieved", "errors", "ms CPU / placed, each", "same, over idle",
              "idle cores, each", "share placed, each",
              "sched sum ms/req", "heard/req: booked finished kv", "gateway ms/req", "mesh ms/req", "req/s per mesh core", "TTFT p50 / p99 ms", "load"):
        table.add_column(c, justify="right")
    for r in runs:
        for x in r["rows"]:
            s = x["schedulers"].values()
            table.add_row(str(r["schedulers"]), str(r["gateways"]), f"{x['rate_rps']:.0f}", f"{x['achieved_rps']:.0f}",
                          str(x["errors"]), " ".join(f"{v['cpu_ms_per_placed']:.3f}" for v in s),
                          " ".join(f"{v['cpu_ms_per_placed_over_idle']:.3f}" for v in s),
                          " ".join(f"{v['idle_cores']:.3f}" for v in s),
                          " ".join(f"{v['share']:.2f}" for v in s), f"{x['scheduler_cpu_ms_per_request']:.3f}",
                          " ".join(f"{v:.2f}" for v in x["heard_per_request"].values()),
                          f"{x['gateway_cpu_ms_per_request']:.3f}", f"{x['mesh_cpu_ms_per_request']:.2f}",
                          f"{x['requests_per_s_per_mesh_core']:.0f}",
                          f"{x['ttft_p50_ms']:.1f} / {x['ttft_p99_ms']:.1f}", f"{x['load_average_start'][0]:.1f}")
    con.print(table)
    if msg_ms:
        con.print("One scheduler's CPU per message heard (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in msg_ms.items()))
    if ceiling:
        mt = Table(title="Highest offered rate, 2 gateways (the mesh falls behind: achieved < 95% or errors)")
        for c in ("scheds", "req/s", "achieved", "errors", "TTFT p99 ms", "mesh cores", "client cores", "busiest",
                  "its cores"):
            mt.add_column(c, justify="right")
        for r in ceiling:
            for x in r["rows"]:
                mt.add_row(str(r["schedulers"]), f"{x['rate_rps']:.0f}", f"{x['achieved_rps']:.0f}", str(x["errors"]),
                           f"{x['ttft_p99_ms']:.1f}", f"{x['mesh_cpu_cores']:.2f}", f"{x['client_cpu_cores']:.2f}",
                           x["busiest"], f"{x['busiest_cores']:.2f}")
        con.print(mt)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({
        "machine": machine(), "code": code(), "load_average_start": load0, "load_average_end": os.getloadavg(),
        "command": "python benchmarks/mesh_replicas.py " + " ".join(sys.argv[1:]), "config": vars(a),
        "wall_s": time.time() - t0, "cpu_ms_per_message": msg_ms, "runs": runs, "ceiling": ceiling}, indent=1))
    con.print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
