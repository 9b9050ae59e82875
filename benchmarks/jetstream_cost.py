"""What a JetStream work queue would cost per work item, against the core NATS publish the
scheduler uses now (the issue asks for WorkItems on a work-queue stream with acks and redelivery).

One nats-server (JetStream on), one process. A sender hands a WorkItem-sized message to a
receiver, which answers on a core subject; the round trip is measured, one message at a time:
  core            publish -> subscription (what the mesh does today)
  js memory/file  js.publish (waits for the PubAck, dedup by Nats-Msg-Id) to a work-queue stream ->
                  push consumer with explicit ack (the receiver acks, then answers)
Prints a table and writes results/jetstream_cost.json.

    .venv/bin/python benchmarks/jetstream_cost.py --n 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

import nats
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from rich.console import Console
from rich.table import Table

from hetmesh import servers
from hetmesh.bus import encode
from hetmesh.protocol import InferenceRequest, Phase, Placement, SamplingParams, WorkItem


def work_item(i: int) -> bytes:
    req = InferenceRequest(request_id=f"gw-{i}", model="m", prompt_tokens=list(range(200)), block_hashes=list(range(12)),
                           sampling=SamplingParams(max_tokens=128), reply_subject=f"hetmesh.resp.gw.{i}-0",
                           arrival_ts=time.time())
    return encode(WorkItem(request=req, phase=Phase.FULL, placement=Placement(mode="aggregated", decode_worker="w")))


async def measure(nc: nats.NATS, mode: str, n: int, warmup: int) -> list[float]:
    subject = f"bench.{mode}.work"
    got: asyncio.Queue[float] = asyncio.Queue()

    async def on_done(_m: object) -> None:
        got.put_nowait(time.perf_counter())

    await nc.subscribe(f"bench.{mode}.done", cb=on_done)
    js = nc.jetstream()
    if mode == "core":
        async def on_work(m: nats.aio.msg.Msg) -> None:
            await nc.publish(f"bench.{mode}.done", b"")

        await nc.subscribe(subject, cb=on_work)
    else:
        storage = StorageType.MEMORY if mode == "js-memory" else StorageType.FILE
        await js.add_stream(StreamConfig(name=f"WORK_{storage.value.upper()}", subjects=[subject],
                                         retention=RetentionPolicy.WORK_QUEUE, storage=storage))

        async def on_js(m: nats.aio.msg.Msg) -> None:
            await m.ack()
            await nc.publish(f"bench.{mode}.done", b"")

        await js.subscribe(subject, durable=f"w_{storage.value}", cb=on_js, manual_ack=True)
    await nc.flush()
    out = []
    for i in range(warmup + n):
        data = work_item(i)
        t0 = time.perf_counter()
        if mode == "core":
            await nc.publish(subject, data)
        else:
            await js.publish(subject, data, headers={"Nats-Msg-Id": f"gw-{i}-0-full"})
        t1 = await asyncio.wait_for(got.get(), 10)
        if i >= warmup:
            out.append(t1 - t0)
    return out


async def run(n: int) -> dict[str, dict[str, float]]:
    srv = servers.start_nats()
    try:
        nc = await nats.connect(srv.url)
        res = {}
        for mode in ("core", "js-memory", "js-file"):
            lat = sorted(await measure(nc, mode, n, warmup=min(200, n)))
            res[mode] = {"p50_ms": round(statistics.median(lat) * 1e3, 3),
                         "p99_ms": round(lat[int(0.99 * (len(lat) - 1))] * 1e3, 3),
                         "mean_ms": round(statistics.fmean(lat) * 1e3, 3)}
        await nc.close()
        return res
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--out", default="results/jetstream_cost.json")
    args = ap.parse_args()
    res = asyncio.run(run(args.n))
    core = res["core"]["p50_ms"]
    t = Table("work item hop", "p50 ms", "p99 ms", "mean ms", "p50 added")
    for mode, r in res.items():
        t.add_row(mode, f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}", f"{r['mean_ms']:.3f}",
                  "-" if mode == "core" else f"+{r['p50_ms'] - core:.3f} ms")
    Console().print(t)
    doc = {"n": args.n, "results": res, "ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
