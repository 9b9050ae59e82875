"""What flow control costs the scheduler, per request, in one process: the flow queue's operations against the
cost policy's placement.

The cost policy places a stream of requests on a synthetic fleet (three server kinds, views as heartbeats);
separately, the same stream goes through the flow queue as the scheduler's flow gate drives it at a full
fleet, the worst case: every request is priced, counted, held (something of its band is always held), and
placed by a pump that first finds the fleet still full for a tenant's head, places the request behind it (its
tenant's lookahead) with the headroom owed, and finds the fleet full again for the next one; every placed
request finishes. Eight tenants in two bands, requests
arriving at --rate per second. CPU per request = flow operations' time / requests, against the policy's
placement time / placements; alternated --repeats times, the best of each kept (the machine is shared).

    python benchmarks/flow_cost.py [--fleets 16 64 256] [--rate 500] [--out results/flow_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from hetmesh.costmodel import server_model
from hetmesh.placement import RequestInfo, WorkerView
from hetmesh.placement.cost import CostPolicy
from hetmesh.placement.flow import FlowQueue, Tenant, Turns, reserved
from hetmesh.protocol import Role
from hetmesh.wiring import pricer

KINDS = ("nvidia-h100", "amd-mi300x", "amd-mi308x")
MODEL = "llama-3.1-70b"
TENANTS = [Tenant(f"t{i}", float(1 + i % 4), i % 2) for i in range(8)]
WAIT_S = 1.0  # a held request's deadline after its arrival
BACKLOG = 512  # requests held at a full fleet


def fleet(n: int) -> list[WorkerView]:
    return [WorkerView(worker_id=f"w{i}", model=MODEL, accelerator=KINDS[i % 3], vendor=KINDS[i % 3].split("-")[0],
                       devices=8, role=Role.BOTH, queue_depth=i % 4, running=8 + i % 16, max_batch=128,
                       kv_blocks_total=100_000, kv_blocks_used=20_000 + 500 * (i % 8), block_size=16)
            for i in range(n)]


def requests(n: int, rate: float, seed: int = 1) -> list[RequestInfo]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(128, 8192, n)
    return [RequestInfo(request_id=f"r{i}", model=MODEL, prompt_len=int(prompts[i]), max_tokens=256, arrival=i / rate)
            for i in range(n)]


def placement(n: int, reqs: list[RequestInfo]) -> float:
    """The cost policy's CPU seconds per placement."""
    views = fleet(n)
    pol = CostPolicy(models={MODEL: MODEL})
    t0 = time.process_time()
    for r in reqs:
        pol.place(r, views)
    return (time.process_time() - t0) / len(reqs)


def flow(reqs: list[RequestInfo]) -> float:
    """The flow queue's CPU seconds per request at a full fleet (the shell's calls, as the flow gate makes them)."""
    price = pricer(server_model(KINDS[0], MODEL, devices=8), 128)
    q = FlowQueue(TENANTS, max_held=10_000, reserve=0.5)
    names = [t.name for t in TENANTS]
    for i in range(BACKLOG):  # the backlog a full fleet holds
        q.hold(f"b{i}", names[i % len(names)], 1.0, 1e9, 0.0)
    inflight: deque[tuple[str, float]] = deque()
    t0 = time.process_time()
    for i, r in enumerate(reqs):
        now = r.arrival
        t = names[i % len(names)]
        cost = price(r.prompt_len, 0, r.max_tokens)
        q.arrived(t, cost, now)
        if q.may_try(t):
            reserved(r, q.headroom(t, now))
        q.hold(r.request_id, t, cost, now + WAIT_S, now, r)
        for h in q.expired(now):
            q.refused(h.tenant)
        turns = Turns(q)
        if (h := turns.next()) is not None:  # the pump's first look finds the fleet still full for it
            turns.refused(h, now)
        h = turns.next()  # a finish freed room: the request behind the refused head goes
        if h is not None:
            reserved(r, q.headroom(h.tenant, now, turns.done))
            q.take(h, now)
            q.placed(h.tenant, h.cost, r.prompt_len + r.max_tokens, now)
            inflight.append((h.tenant, h.cost))
        if (h := turns.next()) is not None:  # the next one no longer fits
            turns.refused(h, now)
        if len(inflight) > 64:
            done, c = inflight.popleft()
            q.finished(done, c, now)
    return (time.process_time() - t0) / len(reqs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fleets", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--rate", type=float, default=500.0, help="requests per second")
    ap.add_argument("--seconds", type=float, default=8.0, help="seconds of requests per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="results/flow_cost.json")
    args = ap.parse_args()
    reqs = requests(int(args.rate * args.seconds), args.rate)
    flow_s = min(flow(reqs) for _ in range(args.repeats))
    rows = []
    for n in args.fleets:
        place_s = min(placement(n, reqs) for _ in range(args.repeats))
        rows.append({"workers": n, "place_us": place_s * 1e6, "flow_us": flow_s * 1e6, "ratio": flow_s / place_s})
    t = Table(title=f"Flow control's scheduler CPU per request, {args.rate:.0f} req/s, full fleet, {BACKLOG} held, "
                    f"{len(TENANTS)} tenants in 2 bands (best of {args.repeats})")
    for col in ("workers", "placement us", "flow queue us", "flow / placement"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["workers"]), f"{r['place_us']:.0f}", f"{r['flow_us']:.1f}", f"{r['ratio']:.3f}")
    Console(width=130).print(t)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python benchmarks/flow_cost.py", "config": vars(args), "rows": rows,
                               "machine": f"{platform.platform()}, {os.cpu_count()} cores, python "
                                          f"{platform.python_version()}",
                               "load_average": os.getloadavg(),
                               "date": datetime.now(UTC).isoformat(timespec="seconds")}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
