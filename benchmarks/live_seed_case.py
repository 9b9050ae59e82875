"""The seed case study on the live mesh: gateway, scheduler (the same policy objects the simulator
uses), sim-engine workers and kv-transfer as separate processes over NATS and Redis.

Three layouts of ops/clusters/seed-case-study.toml (DeepSeek-R1 FP8 on 1x MI300X + 2x MI308X):
the load balancer (all `both`, least_loaded), the seed's static split (MI300X prefill, MI308X
decode) and the shipped cost policy (all `both`). Each is driven by a closed loop of 12 clients
with the seed workload (hetmesh.sim.casestudy.Workload: prompts 4096 +-25%, outputs 256 +-25%,
the very length sequence the simulator draws) and compared with the simulator run on the same
cluster file. Engine time runs `--time-scale` times faster than virtual time, so
tok/s (virtual) = output tokens / (wall seconds * time_scale).

    .venv/bin/python benchmarks/live_seed_case.py [--time-scale 5] [--heartbeat-s 0.05] [--out results/live_seed_case.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import string
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from casestudy import Workload
from loadgen import SSEClient, cpu_seconds, percentile
from rich.console import Console
from rich.table import Table

from hetmesh import config
from hetmesh.launcher import Mesh
from hetmesh.metrics import scrape
from hetmesh.sim import SimConfig, Slo, simulate, workers_from_config

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "ops/clusters/seed-case-study.toml"
PATH = "/v1/completions"
# (label, policy, role of the MI300X group, role of the MI308X group)
LAYOUTS = [
    ("load balancer (least_loaded, all both)", "least_loaded", "both", "both"),
    ("static split (MI300X P / MI308X D)", "least_loaded", "prefill", "decode"),
    ("cost (all both, shipped file)", "cost", "both", "both"),
]


def cluster_toml(policy: str, roles: dict[str, str], time_scale: float, heartbeat_s: float) -> str:
    """The shipped seed cluster file with the policy, the roles, the time scale and the heartbeat
    interval replaced."""
    text = BASE.read_text()
    base = tomllib.loads(text)
    assert {g["name"] for g in base["workers"]} == set(roles), "seed cluster file changed its worker groups"
    out: list[str] = []
    group = ""
    for line in text.splitlines():
        key = line.split("=", 1)[0].strip()
        if line.startswith("name = "):
            group = line.split("=", 1)[1].strip().strip('"')
        if key == "time_scale":
            line = f"time_scale = {time_scale!r}\nheartbeat_interval_s = {heartbeat_s!r}"
        elif key == "policy":
            line = f'policy = "{policy}"'
        elif key == "role" and group in roles:
            line = f'role = "{roles[group]}"'
        out.append(line)
    return "\n".join(out) + "\n"


def lengths(wl: Workload, servers: int) -> list[tuple[int, int]]:
    """(prompt, output) lengths in the order the simulator's closed loop issues them."""
    loop = wl.closed_loop(servers)
    out = []
    while (r := loop.next(0.0)) is not None:
        out.append((r.input_len, r.output_len))
    return out


@dataclass(slots=True)
class Done:
    start_s: float
    end_s: float
    ttft_s: float
    tokens: int
    expected: int
    ok: bool


def prompt(i: int, n: int, rng: random.Random) -> str:
    """n ASCII bytes (n byte-tokenizer tokens), distinct from the first block on: no prefix hits."""
    head = f"request {i}: "
    return head + "".join(rng.choices(string.ascii_letters, k=n - len(head)))


