"""Mesh overhead benchmark: time-to-first-token the mesh itself adds, and CPU per streamed token.

The sim engine runs at a time scale (1e6) that makes engine time negligible, so what a
client sees as TTFT is the mesh: HTTP + tokenize + block hashes + NATS to the scheduler +
Redis prefix lookup + placement + NATS to the worker + engine loop + NATS back + SSE.
The load generator is a small raw-HTTP/1.1 client (keep-alive pool) so that the client's own
CPU stays small next to the mesh's on a 2-core machine.

    python benchmarks/mesh_overhead.py [--rates 50 500] [--seconds 8] [--out results/mesh_overhead.json]
    python benchmarks/mesh_overhead.py --tracing --out results/mesh_overhead_tracing.json
    python benchmarks/mesh_overhead.py --pd --rates 50 200 --seconds 10 --out results/mesh_overhead_pd.json

--pd measures a disaggregated pair instead (one prefill worker, one decode worker, kv-transfer on the
direct data plane): TTFT (the prefill worker's token), the time to the second token (the decode
worker's first, which waits for the KV), the whole request, and the KV hand-over as the workers'
events date it (prefill_done -> kv_landed).

--flow compares flow control on ([[tenants]]: six tenants in two bands, each request naming the next in the
tenant header) with off (the same header, ignored), in fresh meshes alternated --repeats times: the --rates on the
mesh above (SLO-aware admission off: nothing is held or refused), then a full fleet (one real-time Llama-3.1-8B
H100 sim worker, max_batch 8, TTFT SLO 1 s) offered --full-rate, about twice what it serves, so that requests are
held and refused in both (without flow control, by admission's own hold). It reports the scheduler's and the
gateway's CPU per request offered:

    python benchmarks/mesh_overhead.py --flow --policy cost --out results/mesh_overhead_flow.json

--tracing turns OpenTelemetry on in every service (OTEL_EXPORTER_OTLP_ENDPOINT), exporting every
span to an OTLP/HTTP receiver in its own process (like Jaeger's; its CPU is not the mesh's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadgen import (
    SSEClient,
    closed_loop,
    cpu_seconds,
    cpu_ticks,
    open_loop,
    percentile,
    steal_fraction,
)
from rich.console import Console
from rich.table import Table

from hetmesh import subjects
from hetmesh.bus import decode_events
from hetmesh.launcher import Mesh
from hetmesh.launcher.mesh import temp_log_dir

PATH = "/v1/completions"

HEADER = """
[mesh]
time_scale = 1000000.0
heartbeat_interval_s = 0.5
[scheduler]
policy = "{policy}"
[[models]]
name = "tiny-sim"
spec = "tiny-llama"
block_size = 16
"""

CLUSTER = HEADER + """
[[workers]]
name = "h100"
model = "tiny-sim"
accelerator = "nvidia-h100"
role = "both"
count = {workers}
max_batch = 256
"""

PD_CLUSTER = HEADER + """
[[workers]]
name = "cpx"
model = "tiny-sim"
accelerator = "nvidia-rubin-cpx"
role = "prefill"
max_batch = 256
[[workers]]
name = "vr200"
model = "tiny-sim"
accelerator = "nvidia-rubin-vr200"
role = "decode"
max_batch = 256
"""


# --flow: the same mesh with flow control on (the header names each request's tenant, in turn), and a full fleet.
TENANTS = (("gold", 2.0, "high"), ("silver", 1.0, "high"), ("a", 1.0, "low"), ("b", 1.0, "low"), ("c", 2.0, "low"),
           ("d", 4.0, "low"))
FLOW = '\n[flow]\nbands = ["high", "low"]\nheader = "x-hetmesh-tenant"\n' + "".join(
    f'[[tenants]]\nname = "{n}"\nweight = {w}\npriority = "{b}"\n' for n, w, b in TENANTS)

# One Llama-3.1-8B H100 sim worker in real time (time_scale 1), small batches: offered past its capacity, the
# cost policy's admission (or flow control) holds requests and refuses those that would miss the TTFT SLO.
FULL_CLUSTER = """
[mesh]
time_scale = 1.0
heartbeat_interval_s = 0.5
[scheduler]
policy = "cost"
ttft_slo_s = {ttft_slo}
tpot_slo_s = 0.1
[[models]]
name = "tiny-sim"
spec = "llama-3.1-8b"
max_context = 32768
block_size = 16
[[workers]]
name = "h100"
model = "tiny-sim"
accelerator = "nvidia-h100"
role = "both"
count = 1
max_batch = {max_batch}
"""


def full_body(i: int) -> bytes:
    # A unique head: no prefix hits; 1,000 prompt tokens (byte tokenizer), 32 out.
    return json.dumps({"model": "tiny-sim", "prompt": f"request {i} " + "x" * 1000, "max_tokens": 32,
                       "ignore_eos": True, "stream": True}).encode()


class TenantClient(SSEClient):
    """Names the next tenant, in turn, in the flow header of each request. loadgen's client sends no headers of
    its own, so the header rides after the path in the request line (POST <path> HTTP/1.1 CRLF header ...)."""

    turn = 0

    async def stream(self, path: str, body: bytes) -> Any:
        self.turn += 1
        tenant = TENANTS[self.turn % len(TENANTS)][0]
        return await super().stream(f"{path} HTTP/1.1\r\nx-hetmesh-tenant: {tenant}\r\nx-path:", body)


def body(i: int) -> bytes:
    return json.dumps({"model": "tiny-sim", "prompt": f"request {i} " * 8, "max_tokens": 8, "stream": True}).encode()


def stream_body(k: int, n: int) -> bytes:
    return json.dumps({"model": "tiny-sim", "prompt": f"tokens {k} {n}", "max_tokens": 256, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()


def pd_body(i: int) -> bytes:
    # ignore_eos: every request has a second token, the decode worker's first.
    return json.dumps({"model": "tiny-sim", "prompt": f"request {i} " * 8, "max_tokens": 8, "stream": True,
                       "ignore_eos": True}).encode()


async def bench_pd(mesh: Mesh, rates: list[float], seconds: float) -> dict[str, object]:
    """Disaggregated requests only: what the client sees of the prefill -> KV -> decode hand-over, and the
    hand-over itself from the workers' own events (prefill_done on the prefill worker to kv_landed on the
    decode worker: one host, one clock), which the gateway and the client's share of the CPU do not blur."""
    import nats

    client = SSEClient(mesh.cfg.gateway.host, mesh.port, second_token=True)
    procs = {name: s.proc.pid for name, s in mesh.services.items() if s.proc}
    stamps: dict[str, dict[str, float]] = {}  # request id -> event kind -> its ts

    async def on_events(m: Any) -> None:
        for e in decode_events(m.data):
            if e.kind in ("prefill_done", "kv_landed"):
                stamps.setdefault(e.request_id, {})[e.kind] = e.ts

    nc = await nats.connect(mesh.nats_url)
    await nc.subscribe(subjects.EVENTS_ALL, cb=on_events)
    await open_loop(client, PATH, 50, 2, pd_body)  # warm-up
    rows = []
    for rate in rates:
        await asyncio.sleep(0.5)  # the warm-up's (or the previous rate's) batched events are in
        stamps.clear()
        c0, w0, k0 = cpu_seconds(list(procs.values())), time.perf_counter(), cpu_ticks()
        res = await open_loop(client, PATH, rate, seconds, pd_body)
        cpu, wall = cpu_seconds(list(procs.values())) - c0, time.perf_counter() - w0
        await asyncio.sleep(0.5)  # the last events travel batched
        ok = [r for r in res if r.ok and r.second_s > 0]
        first, second, total = [r.ttft_s for r in ok], [r.second_s for r in ok], [r.total_s for r in ok]
        handover = [d["kv_landed"] - d["prefill_done"] for d in stamps.values() if len(d) == 2]
        row: dict[str, object] = {"rate_rps": rate, "requests": len(res), "errors": len(res) - len(ok),
                                  "achieved_rps": len(res) / wall, "mesh_cpu_ms_per_request": cpu / max(len(ok), 1) * 1e3,
                                  "host_steal_fraction": steal_fraction(k0, cpu_ticks()), "handovers": len(handover)}
        for name, xs in (("ttft", first), ("second_token", second), ("e2e", total), ("kv_handover", handover)):
            for q in (0.5, 0.9, 0.99):
                row[f"{name}_p{int(q * 100)}_ms"] = percentile(xs, q) * 1e3
            row[f"{name}_mean_ms"] = statistics.fmean(xs) * 1e3 if xs else float("nan")
        rows.append(row)
    await nc.close()
    return {"pd": rows, "failures": client.failures[:5]}

