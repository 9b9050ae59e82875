"""Placement tier: how many requests one scheduler process's placement core places per second, by fleet size
and policy. Pure core only (no bus, no Redis, no engines): synthetic workers' heartbeats fold into a
`ClusterState`, and each placement is what the scheduler does between two awaits: read the views, ask the
policy, book the decision (which makes the next placement rebuild the views, as in the scheduler).

Times are this process's CPU time (the machine may be shared). `decisions` is a digest of every decision of a fixed
run (same seed: 1,024 placements with bookings and a heartbeat round every 256) per policy and size, so a change
meant to make placement faster can show it places the same: `--check FILE` compares against FILE's digests. Heartbeats cost too: every worker sends `mesh.heartbeat_interval_s` (0.5 s) apart, so a fleet of N folds 2N
a second. `placements/s` is one core's capacity left after those: (1 - heartbeat share) / time per placement.

    python benchmarks/placement_tier.py [--sizes 16 64 256 1024 4096] [--policies ...] [--out results/placement_tier.json]
        [--check results/placement_tier.json] [--against DIR --rounds 4]

`--against DIR` (a checkout of earlier code, e.g. `git archive <commit> libs | tar -x -C DIR`) measures each policy and
size in turn with DIR's libs and with these, `--rounds` times each in fresh processes, so both see the same load on
a shared machine: their medians and the ratio go to the results.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hetmesh import config, subjects, wiring
from hetmesh.placement import ClusterState, RequestInfo
from hetmesh.protocol import Heartbeat, Role

ACCELERATORS = ("nvidia-h100", "nvidia-h200", "amd-mi300x")
POLICIES = ("round_robin", "least_loaded", "prefix_aware", "cost", "llm_d", "dynamo")
HEARTBEATS_PER_WORKER_S = 2.0  # mesh.heartbeat_interval_s = 0.5


def cluster(policy: str) -> config.ClusterConfig:
    cfg = config.ClusterConfig(scheduler=config.SchedulerConfig(policy=policy),
                               models=[config.ModelConfig(name="m", spec="llama-3.1-8b", block_size=16)])
    return cfg.validate()


def heartbeat(i: int, rng: random.Random, ts: float) -> Heartbeat:
    acc = ACCELERATORS[i % len(ACCELERATORS)]
    wid = f"w{i}"
    role = Role.BOTH if i % 4 else (Role.PREFILL if i % 8 else Role.DECODE)
    return Heartbeat(worker_id=wid, model="m", accelerator=acc, vendor=acc.split("-")[0], devices=1, role=role,
                     engine="sim", work_subject=subjects.work_direct(role.value, "v", acc, wid),
                     queue_depth=rng.randint(0, 4), running=rng.randint(0, 64), max_batch=64,
                     kv_blocks_total=100_000, kv_blocks_used=rng.randint(0, 90_000), block_size=16, ts=ts)


def _fleet(policy: str, size: int) -> tuple[random.Random, object, ClusterState, list[Heartbeat]]:
    rng = random.Random(size)
    pol = wiring.policy(cluster(policy))
    state = ClusterState(heartbeat_timeout_s=1e9)
    beats = [heartbeat(i, rng, 0.0) for i in range(size)]
    for hb in beats:
        state.observe(hb, 0.0)
    return rng, pol, state, beats


def _requests(rng: random.Random, ids: list[str], n: int) -> list[RequestInfo]:
    """Requests made up front (the prefix index's answer: a few workers holding some of the prompt)."""
    return [RequestInfo(request_id=f"r{k}", model="m", prompt_len=rng.randint(200, 4000), max_tokens=256,
                        cached_blocks={ids[rng.randrange(len(ids))]: rng.randint(0, 32) for _ in range(4)},
                        block_size=16, arrival=k * 1e-3) for k in range(n)]


def decisions(policy: str, size: int, n: int = 1024) -> str:
    """A digest of every decision (workers, predictions) of a fixed run: n placements, booked, a round of heartbeats
    every 256."""
    rng, pol, state, beats = _fleet(policy, size)
    reqs = _requests(rng, [hb.worker_id for hb in beats], n)
    h = hashlib.sha256()
    for k, info in enumerate(reqs):
        if k and k % 256 == 0:
            for hb in beats:
                state.observe(hb, 1.0)
        d = pol.place(info, state.views())  # type: ignore[attr-defined]
        if d is not None and d.mode != "refused":
            state.assigned(d)
        h.update(repr(None if d is None else (d.mode, d.prefill_worker, d.decode_worker, d.predicted_ttft_s,
                                              d.predicted_tpot_s, d.retry_after_s)).encode())
    return h.hexdigest()[:16]


def measure(policy: str, size: int, seconds: float) -> dict[str, float]:
    rng, pol, state, beats = _fleet(policy, size)
    # heartbeats: fold the whole fleet's once, timed
    t0 = time.process_time()
    for hb in beats:
        state.observe(hb, 1.0)
    state.views()
    hb_s = (time.process_time() - t0) / size
    reqs = _requests(rng, [hb.worker_id for hb in beats], 256)
    n, t0 = 0, time.process_time()  # this process's CPU: other processes on a shared machine do not count
    while (elapsed := time.process_time() - t0) < seconds:
        for info in reqs[:50] if n % 100 else reqs[50:100]:
            d = pol.place(info, state.views())  # type: ignore[attr-defined]
            if d is not None and d.mode != "refused":
                state.assigned(d)
            n += 1
        if n % 5000 == 0:  # a round of heartbeats now and then: the bookings start again from the workers' counts
            for hb in beats:
                state.observe(hb, 1.0)
    per = elapsed / n
    hb_share = min(hb_s * HEARTBEATS_PER_WORKER_S * size, 1.0)
    return {"us_per_placement": per * 1e6, "us_per_heartbeat": hb_s * 1e6, "heartbeat_cpu_share": hb_share,
            "placements_per_s": (1 - hb_share) / per}


def against(root: str, policy: str, size: int, seconds: float, rounds: int) -> dict[str, object]:
    """µs per placement of the code in `root` and of this code, measured in turn in fresh processes."""
    code = (f"import sys, json; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import placement_tier as P; "
            f"print(json.dumps(P.measure({policy!r}, {size}, {seconds})))")
    us: dict[str, list[float]] = {"before": [], "now": []}
    for _ in range(rounds):
        for key in us:
            env = dict(os.environ)
            if key == "before":
                env["PYTHONPATH"] = str(Path(root) / "libs")
            r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            us[key].append(json.loads(r.stdout.strip().splitlines()[-1])["us_per_placement"])
    before, now = statistics.median(us["before"]), statistics.median(us["now"])
    return {"policy": policy, "workers": size, "us_before": us["before"], "us_now": us["now"], "ratio": now / before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--seconds", type=float, default=1.5, help="per (policy, size)")
    ap.add_argument("--out", default="results/placement_tier.json")
    ap.add_argument("--check", default=None, help="a results file: are this run's decisions the same as its?")
    ap.add_argument("--against", default=None, help="a checkout of earlier code: time per placement, now over then")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    if args.against:
        ab = [against(args.against, p, n, args.seconds, args.rounds) for p in args.policies for n in args.sizes]
        for r in ab:
            print(f"{r['policy']} {r['workers']}: {statistics.median(r['us_now']):.0f} µs now, "  # type: ignore[arg-type]
                  f"{statistics.median(r['us_before']):.0f} before: {r['ratio']:.3f}x")  # type: ignore[arg-type]
        path = Path(args.out)
        res = json.loads(path.read_text()) if path.exists() else {}
        res["against_earlier"] = {"load_average": os.getloadavg(), "rows": ab}
        path.write_text(json.dumps(res, indent=1))
        return
    stored = {}
    if args.check:
        stored = {(r["policy"], r["workers"]): r.get("decisions") for r in json.loads(Path(args.check).read_text())["rows"]}
    rows = []
    t = Table(title="placements per second of one scheduler process (pure core, heartbeats at 2/s per worker)")
    for col in ("policy", "workers", "µs / placement", "µs / heartbeat", "heartbeat CPU", "placements/s", "decisions"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for policy in args.policies:
        for size in args.sizes:
            r = {"policy": policy, "workers": size, **measure(policy, size, args.seconds),
                 "decisions": decisions(policy, size)}
            rows.append(r)
            same = stored.get((policy, size))
            t.add_row(policy, str(size), f"{r['us_per_placement']:.0f}", f"{r['us_per_heartbeat']:.1f}",
                      f"{100 * r['heartbeat_cpu_share']:.1f}%", f"{r['placements_per_s']:,.0f}",
                      r["decisions"] + ("" if same is None else " same" if same == r["decisions"] else " DIFFERENT"))
    Console().print(t)
    out = {"machine": {"python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "load_average": os.getloadavg()},
           "seconds_each": args.seconds, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
