"""Gateway overhead benchmark: `python benchmarks/gateway_overhead.py [--rates 50,500] [--out FILE]`.

A real nats-server and a real gateway process; behind them an instant peer (scheduler +
worker stand-in in its own process) that places every request at once and streams its tokens
with no engine time. So the client's time to first token is the gateway's own cost plus two
NATS hops, and the gateway's CPU time divided by streamed tokens is its cost per token.
The load is open-loop (fixed arrival times) from a minimal raw-socket HTTP client, so the
client's overhead stays small on a 2-core machine. Prints a table, writes a JSON results file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadgen import SSEClient, cpu_seconds, open_loop, percentile
from nats.aio.msg import Msg

from hetmesh import servers, subjects
from hetmesh.bus import Bus
from hetmesh.protocol import (
    Heartbeat,
    InferenceRequest,
    Placement,
    Role,
    SchedulerStatus,
    SubmitReply,
    TokenChunk,
    Usage,
)

CLUSTER = """
[mesh]
stall_timeout_s = 30.0
[gateway]
submit_timeout_s = 5.0
[[models]]
name = "bench"
tokenizer = "byte"
max_context = 8192
block_size = 16
[[workers]]
name = "peer"
model = "bench"
accelerator = "nvidia-h100"
"""


# --- the instant peer --------------------------------------------------------------------------
async def peer(nats_url: str, chunk_tokens: int) -> None:
    bus = await Bus.connect(nats_url, "bench-peer")

    async def on_submit(req: InferenceRequest, m: object) -> None:
        await bus.respond(m, SubmitReply(request_id=req.request_id,  # type: ignore[arg-type]
                                         placement=Placement(mode="aggregated", decode_worker="peer-0")))
        n = req.sampling.max_tokens
        for start in range(0, n, chunk_tokens):
            k = min(chunk_tokens, n - start)
            last = start + k >= n
            await bus.publish(req.reply_subject, TokenChunk(
                request_id=req.request_id, worker_id="peer-0", index=start, token_ids=[97] * k, text="a" * k,
                finish_reason="length" if last else None,
                usage=Usage(prompt_tokens=len(req.prompt_tokens), completion_tokens=n) if last else None))

    async def on_status(m: Msg) -> None:
        await bus.respond(m, SchedulerStatus(instance="bench-peer", policy="instant", workers=["peer-0"]))

    await bus.subscribe(subjects.SUBMIT, InferenceRequest, on_submit, queue=subjects.SCHEDULER_QUEUE)
    await bus.nc.subscribe(subjects.SCHED_STATUS, queue=subjects.SCHEDULER_QUEUE, cb=on_status)
    while True:
        await bus.publish(subjects.heartbeat("peer-0"), Heartbeat(
            worker_id="peer-0", model="bench", accelerator="nvidia-h100", vendor="nvidia", devices=1, role=Role.BOTH,
            engine="instant", work_subject="unused", queue_depth=0, running=0, max_batch=1024, kv_blocks_total=1,
            kv_blocks_used=0, block_size=16, ts=time.time()))
        await asyncio.sleep(0.5)


def load_body(i: int, max_tokens: int, prompt_len: int) -> bytes:
    return json.dumps({"model": "bench", "prompt": f"{i:08d}" + "x" * (prompt_len - 8), "max_tokens": max_tokens,
                       "stream": True}).encode()


async def load(client: SSEClient, rate: float, duration_s: float, max_tokens: int, prompt_len: int) -> dict[str, float]:
    t_start = time.perf_counter()
    res = await open_loop(client, "/v1/completions", rate, duration_s,
                          lambda i: load_body(i, max_tokens, prompt_len), poisson=False)
    elapsed = time.perf_counter() - t_start
    ttfts = [r.ttft_s for r in res if r.ok]
    return {"requests": len(res), "errors": len(res) - len(ttfts), "achieved_rps": len(res) / elapsed,
            "ttft_p50_ms": percentile(ttfts, 0.5) * 1e3, "ttft_p99_ms": percentile(ttfts, 0.99) * 1e3,
            "ttft_mean_ms": statistics.fmean(ttfts) * 1e3 if ttfts else float("nan")}


async def drive(args: argparse.Namespace, port: int, gw_pid: int, peer_pid: int) -> list[dict[str, float]]:
    client = SSEClient("127.0.0.1", port)
    await client.wait_ready()
    await load(client, 100, 2, args.max_tokens, args.prompt_len)  # warm-up: connections, caches
    rows: list[dict[str, float]] = []
    for rate in args.rates:
        g0, p0 = cpu_seconds([gw_pid]), cpu_seconds([peer_pid])
        row = await load(client, rate, args.duration, args.max_tokens, args.prompt_len)
        g1, p1 = cpu_seconds([gw_pid]), cpu_seconds([peer_pid])
        ok = row["requests"] - row["errors"]
        tokens = ok * args.max_tokens
        row.update(rate=rate, max_tokens=args.max_tokens, chunk_tokens=args.chunk_tokens,
                   gateway_cpu_s=g1 - g0, peer_cpu_s=p1 - p0,
                   gateway_cpu_per_request_us=(g1 - g0) / max(ok, 1) * 1e6,
                   gateway_cpu_per_token_us=(g1 - g0) / max(tokens, 1) * 1e6)
        rows.append(row)
        for f in client.failures[:3]:
            print(f"failed request: {f!r}")
        client.failures.clear()
        await asyncio.sleep(1)
    return rows


def bench(args: argparse.Namespace) -> list[dict[str, float]]:
    nats = servers.start_nats()
    work = Path(tempfile.mkdtemp(prefix="hetmesh-gwbench-"))
    cluster = work / "cluster.toml"
    cluster.write_text(CLUSTER)
    port = servers.free_port()
    env = servers.env_with(HETMESH_NATS_URL=nats.url)
    gw_env = servers.env_with(HETMESH_NATS_URL=nats.url, HETMESH_GATEWAY_PROFILE=args.profile or "")
    gw = subprocess.Popen([sys.executable, "-m", "hetmesh.gateway", "--cluster", str(cluster), "--port",
                           str(port)], env=gw_env)
    pr = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--peer", nats.url,
                           "--chunk-tokens", str(args.chunk_tokens)], env=env)
    try:
        return asyncio.run(drive(args, port, gw.pid, pr.pid))
    finally:
        for p in (gw, pr):
            p.terminate()
            p.wait(10)
        nats.stop()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python benchmarks/gateway_overhead.py", description=__doc__)
    ap.add_argument("--rates", default="50,500", help="request rates to run, comma-separated")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per rate")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--chunk-tokens", type=int, default=1, help="tokens per TokenChunk the peer sends")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--out", default="results/gateway_overhead.json")
    ap.add_argument("--profile", metavar="FILE", help="run the gateway under cProfile, stats to FILE")
    ap.add_argument("--peer", metavar="NATS_URL", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        asyncio.run(peer(args.peer, args.chunk_tokens))
        return
    args.rates = [float(r) for r in args.rates.split(",")]
    rows = bench(args)
    cols = ["rate", "achieved_rps", "errors", "ttft_p50_ms", "ttft_p99_ms", "gateway_cpu_per_request_us",
            "gateway_cpu_per_token_us"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    meta = {"cpus": os.cpu_count(), "python": sys.version.split()[0], "duration_s": args.duration,
            "loadavg_after": os.getloadavg(),
            "prompt_len": args.prompt_len}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"results in {args.out}")


if __name__ == "__main__":
    main()
