"""KV transfer benchmark: prefill worker -> decode worker, real processes on loopback, per data plane.

Each request is a disaggregated pair (PREFILL on a Rubin CPX worker, DECODE on a Rubin VR200
worker) for llama-3.1-8b (128 KiB of KV per token), with the sim engine at a time scale that
makes engine time negligible, so what is measured is the KV's trip: over one TCP stream into the
decode worker's KV port (`direct`, kv-transfer coordinating) or over NATS through the kv-transfer
relay (`nats`). The size is the real KV size, the bytes are really sent (the sim engine's are zeros).

    python benchmarks/kv_transfer.py [--tokens 128 512 2048] [--concurrency 1 4] [--planes direct nats]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import nats
from loadgen import raw_tcp_mb_per_s
from rich.console import Console
from rich.table import Table

from hetmesh import servers, subjects
from hetmesh.bus import decode_events, encode
from hetmesh.costmodel import CostModel, accelerator, model_spec
from hetmesh.kvindex.blocks import block_hashes
from hetmesh.protocol import (
    Heartbeat,
    InferenceRequest,
    Phase,
    Placement,
    ResponseEvent,
    SamplingParams,
    ServiceEvent,
    TokenChunk,
    WorkItem,
)

MODEL, SPEC = "llama8", "llama-3.1-8b"
CLUSTER = f"""
[mesh]
time_scale = 1000000.0
heartbeat_interval_s = 0.5
[[models]]
name = "{MODEL}"
spec = "{SPEC}"
max_context = 131072
block_size = 16
[[workers]]
name = "cpx"
model = "{MODEL}"
accelerator = "nvidia-rubin-cpx"
role = "prefill"
[[workers]]
name = "vr200"
model = "{MODEL}"
accelerator = "nvidia-rubin-vr200"
role = "decode"
"""


def cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


async def bench(nats_url: str, tokens: list[int], concurrency: list[int], repeats: int,
                procs: dict[str, subprocess.Popen[bytes]]) -> list[dict[str, Any]]:
    nc = await nats.connect(nats_url)
    seen: set[str] = set()
    events: dict[str, ServiceEvent] = {}
    done: dict[str, asyncio.Event] = {}
    hb_dec, resp_dec = (msgspec.json.Decoder(Heartbeat),
                                msgspec.json.Decoder(ResponseEvent))

    async def on_hb(m: Any) -> None:
        seen.add(hb_dec.decode(m.data).worker_id)

    async def on_event(m: Any) -> None:
        for e in decode_events(m.data):
            if e.kind == "kv_transferred":
                events[e.request_id] = e

    async def on_resp(m: Any) -> None:
        ev = resp_dec.decode(m.data)
        if not isinstance(ev, TokenChunk) or ev.finish_reason:
            done[ev.request_id].set()

    await nc.subscribe(subjects.HEARTBEAT_ALL, cb=on_hb)
    await nc.subscribe(subjects.event("kv-transfer"), cb=on_event)
    await nc.subscribe(f"{subjects.PREFIX}.resp.>", cb=on_resp)
    async with asyncio.timeout(60):
        while True:
            if {"cpx-0", "vr200-0"} <= seen:
                break
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # kv-transfer subscribed too (it starts with the workers)

    rng = random.Random(0)
    bpt = CostModel(accelerator("nvidia-rubin-cpx"), model_spec(SPEC)).kv_bytes_per_token()

    async def one(n_tokens: int) -> float:
        rid = uuid.uuid4().hex[:12]
        toks = [rng.randrange(32, 127) for _ in range(n_tokens)]
        req = InferenceRequest(request_id=rid, model=MODEL, prompt_tokens=toks,
                               block_hashes=block_hashes(MODEL, toks, 16),
                               sampling=SamplingParams(max_tokens=2, ignore_eos=True),
                               reply_subject=subjects.reply(rid), arrival_ts=time.time())
        pl = Placement(mode="disaggregated", decode_worker="vr200-0", prefill_worker="cpx-0")
        done[rid] = asyncio.Event()
        t0 = time.perf_counter()
        await nc.publish(subjects.work_direct("decode", "nvidia", "nvidia-rubin-vr200", "vr200-0"),
                         encode(WorkItem(request=req, phase=Phase.DECODE, placement=pl)))
        await nc.publish(subjects.work_direct("prefill", "nvidia", "nvidia-rubin-cpx", "cpx-0"),
                         encode(WorkItem(request=req, phase=Phase.PREFILL, placement=pl)))
        await asyncio.wait_for(done[rid].wait(), 120)
        elapsed = time.perf_counter() - t0
        async with asyncio.timeout(10):
            while True:
                if rid in events:
                    break
                await asyncio.sleep(0.01)
        return elapsed

    rows: list[dict[str, Any]] = []
    for conc in concurrency:
        for n in tokens:
            events.clear()
            c0 = {k: cpu_s(p.pid) for k, p in procs.items()}
            t0 = time.perf_counter()
            e2e: list[float] = []
            for _ in range(repeats):
                e2e += await asyncio.gather(*(one(n) for _ in range(conc)))
            wall = time.perf_counter() - t0
            cpu = {k: cpu_s(p.pid) - c0[k] for k, p in procs.items()}
            evs = list(events.values())
            assert all(e.detail["ok"] for e in evs), [e.detail.get("error") for e in evs]
            nbytes = sum(int(e.detail["nbytes"]) for e in evs)  # type: ignore[arg-type]
            durs = [float(e.detail["duration_s"]) for e in evs]  # type: ignore[arg-type]
            rows.append({
                "prompt_tokens": n, "concurrency": conc, "transfers": len(evs),
                "mb_per_transfer": n * bpt / 1e6, "nbytes_per_transfer": n * bpt, "transfer_p50_ms": statistics.median(durs) * 1e3,
                "request_p50_ms": statistics.median(e2e) * 1e3,
                "transfer_mb_per_s": nbytes / 1e6 / sum(durs) * conc,
                "aggregate_mb_per_s": nbytes / 1e6 / wall,
                "cpu_ms_per_mb": {k: v * 1e3 / (nbytes / 1e6) for k, v in cpu.items()},
            })
    await nc.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="results/kv_transfer.json")
    ap.add_argument("--planes", nargs="+", default=["direct", "nats"], choices=["direct", "nats"])
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for plane in args.planes:
        srv = servers.start_nats()
        d = Path(tempfile.mkdtemp(prefix="hetmesh-kvbench-"))
        (d / "cluster.toml").write_text(CLUSTER + f'[kv_transfer]\ndata_plane = "{plane}"\n')
        env = servers.env_with(HETMESH_NATS_URL=srv.url)
        procs: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for name, argv in {"kv-transfer": ["hetmesh.kv_transfer", "--instance", "kvx-bench"],
                               "prefill-worker": ["hetmesh.worker", "--worker-id", "cpx-0"],
                               "decode-worker": ["hetmesh.worker", "--worker-id", "vr200-0"]}.items():
                procs[name] = subprocess.Popen([sys.executable, "-m", *argv, "--cluster", str(d / "cluster.toml")],
                                               env=env, stdout=open(d / f"{name}.log", "wb"), stderr=subprocess.STDOUT)
            rows += [dict(r, plane=plane)
                     for r in asyncio.run(bench(srv.url, args.tokens, args.concurrency, args.repeats, procs))]
        finally:
            for p in procs.values():
                p.terminate()
            for p in procs.values():
                p.wait(10)
            srv.stop()
    time.sleep(2)  # the workers are gone: the baseline gets the machine
    sizes = sorted({r["nbytes_per_transfer"] for r in rows})
    tcp = raw_tcp_mb_per_s(sizes, 3 * args.repeats, keep=False)
    for r in rows:
        r["tcp_mb_per_s"] = tcp[r["nbytes_per_transfer"]]
        r["ratio"] = r["transfer_mb_per_s"] / r["tcp_mb_per_s"]
    t = Table(title=f"KV transfer prefill worker -> decode worker ({SPEC}, 128 KiB/token, loopback)")
    for c in ("data plane", "prompt tok", "MB", "conc", "transfer p50 ms", "request p50 ms", "MB/s per transfer",
              "raw TCP MB/s", "per transfer / TCP", "MB/s total", "CPU ms/MB prefill", "kv-transfer", "decode"):
        t.add_column(c, justify="right")
    for r in rows:
        cpu = r["cpu_ms_per_mb"]
        t.add_row(r["plane"], str(r["prompt_tokens"]), f"{r['mb_per_transfer']:.1f}", str(r["concurrency"]),
                  f"{r['transfer_p50_ms']:.1f}", f"{r['request_p50_ms']:.1f}", f"{r['transfer_mb_per_s']:.0f}",
                  f"{r['tcp_mb_per_s']:.0f}", f"{r['ratio'] * 100:.0f}%",
                  f"{r['aggregate_mb_per_s']:.0f}", f"{cpu['prefill-worker']:.2f}", f"{cpu['kv-transfer']:.2f}",
                  f"{cpu['decode-worker']:.2f}")
    Console(width=160).print(t)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                         "python": platform.python_version()},
                               "config": vars(args)}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
