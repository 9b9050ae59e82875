"""A worker that slows 2x mid-run, on a live mesh: does the scheduler notice, and does the mesh recover?

Three sim workers of one kind (the cost model's Llama-3.1-8B on an A100 each, real time) under a steady
open loop; one of them really slows 2x after --at seconds (the cluster file's sim_slowdown, unknown to the
scheduler). Run twice, the cost policy learning from the engines' steps and pricing every worker at its
prior. Per 10 s window, from the workers' per-request records on the bus (decode_done: observed and
predicted TTFT and TPOT): the slow worker's share of the requests, its TPOT prediction error (median
|predicted / observed - 1|), and SLO attainment of the whole mesh (the model's TTFT and TPOT SLOs).

    nice .venv/bin/python benchmarks/live_drift.py [--rate 5] [--seconds 100] [--at 30] [--out results/live_drift.json]
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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
from loadgen import SSEClient, open_loop
from rich.console import Console
from rich.table import Table

from hetmesh import subjects
from hetmesh.bus import decode_events
from hetmesh.launcher import Mesh
from hetmesh.launcher.mesh import temp_log_dir

TTFT_SLO, TPOT_SLO = 2.0, 0.1
CLUSTER = """
[mesh]
heartbeat_interval_s = 0.5
[scheduler]
policy = "cost"
ttft_slo_s = {ttft}
tpot_slo_s = {tpot}
[scheduler.options]
learn = {learn}
[[models]]
name = "m"
spec = "llama-3.1-8b"
max_context = 8192
[[workers]]
name = "a"
model = "m"
accelerator = "nvidia-a100-80g"
count = 2
max_batch = 32
[[workers]]
name = "slow"
model = "m"
accelerator = "nvidia-a100-80g"
max_batch = 32
sim_slowdown = 2.0
sim_slowdown_after_s = {at}
"""
WINDOW_S = 10.0


def body(i: int) -> bytes:
    rng = random.Random(i)
    words = " ".join(f"w{rng.randrange(10_000)}" for _ in range(rng.randrange(60, 400)))  # ~0.4-2.4K byte tokens
    return json.dumps({"model": "m", "prompt": f"{i} {words}", "max_tokens": rng.randrange(32, 128),
                       "ignore_eos": True, "stream": True}).encode()


async def run(mesh: Mesh, rate: float, seconds: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per request: when it finished, its prefill and decode workers, observed and predicted TTFT and TPOT."""
    reqs: dict[str, dict[str, Any]] = {}
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def on_msg(m: Any) -> None:
        for e in decode_events(m.data):
            if e.service != "worker" or e.kind not in ("prefill_done", "decode_done"):
                continue
            r = reqs.setdefault(e.request_id, {})
            d = e.detail
            if "ttft_s" in d:
                r.update(p_worker=d["worker_id"], ttft=d["ttft_s"], pttft=d.get("predicted_ttft_s"))
            if "tpot_s" in d:
                r.update(d_worker=d["worker_id"], tpot=d["tpot_s"], ptpot=d.get("predicted_tpot_s"))
            if e.kind == "decode_done":
                r["t"] = loop.time() - t0

    nc = await nats.connect(mesh.nats_url)
    await nc.subscribe(subjects.EVENTS_ALL, cb=on_msg)
    host, port = mesh.url.removeprefix("http://").split(":")
    client = SSEClient(host, int(port))
    results = await open_loop(client, "/v1/completions", rate, seconds, body)
    await asyncio.sleep(2.0)  # the last records' event batch
    await nc.close()
    done = [r for r in reqs.values() if "t" in r and "ttft" in r and "tpot" in r]
    ok = sum(r.ok for r in results)
    print(f"  {ok}/{len(results)} requests ok, {len(done)} with both records")
    met = sum(r["ttft"] <= TTFT_SLO and r["tpot"] <= TPOT_SLO for r in done)
    return done, {"sent": len(results), "ok": ok, "within_slo_of_sent": met / max(len(results), 1)}


def windows(records: list[dict[str, Any]], seconds: float) -> list[dict[str, Any]]:
    out = []
    t = 0.0
    while t < seconds + WINDOW_S:
        rs = [r for r in records if t <= r["t"] < t + WINDOW_S]
        slow = [r for r in rs if r["d_worker"].startswith("slow")]
        err = [abs(r["ptpot"] / r["tpot"] - 1) for r in slow if r.get("ptpot") and r["tpot"]]
        met = [r["ttft"] <= TTFT_SLO and r["tpot"] <= TPOT_SLO for r in rs]
        out.append({"from_s": t, "requests": len(rs), "slow_share": len(slow) / len(rs) if rs else None,
                    "slow_prefill_share": sum(r["p_worker"].startswith("slow") for r in rs) / len(rs) if rs else None,
                    "slow_tpot_error_p50": statistics.median(err) if err else None,
                    "attainment": sum(met) / len(met) if met else None})
        t += WINDOW_S
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=5.0, help="requests per second (Poisson)")
    ap.add_argument("--seconds", type=float, default=100.0)
    ap.add_argument("--at", type=float, default=30.0, help="seconds into the run the slow worker slows 2x")
    ap.add_argument("--out", default="results/live_drift.json")
    args = ap.parse_args()
    res: dict[str, Any] = {"config": vars(args), "runs": {}}
    for learn in (True, False):
        label = "learning" if learn else "prior only"
        print(f"{label}: {args.seconds:.0f} s at {args.rate:g} req/s")
        d = Path(tempfile.mkdtemp(prefix="hetmesh-drift-"))
        # the slowdown's clock starts with the engine, a few seconds before the load (the mesh's start-up)
        (d / "cluster.toml").write_text(CLUSTER.format(ttft=TTFT_SLO, tpot=TPOT_SLO, learn=str(learn).lower(),
                                                       at=args.at))
        mesh = Mesh(d / "cluster.toml", gateway_port=0, log_dir=temp_log_dir())
        mesh.start()
        try:
            records, total = asyncio.run(run(mesh, args.rate, args.seconds))
        finally:
            mesh.stop()
        res["runs"][label] = {"windows": windows(records, args.seconds), "records": len(records), **total}
    t = Table(title=f"One of three workers slows 2x at {args.at:g} s (live sim mesh, {args.rate:g} req/s): per "
                    f"{WINDOW_S:g} s window, learning vs prior only")
    for col in ("window s", "slow share (learn)", "slow share (prior)", "slow TPOT err p50 (learn)",
                "slow TPOT err p50 (prior)", "attainment (learn)", "attainment (prior)"):
        t.add_column(col, justify="right")

    def f(v: float | None, pct: bool = True) -> str:
        return "-" if v is None else (f"{100 * v:.0f}%" if pct else f"{v:.2f}")

    for a, b in zip(res["runs"]["learning"]["windows"], res["runs"]["prior only"]["windows"], strict=True):
        t.add_row(f"{a['from_s']:.0f}-{a['from_s'] + WINDOW_S:.0f}", f(a["slow_share"]), f(b["slow_share"]),
                  f(a["slow_tpot_error_p50"]), f(b["slow_tpot_error_p50"]), f(a["attainment"]), f(b["attainment"]))
    con = Console(width=140)
    con.print(t)
    for label, r in res["runs"].items():
        con.print(f"{label}: {r['ok']}/{r['sent']} served (the rest refused by SLO admission), "
                  f"{100 * r['within_slo_of_sent']:.1f}% of all sent within both SLOs")
    res["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "load": os.getloadavg(),
                      "date": datetime.now(UTC).isoformat(timespec="seconds")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