async def drive(mesh: Mesh, model: str, work: list[tuple[int, int]], clients: int) -> list[Done]:
    client = SSEClient(mesh.cfg.gateway.host, mesh.port)
    await client.wait_ready()
    # /ready answers 200 once the scheduler has every worker in its view (Mesh.start waited for that).
    rng = random.Random(7)
    bodies = [json.dumps({"model": model, "prompt": prompt(i, n_in, rng), "max_tokens": n_out, "stream": True,
                          "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
              for i, (n_in, n_out) in enumerate(work)]
    out: list[Done] = []
    nxt = 0

    async def user() -> None:
        nonlocal nxt
        while nxt < len(bodies):
            i, nxt = nxt, nxt + 1
            t0 = time.perf_counter()
            r = await client.stream(PATH, bodies[i])
            out.append(Done(t0, t0 + r.total_s, r.ttft_s, r.completion_tokens, work[i][1], r.ok))

    await asyncio.gather(*(user() for _ in range(clients)))
    if client.failures:
        print(f"{len(client.failures)} failures, first: {client.failures[0]}")
    return out


def steady_tok_s(ends: list[float], tokens: list[int]) -> float:
    """The simulator's definition (hetmesh.sim.metrics): output tokens of the requests that finish
    between the 10th and 90th percentile of finish times, over that window."""
    s = sorted(ends)
    t0, t1 = s[int(0.1 * (len(s) - 1))], s[int(0.9 * (len(s) - 1))]
    got = sum(k for e, k in zip(ends, tokens, strict=True) if t0 < e <= t1)
    return got / (t1 - t0) if t1 > t0 else float("nan")


def summarize_live(done: list[Done], scale: float) -> dict[str, Any]:
    ok = [d for d in done if d.ok]
    t_begin = min(d.start_s for d in done)
    ends = [(d.end_s - t_begin) * scale for d in ok]
    ttft = [d.ttft_s * scale for d in ok]
    tpot = [(d.end_s - d.start_s - d.ttft_s) * scale / (d.tokens - 1) for d in ok if d.tokens > 1]
    return {"requests": len(done), "errors": len(done) - len(ok),
            "short": sum(d.tokens != d.expected for d in ok),  # ignore_eos: every request its full length
            "output_tok_s_steady": steady_tok_s(ends, [d.tokens for d in ok]),
            "output_tok_s": sum(d.tokens for d in ok) / max(ends),
            "virtual_duration_s": max(ends), "wall_s": max(ends) / scale,
            "ttft_s": {"p50": percentile(ttft, 0.5), "p90": percentile(ttft, 0.9), "mean": statistics.fmean(ttft)},
            "tpot_s": {"p50": percentile(tpot, 0.5), "p90": percentile(tpot, 0.9), "mean": statistics.fmean(tpot)}}


def _modes(m: dict[str, int]) -> str:
    return f"{m.get('aggregated', 0)}:{m.get('disaggregated', 0)}"


def placement_modes(url: str) -> dict[str, int]:
    """The scheduler's placements by kind (aggregated / disaggregated), from its /metrics."""
    out: dict[str, int] = {}
    for (name, labels), v in scrape(url).items():
        if name == "hetmesh_scheduler_placements_total":
            mode = dict(labels)["mode"]
            out[mode] = out.get(mode, 0) + int(v)
    return out


def run_live(text: str, wl: Workload, work: list[tuple[int, int]]) -> dict[str, Any]:
    d = Path(tempfile.mkdtemp(prefix="hetmesh-live-seed-"))
    (d / "cluster.toml").write_text(text)
    mesh = Mesh(d / "cluster.toml", gateway_port=0, log_dir=d / "logs")
    mesh.start()
    try:
        cfg = mesh.cfg
        pids = [s.proc.pid for s in mesh.services.values() if s.proc]
        c0, w0 = cpu_seconds(pids), time.perf_counter()
        servers = sum(g.count for g in cfg.workers)
        done = asyncio.run(drive(mesh, cfg.models[0].name, work, wl.clients_per_server * servers))
        cpu, wall = cpu_seconds(pids) - c0, time.perf_counter() - w0
        modes = placement_modes(mesh.metrics_urls()["scheduler"])
    finally:
        mesh.stop()
    s = summarize_live(done, cfg.mesh.time_scale)
    s["modes"] = modes
    s["mesh_cpu_cores"] = cpu / wall
    s["logs"] = str(d / "logs")
    return s


def run_sim(text: str, wl: Workload) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    cfg = config.load(Path(f.name))
    os.unlink(f.name)
    ws = workers_from_config(cfg)
    slo = Slo(cfg.scheduler.ttft_slo_s, cfg.scheduler.tpot_slo_s)
    s, _ = simulate(ws, cfg.scheduler.policy, wl.closed_loop(len(ws)), SimConfig(), slo)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-scale", type=float, default=5.0)
    # The load the scheduler sees is as old as the last heartbeat (plus what it placed since; ends are
    # not subtracted): 0.5 s of wall time is 5 virtual seconds at time scale 10, a whole prefill.
    ap.add_argument("--heartbeat-s", type=float, default=0.05, help="heartbeat interval, wall seconds")
    ap.add_argument("--requests-per-client", type=int, default=Workload().requests_per_client)
    ap.add_argument("--only", nargs="*", type=int, help="layout indices to run (default all)")
    ap.add_argument("--out", default="results/live_seed_case.json")
    args = ap.parse_args()
    wl = Workload(requests_per_client=args.requests_per_client)
    work = lengths(wl, 3)
    con = Console(width=140)
    rows = []
    for k, (label, policy, r300, r308) in enumerate(LAYOUTS):
        if args.only and k not in args.only:
            continue
        text = cluster_toml(policy, {"mi300x": r300, "mi308x": r308}, args.time_scale, args.heartbeat_s)
        sim = run_sim(text, wl)
        live = run_live(text, wl, work)
        rows.append({"label": label, "policy": policy, "roles": {"mi300x": r300, "mi308x": r308},
                     "live": live, "sim": {k2: sim[k2] for k2 in ("output_tok_s_steady", "output_tok_s", "duration_s",
                                                                   "ttft_s", "tpot_s", "modes", "requests")}})
        con.print(f"{label}: live {live['output_tok_s_steady']:.1f} tok/s, sim {sim['output_tok_s_steady']:.1f} "
                  f"({live['wall_s']:.1f} s wall, {live['errors']} errors)")
    lb = rows[0]["live"]["output_tok_s_steady"] if rows and rows[0]["label"].startswith("load") else float("nan")
    lb_sim = rows[0]["sim"]["output_tok_s_steady"] if rows and rows[0]["label"].startswith("load") else float("nan")
    t = Table(title=f"seed case on the live mesh (time scale {args.time_scale:g}, heartbeat {args.heartbeat_s:g} s "
                    f"wall, {len(work)} requests, virtual seconds)")
    for c in ("configuration", "live tok/s", "sim tok/s", "live/sim", "x LB live", "x LB sim", "TTFT p50 live/sim",
              "TPOT p50 live/sim", "agg/disagg live/sim", "errors"):
        t.add_column(c, justify="right")
    for r in rows:
        lv, sm = r["live"], r["sim"]
        r["live_over_sim"] = lv["output_tok_s_steady"] / sm["output_tok_s_steady"]
        r["x_lb_live"] = lv["output_tok_s_steady"] / lb
        r["x_lb_sim"] = sm["output_tok_s_steady"] / lb_sim
        t.add_row(r["label"], f"{lv['output_tok_s_steady']:.1f}", f"{sm['output_tok_s_steady']:.1f}",
                  f"{r['live_over_sim']:.3f}", f"{r['x_lb_live']:.2f}", f"{r['x_lb_sim']:.2f}",
                  f"{lv['ttft_s']['p50']:.2f} / {sm['ttft_s']['p50']:.2f}",
                  f"{lv['tpot_s']['p50'] * 1e3:.0f} / {sm['tpot_s']['p50'] * 1e3:.0f} ms",
                  f"{_modes(lv['modes'])} / {_modes(sm['modes'])}", f"{lv['errors']}+{lv['short']}")
    con.print(t)
    res = {"rows": rows, "workload": wl.describe(), "time_scale": args.time_scale,
           "heartbeat_interval_s": args.heartbeat_s, "cluster_base": str(BASE.relative_to(ROOT)),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                       "processor": platform.processor() or platform.machine()},
           "config": vars(args)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    con.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