ECHO = """
import asyncio, sys, nats
async def main():
    nc = await nats.connect(sys.argv[1])
    async def echo(m):
        await m.respond(m.data)
    await nc.subscribe("bench.echo", cb=echo)
    await asyncio.Event().wait()
asyncio.run(main())
"""


async def echo_baseline(nats_url: str, rate: float, seconds: float) -> dict[str, float]:
    """The floor one mesh hop pays here: a NATS request/reply through a do-nothing Python responder
    in another process, paced like the open-loop load (the mesh's first token takes ~2 such round trips)."""
    import nats

    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", ECHO, nats_url)
    nc = await nats.connect(nats_url)
    try:
        for _ in range(100):
            try:
                await nc.request("bench.echo", b"x", timeout=0.5)
                break
            except Exception:
                await asyncio.sleep(0.1)
        rtts: list[float] = []
        payload = b"x" * 700  # about an InferenceRequest
        for _ in range(int(rate * seconds)):
            t0 = time.perf_counter()
            await nc.request("bench.echo", payload, timeout=2)
            rtts.append(time.perf_counter() - t0)
            await asyncio.sleep(1 / rate)
    finally:
        await nc.close()
        proc.kill()
        await proc.wait()
    return {"rate_rps": rate, "rtt_p50_ms": percentile(rtts, 0.5) * 1e3, "rtt_p99_ms": percentile(rtts, 0.99) * 1e3}


