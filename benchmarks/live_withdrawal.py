"""Withdrawals on the live mesh: two real schedulers placing bursts at once, against one.

A mesh started as `hetmesh up` starts it (its own nats-server and redis-server, sim-engine workers at time scale
0.05: Llama-3.1-8B on H100s, a 4,000-token prefill ~1-2 s of wall time), the cost policy without SLO admission
(so that nothing is refused and every request's placement counts), and one or two scheduler processes. Bursts
of requests sent at once (mixed prompt lengths) spread over the schedulers as the gateway spreads them, so two
schedulers place within the bookings' delay of each other. Per run: requests served and their text checked
against the sim engine's own definition, errors, end-to-end latency, and from the schedulers' metrics how many
of their own placements they judged again on an earlier booking heard late (`rechecked`) and took back
(`withdrawn`); from the services' events, the items their workers dropped (the rest their engines had started:
refused, they went on), the P/D placements' DECODE halves ended with them, and the gateway's restarts; and how late
each scheduler handled the other's bookings (`hetmesh_scheduler_booking_lag_seconds`: from the placement to its
handling, the window in which two schedulers place on views that miss each other: the simulator's --share-s).
What it shows is the path working on its
own collisions (no staging) with nothing lost, not a goodput figure: the simulator measures that
(benchmarks/scheduler_replicas.py).

    .venv/bin/python benchmarks/live_withdrawal.py [--bursts 12] [--burst 8] [--out results/live_withdrawal.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import nats
import openai
from mesh_replicas import start
from rich.console import Console
from rich.table import Table

from hetmesh import subjects
from hetmesh.bus import decode_events
from hetmesh.engines.sampling import expected_completion
from hetmesh.metrics import histogram_quantile, scrape, total
from hetmesh.protocol import SamplingParams
from hetmesh.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
TOK = ByteTokenizer()
CLUSTER = """
[mesh]
time_scale = 0.05
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 3.0
stall_timeout_s = 60.0
[scheduler]
policy = "cost"
admission_margin = 0.0
[[models]]
name = "m"
spec = "llama-3.1-8b"
max_context = 8192
block_size = 16
[[workers]]
name = "h100"
model = "m"
accelerator = "nvidia-h100"
role = "both"
count = 3
max_batch = 2
"""
MAX_TOKENS = 8
LAG = "hetmesh_scheduler_booking_lag_seconds"


async def run(schedulers: int, bursts: int, burst: int, seed: int) -> dict[str, Any]:
    mesh, _, _ = start(schedulers, 1, "cost", CLUSTER)  # every scheduler ready and heard beating
    try:
        nc = await nats.connect(mesh.nats_url)
        seen = {"gateway_restarts": 0, "dropped": 0, "decode_halves": 0}

        async def on_events(m: Any) -> None:
            for e in decode_events(m.data):
                if e.service == "gateway" and e.kind == "retried" and e.detail.get("reason") == "withdrawn":
                    seen["gateway_restarts"] += 1
                elif e.service == "worker" and e.kind == "withdrawn":  # an item dropped, or a P/D's DECODE half
                    seen["decode_halves" if e.detail.get("phase") == "decode" else "dropped"] += 1

        await nc.subscribe(subjects.EVENTS_ALL, cb=on_events)
        client = openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=300)
        rng = random.Random(seed)
        lat: list[float] = []
        wrong = errors = 0

        async def one(i: int, n_words: int) -> None:
            nonlocal wrong, errors
            prompt = f"{i} " + "the fleet is full, who goes next " * n_words
            t0 = time.perf_counter()
            try:
                r = await client.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS,
                                                    extra_body={"ignore_eos": True})
            except openai.APIError:
                errors += 1
                return
            lat.append(time.perf_counter() - t0)
            want = expected_completion(TOK, TOK.encode(prompt), SamplingParams(max_tokens=MAX_TOKENS,
                                                                               ignore_eos=True))[1]
            wrong += r.choices[0].text != want

        t0 = time.perf_counter()
        for b in range(bursts):
            await asyncio.gather(*(one(b * burst + k, rng.randint(15, 120)) for k in range(burst)))
        wall = time.perf_counter() - t0
        urls = mesh.metrics_urls()
        scraped = [await asyncio.to_thread(scrape, url) for name, url in urls.items() if name.startswith("scheduler")]
        rechecked = {k: sum(total(s, "hetmesh_scheduler_rechecked_total", outcome=k) for s in scraped)
                     for k in ("kept", "withdrawn")}
        # how late the schedulers heard each other's bookings (placement to handling it): the window for collisions
        heard = sum(total(s, f"{LAG}_count") for s in scraped)
        lag = {"mean_ms": sum(total(s, f"{LAG}_sum") for s in scraped) / heard * 1e3 if heard else None}
        lag |= {f"p{round(q * 100)}_ms": None if (v := histogram_quantile(q, scraped, LAG)) is None else v * 1e3
                for q in (0.5, 0.9, 0.99)}
        await asyncio.sleep(1.0)  # the last events' batch
        await nc.close()
        return {"schedulers": schedulers, "requests": bursts * burst, "served": len(lat), "errors": errors,
                "wrong_text": wrong, "wall_s": wall, "latency_p50_s": statistics.median(lat) if lat else None,
                "latency_p90_s": statistics.quantiles(lat, n=10)[-1] if len(lat) > 1 else None,
                "rechecked_kept": rechecked["kept"], "withdrawn": rechecked["withdrawn"],
                "dropped_by_worker": seen["dropped"], "refused_by_worker": rechecked["withdrawn"] - seen["dropped"],
                "decode_halves_ended": seen["decode_halves"], "gateway_withdrawn_restarts": seen["gateway_restarts"],
                "bookings_heard": heard, "booking_lag": lag}
    finally:
        mesh.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bursts", type=int, default=12)
    ap.add_argument("--burst", type=int, default=8, help="requests sent at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "results" / "live_withdrawal.json"))
    a = ap.parse_args()
    la = os.getloadavg()
    rows = [asyncio.run(run(n, a.bursts, a.burst, a.seed)) for n in (1, 2)]
    t = Table(title=f"Withdrawals on the live mesh ({a.bursts} bursts of {a.burst}, 3 H100 sim workers, max_batch 2)")
    for c in ("schedulers", "served / sent", "errors", "wrong text", "p50 s", "p90 s", "rechecked: kept",
              "withdrawn", "dropped by their worker", "refused (started)", "P/D decode halves ended",
              "gateway restarts (withdrawn)", "booking lag mean / p50 / p90 / p99 ms"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r["schedulers"]), f"{r['served']} / {r['requests']}", str(r["errors"]), str(r["wrong_text"]),
                  f"{r['latency_p50_s']:.2f}", f"{r['latency_p90_s']:.2f}", f"{r['rechecked_kept']:.0f}",
                  f"{r['withdrawn']:.0f}", str(r["dropped_by_worker"]), f"{r['refused_by_worker']:.0f}",
                  str(r["decode_halves_ended"]), str(r["gateway_withdrawn_restarts"]),
                  " / ".join("-" if v is None else f"{v:.2f}" for v in r["booking_lag"].values()))
    Console().print(t)
    out = {"machine": platform.node(), "cpus": os.cpu_count(), "load_average_start": la,
           "load_average_end": os.getloadavg(), "bursts": a.bursts, "burst": a.burst, "seed": a.seed, "runs": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))
    # nothing lost, each withdrawal's item dropped once and placed anew once
    ok = all(r["errors"] == 0 and r["wrong_text"] == 0 and r["dropped_by_worker"] == r["gateway_withdrawn_restarts"]
             for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
