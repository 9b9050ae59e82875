"""Mesh overhead benchmark: time-to-first-token the mesh itself adds, and CPU per streamed token.

The sim engine runs at a time scale (1e6) that makes engine time negligible, so what a
client sees as TTFT is the mesh: HTTP + tokenize + block hashes + NATS to the scheduler +
Redis prefix lookup + placement + NATS to the worker + engine loop + NATS back + SSE.
The load generator is a small raw-HTTP/1.1 client (keep-alive pool) so that the client's own
CPU stays small next to the mesh's on a 2-core machine.

    python benchmarks/mesh_overhead.py [--rates 50 500] [--seconds 8] [--out results/mesh_overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hetmesh.launcher import Mesh
from hetmesh.launcher.mesh import temp_log_dir

CLUSTER = """
[mesh]
time_scale = 1000000.0
heartbeat_interval_s = 0.5
[scheduler]
policy = "{policy}"
[[models]]
name = "tiny-sim"
spec = "tiny-llama"
block_size = 16
[[workers]]
name = "h100"
model = "tiny-sim"
accelerator = "nvidia-h100"
role = "both"
count = {workers}
max_batch = 256
"""


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.r, self.w = reader, writer


class RawClient:
    """Just enough HTTP/1.1 for POST + chunked SSE, on a keep-alive pool."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[Conn] = []

    async def _conn(self) -> Conn:
        if self.idle:
            return self.idle.pop()
        r, w = await asyncio.open_connection(self.host, self.port)
        return Conn(r, w)

    async def stream(self, path: str, body: dict[str, object]) -> tuple[float, int]:
        """Returns (seconds to the first content chunk, completion tokens from usage)."""
        data = json.dumps(body).encode()
        c = await self._conn()
        t0 = time.perf_counter()
        c.w.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        head = await c.r.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head[:200])
        ttft = -1.0
        tokens = 0
        while True:
            size = int((await c.r.readuntil(b"\r\n")).strip(), 16)
            if size == 0:
                await c.r.readuntil(b"\r\n")
                break
            chunk = await c.r.readexactly(size + 2)
            for line in chunk.split(b"\n"):
                if not line.startswith(b"data: {"):
                    continue
                if ttft < 0:
                    ttft = time.perf_counter() - t0
                if b'"usage":{' in line:
                    obj = json.loads(line[6:])
                    if obj.get("usage"):
                        tokens = obj["usage"]["completion_tokens"]
        self.idle.append(c)
        return ttft, tokens


def cpu_seconds(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (FileNotFoundError, IndexError):
            pass
    return total


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


async def open_loop(client: RawClient, rate: float, seconds: float, max_tokens: int) -> list[float]:
    rng = random.Random(1)
    ttfts: list[float] = []
    errors = 0

    async def one(i: int) -> None:
        nonlocal errors
        try:
            t, _ = await client.stream("/v1/completions", {"model": "tiny-sim", "prompt": f"request {i} " * 8,
                                                           "max_tokens": max_tokens, "stream": True})
            ttfts.append(t)
        except Exception:
            errors += 1

    tasks = []
    start = time.perf_counter()
    t_next = 0.0
    i = 0
    while t_next < seconds:
        delay = start + t_next - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
        i += 1
        t_next += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    if errors:
        print(f"  {errors} errors at {rate}/s")
    return ttfts


async def closed_loop_tokens(client: RawClient, concurrency: int, seconds: float, max_tokens: int) -> int:
    total = 0
    deadline = time.perf_counter() + seconds

    async def worker(k: int) -> None:
        nonlocal total
        n = 0
        while time.perf_counter() < deadline:
            _, toks = await client.stream("/v1/completions", {
                "model": "tiny-sim", "prompt": f"tokens {k} {n}", "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}})
            total += toks
            n += 1

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return total


async def bench(mesh: Mesh, rates: list[float], seconds: float) -> dict[str, object]:
    client = RawClient(mesh.cfg.gateway.host, mesh.port)
    await open_loop(client, 50, 2, 8)  # warm-up: imports, JIT-free paths, connections
    rows = []
    for rate in rates:
        t = await open_loop(client, rate, seconds, 8)
        rows.append({"rate_rps": rate, "requests": len(t), "ttft_p50_ms": pct(t, 0.5) * 1e3,
                     "ttft_p90_ms": pct(t, 0.9) * 1e3, "ttft_p99_ms": pct(t, 0.99) * 1e3,
                     "ttft_mean_ms": statistics.fmean(t) * 1e3})
    pids = [s.proc.pid for s in mesh.services.values() if s.proc] + [p.proc.pid for p in mesh.started_servers]
    c0 = cpu_seconds(pids)
    w0 = time.perf_counter()
    tokens = await closed_loop_tokens(client, 32, seconds, 256)
    wall = time.perf_counter() - w0
    cpu = cpu_seconds(pids) - c0
    return {"ttft": rows, "stream": {"tokens": tokens, "mesh_cpu_s": cpu, "wall_s": wall,
                                     "cpu_us_per_token": cpu / max(tokens, 1) * 1e6, "tokens_per_s": tokens / wall}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", type=float, nargs="+", default=[50, 500])
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--policy", default="prefix_aware")
    ap.add_argument("--out", default="results/mesh_overhead.json")
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="hetmesh-bench-"))
    (d / "cluster.toml").write_text(CLUSTER.format(workers=args.workers, policy=args.policy))
    mesh = Mesh(d / "cluster.toml", gateway_port=0, log_dir=temp_log_dir())
    mesh.start()
    try:
        res = asyncio.run(bench(mesh, args.rates, args.seconds))
    finally:
        mesh.stop()
    res["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                      "processor": platform.processor() or platform.machine()}
    res["config"] = vars(args)
    table = Table(title=f"Mesh-added TTFT (sim engine at 1e6x, {args.workers} workers, policy {args.policy})")
    for col in ("rate req/s", "requests", "p50 ms", "p90 ms", "p99 ms"):
        table.add_column(col, justify="right")
    for r in res["ttft"]:  # type: ignore[union-attr]
        table.add_row(f"{r['rate_rps']:.0f}", str(r["requests"]), f"{r['ttft_p50_ms']:.2f}",
                      f"{r['ttft_p90_ms']:.2f}", f"{r['ttft_p99_ms']:.2f}")
    con = Console()
    con.print(table)
    s = res["stream"]
    con.print(f"CPU per streamed token across the mesh: {s['cpu_us_per_token']:.1f} us "  # type: ignore[index]
              f"({s['tokens']} tokens, {s['tokens_per_s']:.0f} tok/s, {s['mesh_cpu_s']:.2f} CPU-s)")  # type: ignore[index]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    con.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