SINK = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
s = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def mesh_pids(mesh: Mesh) -> dict[str, int]:
    procs = {name: s.proc.pid for name, s in mesh.services.items() if s.proc}
    procs.update({p.name: p.proc.pid for p in mesh.started_servers})
    return procs


async def rate_row(client: SSEClient, procs: dict[str, int], rate: float, seconds: float,
                   body: Any) -> dict[str, Any]:
    """One open loop at `rate`: TTFT of the requests served, and the mesh's CPU per request served, per process."""
    pids = list(procs.values())
    each0 = {name: cpu_seconds([pid]) for name, pid in procs.items()}
    c0, w0, k0 = cpu_seconds(pids), time.perf_counter(), cpu_ticks()
    res = await open_loop(client, PATH, rate, seconds, body)
    cpu, wall = cpu_seconds(pids) - c0, time.perf_counter() - w0
    steal = steal_fraction(k0, cpu_ticks())
    t = [r.ttft_s for r in res if r.ok]
    per_process = {name: (cpu_seconds([pid]) - each0[name]) / max(len(t), 1) * 1e3 for name, pid in procs.items()}
    return {"rate_rps": rate, "requests": len(res), "errors": len(res) - len(t),
            "achieved_rps": len(res) / wall, "ttft_p50_ms": percentile(t, 0.5) * 1e3,
            "ttft_p90_ms": percentile(t, 0.9) * 1e3, "ttft_p99_ms": percentile(t, 0.99) * 1e3,
            "ttft_mean_ms": statistics.fmean(t) * 1e3 if t else float("nan"),
            "mesh_cpu_ms_per_request": cpu / max(len(t), 1) * 1e3,
            "mesh_cpu_cores": cpu / wall, "cpu_ms_per_request_by_process": per_process,
            "host_steal_fraction": steal}


async def bench(mesh: Mesh, rates: list[float], seconds: float) -> dict[str, object]:
    client = SSEClient(mesh.cfg.gateway.host, mesh.port)
    procs = mesh_pids(mesh)
    pids = list(procs.values())
    await open_loop(client, PATH, 50, 2, body)  # warm-up: imports, connections, caches
    rows = [await rate_row(client, procs, rate, seconds, body) for rate in rates]
    c0, w0 = cpu_seconds(pids), time.perf_counter()
    res = await closed_loop(client, PATH, 32, seconds, stream_body)
    wall, cpu = time.perf_counter() - w0, cpu_seconds(pids) - c0
    tokens = sum(r.completion_tokens for r in res)
    baseline = await echo_baseline(mesh.nats_url, 50, min(seconds, 5))
    for row in rows:
        row["ttft_p50_over_echo_rtt"] = row["ttft_p50_ms"] / baseline["rtt_p50_ms"]
    return {"ttft": rows, "echo_baseline": baseline, "stream": {"tokens": tokens, "requests": len(res), "mesh_cpu_s": cpu, "wall_s": wall,
                                     "cpu_us_per_token": cpu / max(tokens, 1) * 1e6, "tokens_per_s": tokens / wall}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", type=float, nargs="+", default=[50, 500])
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--policy", default="prefix_aware")
    ap.add_argument("--no-learn", action="store_true", help="the cost policy prices every worker at its prior")
    ap.add_argument("--out", default="results/mesh_overhead.json")
    ap.add_argument("--tracing", action="store_true", help="every service exports its spans over OTLP")
    ap.add_argument("--pd", action="store_true", help="a prefill worker + a decode worker instead (P/D rows)")
    ap.add_argument("--flow", action="store_true", help="flow control on vs off, alternated, and a full fleet")
    ap.add_argument("--repeats", type=int, default=3, help="--flow: on/off pairs per case")
    ap.add_argument("--full-rate", type=float, default=20, help="--flow: req/s offered to the full fleet")
    ap.add_argument("--full-seconds", type=float, default=15)
    ap.add_argument("--full-ttft-slo", type=float, default=1.0)
    ap.add_argument("--full-max-batch", type=int, default=8)
    args = ap.parse_args()
    if args.flow:
        main_flow(args)
        return
    if args.pd:
        main_pd(args)
        return
    d = Path(tempfile.mkdtemp(prefix="hetmesh-bench-"))
    learn = "\n[scheduler.options]\nlearn = false\n" if args.no_learn else ""
    (d / "cluster.toml").write_text(CLUSTER.format(workers=args.workers, policy=args.policy) + learn)
    env: dict[str, str] = {}
    sink = None
    if args.tracing:
        sink = subprocess.Popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
        assert sink.stdout is not None
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{sink.stdout.readline().strip()}"
    mesh = Mesh(d / "cluster.toml", gateway_port=0, log_dir=temp_log_dir(), env=env)
    mesh.start()
    try:
        res = asyncio.run(bench(mesh, args.rates, args.seconds))
        if sink is not None:
            res["otlp_receiver_cpu_s"] = cpu_seconds([sink.pid])
    finally:
        mesh.stop()
        if sink is not None:
            sink.kill()
    res["machine"] = machine()
    res["config"] = vars(args)
    tracing = "tracing on" if args.tracing else "tracing off"
    table = Table(title=f"Mesh-added TTFT (sim engine at 1e6x, {args.workers} workers, policy {args.policy}, {tracing})")
    for col in ("offered req/s", "achieved", "requests", "errors", "p50 ms", "p90 ms", "p99 ms", "mesh CPU ms/req",
                "steal %"):
        table.add_column(col, justify="right")
    for r in res["ttft"]:  # type: ignore[union-attr]
        table.add_row(f"{r['rate_rps']:.0f}", f"{r['achieved_rps']:.0f}", str(r["requests"]), str(r["errors"]),
                      f"{r['ttft_p50_ms']:.2f}", f"{r['ttft_p90_ms']:.2f}", f"{r['ttft_p99_ms']:.2f}",
                      f"{r['mesh_cpu_ms_per_request']:.2f}", f"{r['host_steal_fraction'] * 100:.0f}")
    con = Console(width=120)
    con.print(table)
    ptable = Table(title="Mesh CPU per request by process (ms)")
    ptable.add_column("process")
    for r in res["ttft"]:  # type: ignore[union-attr]
        ptable.add_column(f"{r['rate_rps']:.0f} req/s", justify="right")
    for name in res["ttft"][0]["cpu_ms_per_request_by_process"]:  # type: ignore[index]
        ptable.add_row(name, *(f"{r['cpu_ms_per_request_by_process'][name]:.3f}" for r in res["ttft"]))  # type: ignore[union-attr]
    con.print(ptable)
    b = res["echo_baseline"]
    con.print(f"Baseline, same machine and nats-server: Python NATS request/reply echo p50 {b['rtt_p50_ms']:.2f} ms, "  # type: ignore[index]
              f"p99 {b['rtt_p99_ms']:.2f} ms; mesh p50 TTFT = "  # type: ignore[index]
              + ", ".join(f"{r['ttft_p50_over_echo_rtt']:.1f}x" for r in res["ttft"]) + " that round trip")  # type: ignore[union-attr]
    s = res["stream"]
    con.print(f"CPU per streamed token across the mesh: {s['cpu_us_per_token']:.1f} us "  # type: ignore[index]
              f"({s['tokens']} tokens, {s['tokens_per_s']:.0f} tok/s, {s['mesh_cpu_s']:.2f} CPU-s)")  # type: ignore[index]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    con.print(f"wrote {args.out}")


async def flow_rates(mesh: Mesh, rates: list[float], seconds: float, body: Any, warm_rps: float,
                     full: bool) -> list[dict]:
    client = TenantClient(mesh.cfg.gateway.host, mesh.port)
    procs = mesh_pids(mesh)
    await open_loop(client, PATH, warm_rps, 2, body)  # warm-up: imports, connections, caches
    rows = []
    for rate in rates:
        load = os.getloadavg()[0]
        row = await rate_row(client, procs, rate, seconds, body)
        served = row["requests"] - row["errors"]
        for name in ("scheduler", "gateway"):  # per request offered: in the full case most are refused
            row[f"{name}_cpu_ms_per_offered"] = row["cpu_ms_per_request_by_process"][name] * served / row["requests"]
        # Kept up: the host let the mesh serve the rate (the full fleet is saturated by design).
        rows.append({**row, "load_average_1m": load, "failures": client.failures[:3],
                     "kept_up": full or row["achieved_rps"] >= 0.9 * rate})
        client.failures.clear()
    return rows


def flow_run(text: str, flow: bool, rates: list[float], seconds: float, body: Any, warm_rps: float,
             full: bool) -> list[dict]:
    d = Path(tempfile.mkdtemp(prefix="hetmesh-bench-"))
    (d / "cluster.toml").write_text(text + (FLOW if flow else ""))
    mesh = Mesh(d / "cluster.toml", gateway_port=0, log_dir=temp_log_dir())
    mesh.start()
    try:
        return asyncio.run(flow_rates(mesh, rates, seconds, body, warm_rps, full))
    finally:
        mesh.stop()


def main_flow(args: argparse.Namespace) -> None:
    """Flow control on vs off in fresh meshes, alternated `--repeats` times: the rates on the fast mesh, then a
    full fleet (`--full-rate`, about twice its capacity), where requests are held and refused with flow control
    (the fair queue) and without it (admission's own hold)."""
    # Admission off on the fast mesh: at time_scale 1e6 a millisecond's wait on the host is 1,000 s of engine time,
    # so at 500 req/s the cost policy refuses a share of requests that swings with the host's load.
    fast = CLUSTER.format(workers=args.workers, policy=args.policy).replace(
        "[scheduler]\n", "[scheduler]\nadmission_margin = 0.0\n", 1)
    full = FULL_CLUSTER.format(ttft_slo=args.full_ttft_slo, max_batch=args.full_max_batch)
    runs: list[dict[str, Any]] = []
    for case, text, rates, secs, body, warm in (("fast", fast, args.rates, args.seconds, globals()["body"], 50),
                                                ("full", full, [args.full_rate], args.full_seconds, full_body, 5)):
        for rep in range(args.repeats):
            for flow in (True, False) if rep % 2 == 0 else (False, True):  # on, off, off, on, ...: no order bias
                rows = flow_run(text, flow, rates, secs, body, warm, case == "full")
                runs.append({"case": case, "flow": flow, "repeat": rep, "rows": rows})
                print(case, "flow" if flow else "off", [(r["rate_rps"], r["errors"], round(r["scheduler_cpu_ms_per_offered"], 3))
                                                        for r in rows], flush=True)
    summary = []
    for case, rate in [("fast", r) for r in args.rates] + [("full", args.full_rate)]:
        pick = {f: [row for run in runs if run["case"] == case and run["flow"] == f for row in run["rows"]
                    if row["rate_rps"] == rate] for f in (True, False)}
        s: dict[str, Any] = {"case": case, "rate_rps": rate, "refused_share": {
            f"{'on' if f else 'off'}": [r["errors"] / r["requests"] for r in rows] for f, rows in pick.items()}}
        kept = [(a, b) for a, b in zip(pick[True], pick[False], strict=True) if a["kept_up"] and b["kept_up"]]
        s["pairs_kept_up"] = f"{len(kept)}/{len(pick[True])}"
        for name in ("scheduler", "gateway"):
            on, off = [a[f"{name}_cpu_ms_per_offered"] for a, _ in kept], [b[f"{name}_cpu_ms_per_offered"] for _, b in kept]
            s[name] = {"on_ms": on, "off_ms": off, "pair_ratios": [a / b for a, b in zip(on, off, strict=True)],
                       "on_over_off": statistics.fmean(on) / statistics.fmean(off) if kept else float("nan")}
        summary.append(s)
    table = Table(title=f"Flow control's CPU per request offered (ms), on vs off, alternated x{args.repeats}")
    for col in ("case", "req/s", "pairs kept up", "refused on/off", "scheduler on", "off", "on/off", "pairs", "gateway on", "off",
                "on/off"):
        table.add_column(col, justify="right")
    for s in summary:
        ref = "/".join(f"{statistics.fmean(s['refused_share'][k]) * 100:.0f}%" for k in ("on", "off"))
        sc, gw = s["scheduler"], s["gateway"]
        table.add_row(s["case"], f"{s['rate_rps']:.0f}", s["pairs_kept_up"], ref, " ".join(f"{x:.3f}" for x in sc["on_ms"]),
                      " ".join(f"{x:.3f}" for x in sc["off_ms"]), f"{sc['on_over_off']:.3f}",
                      " ".join(f"{x:.2f}" for x in sc["pair_ratios"]), " ".join(f"{x:.3f}" for x in gw["on_ms"]),
                      " ".join(f"{x:.3f}" for x in gw["off_ms"]), f"{gw['on_over_off']:.3f}")
    Console(width=160).print(table)
    loads = [row["load_average_1m"] for run in runs for row in run["rows"]]
    res = {"command": " ".join(sys.argv), "summary": summary, "load_average_1m": [min(loads), max(loads)],
           "runs": runs, "machine": machine(), "config": vars(args)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"wrote {args.out}")


def machine() -> dict[str, object]:
    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(), "cpu_model": cpu}


def main_pd(args: argparse.Namespace) -> None:
    d = Path(tempfile.mkdtemp(prefix="hetmesh-bench-"))
    (d / "cluster.toml").write_text(PD_CLUSTER.format(policy=args.policy))
    mesh = Mesh(d / "cluster.toml", gateway_port=0, log_dir=temp_log_dir())
    mesh.start()
    try:
        res = asyncio.run(bench_pd(mesh, args.rates, args.seconds))
    finally:
        mesh.stop()
    res["machine"] = machine()
    res["config"] = vars(args)
    table = Table(title="Disaggregated (P/D) request through the mesh (sim engine at 1e6x, cpx prefill -> vr200 decode)")
    for col in ("offered req/s", "requests", "errors", "TTFT p50", "p90", "p99", "2nd token p50", "p90", "p99",
                "KV hand-over p50", "p90", "e2e p50", "CPU ms/req"):
        table.add_column(col, justify="right")
    for r in res["pd"]:  # type: ignore[union-attr]
        table.add_row(f"{r['rate_rps']:.0f}", str(r["requests"]), str(r["errors"]),
                      *(f"{r[k]:.2f}" for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "second_token_p50_ms",
                                                "second_token_p90_ms", "second_token_p99_ms", "kv_handover_p50_ms",
                                                "kv_handover_p90_ms", "e2e_p50_ms", "mesh_cpu_ms_per_request")))
    con = Console(width=140)
    con.print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    con.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
